"""k3_kernels: K3's kernels. Each op folder holds `naive.py` (plain-torch reference, the spec) beside its
fast Triton implementation; `k3_kernels.backend` picks one of them in a single place."""
