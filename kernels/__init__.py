"""k3_kernels: K3's kernels. Each op folder holds `naive.py` (plain-torch reference, the spec) beside its
fast Triton implementation; `k3.model.ops` picks one of them for the model in a single place."""
