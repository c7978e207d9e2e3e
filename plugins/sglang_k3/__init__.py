"""k3_sglang: K3's RL serving features inside SGLang 0.5.23, through SGLang's own plugin points.

SGLang calls `register()` (entry point `sglang.srt.plugins: k3`) in every process before it parses server args;
`SGLANG_PLUGINS=k3` restricts loading to this plugin. `register()` calls each feature module's `register()` in
the fixed order below; a feature module that is not there is skipped. Registering only makes each feature
selectable: each one is switched on by one flag of its own (README.md beside this file):

| feature          | module          | flag                                                       |
|------------------|-----------------|------------------------------------------------------------|
| KDA kernels      | kda_backend     | `--linear-attn-backend k3` (or the `-decode/-prefill/-verify-backend` forms) |
| RL radix cache   | radix_cache     | `--radix-cache-backend k3`                                  |
| ReplaySSM spec   | spec            | `--speculative-algorithm K3_REPLAY`                         |
| XOR-delta update | weights         | `update_weights_from_tensor(..., load_format="k3_xor_delta")` |
| routed experts   | routed_experts  | `--enable-return-routed-experts` (ids in Router Replay's layout) |
| DP pairing       | dp_pairing      | `SGLANG_K3_DP_PAIRING=1`                                    |

The CPU platform (`platform.py`) is a separate entry point (`sglang.srt.platforms: k3_cpu`).
"""
from __future__ import annotations

import importlib
import importlib.util

FEATURES = ("kda_backend", "radix_cache", "spec", "weights", "routed_experts", "dp_pairing")

_registered: list[str] = []


def register() -> list[str]:
    """Registers every feature module present (idempotent); returns the names registered."""
    for name in FEATURES:
        if name in _registered or importlib.util.find_spec(f"{__name__}.{name}") is None:
            continue
        importlib.import_module(f"{__name__}.{name}").register()
        _registered.append(name)
    return list(_registered)
