"""Shared utilities of the SGLang plugin tests (unique basename: pytest imports helpers by module name).

- `rebind_triton_aliases()`: SGLang's Triton modules bind `tl` builtins to module names (`exp = tl.exp`); under
  `TRITON_INTERPRET=1` the interpreter patches the builtins on `tl` only, so those names are replaced with
  forwarders that look the builtin up on `tl` at call time (a no-op on real Triton).
- `kit_testcase()`: SGLang's kits take a `unittest.TestCase` (for `skipTest` / asserts); this gives one whose
  `skipTest` becomes `pytest.skip`.
- `server_args(**fields)`: SGLang's context override of the published server args, as a context manager.
- `load_k3_plugins(*names)`: runs SGLang's real `load_plugins()` with `SGLANG_PLUGINS` restricted to ours, once
  per process (SGLang guards it), then returns the plugin module.
"""
from __future__ import annotations

import contextlib
import os
import sys
import unittest

import pytest


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class _TlForward:
    """Calls `getattr(module, name)` at call time: the interpreter's patched builtin while a kernel runs."""

    def __init__(self, module, name: str):
        self.module, self.name = module, name

    def __call__(self, *args, **kwargs):
        return getattr(self.module, self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"_TlForward({self.module.__name__}.{self.name})"


def _tl_builtins() -> dict[int, tuple[object, str]]:
    import triton.language as tl

    found: dict[int, tuple[object, str]] = {}
    for module in (tl.math, tl):  # tl last: a builtin exported by both forwards to tl's name
        for name in dir(module):
            value = getattr(module, name)
            if callable(value) and not isinstance(value, type) and not name.startswith("_"):
                found[id(value)] = (module, name)
    return found


def rebind_triton_aliases(prefix: str = "sglang.") -> int:
    """Replaces module-level aliases of `tl` builtins in loaded `prefix*` modules; returns how many it rebound."""
    if not _interpreting():
        return 0
    builtins = _tl_builtins()
    rebound = 0
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith(prefix) or module is None:
            continue
        for name, value in list(vars(module).items()):
            target = builtins.get(id(value))
            if target is not None and not isinstance(value, _TlForward):
                setattr(module, name, _TlForward(*target))
                rebound += 1
    return rebound


class _KitCase(unittest.TestCase):
    def runTest(self):  # pragma: no cover - never run, only used for its assert/skip methods
        pass

    def skipTest(self, reason):
        pytest.skip(reason)


def kit_testcase() -> unittest.TestCase:
    return _KitCase()


@contextlib.contextmanager
def server_args(**fields):
    """`get_context().override_server_args(**fields)` installed for the block, restored after it."""
    from sglang.srt.runtime_context import get_context

    override = get_context().override_server_args(**fields)
    args = override.install()
    try:
        yield args
    finally:
        override.restore()


def load_k3_plugins():
    """SGLang's own plugin loading (entry point `sglang.srt.plugins: k3`), restricted to ours."""
    os.environ["SGLANG_PLUGINS"] = "k3"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import k3_sglang

    return k3_sglang


class ContextOverride:
    """A kit's `get_context()` with our fields winning over what the kit publishes (e.g. `linear_attn_backend="k3"`
    where the kit sets "triton": the same field `--linear-attn-backend` sets)."""

    def __init__(self, context, **fields):
        self._context, self._fields = context, fields

    def override_server_args(self, **fields):
        return self._context.override_server_args(**{**fields, **self._fields})

    def __getattr__(self, name):
        return getattr(self._context, name)


def run_kda_verify(case, topk: int):
    """One TARGET_VERIFY forward of SGLang's KDA kit on CPU (fp32) for `case` with a `topk` eagle tree:
    (fixture, inputs, the SSM pool before the forward, the output)."""
    import torch
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.test.kits.attention_unittest.attention_methods import kda_attention as kit
    from sglang.test.kits.attention_unittest.runner_modes import speculative_target_verify_runner as verify_kit

    fixture = kit.build_kda_attention_fixture(kit_testcase(), case, dtype=torch.float32, device="cpu")
    verify_kit._prepare_target_verify_batch(fixture.forward_batch, case, "cpu")
    fixture.forward_batch.spec_info = verify_kit._make_spec_verify_input(
        case, fixture.forward_batch, topk=topk, device="cpu", spec_kind="eagle")
    inputs = kit.kda_fixture_inputs(fixture)
    pool_before = kit._ssm_states(fixture).clone()
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=fixture.backend)):
        fixture.backend.init_forward_metadata(fixture.forward_batch)
        out = kit.run_kda_forward(fixture, fixture.forward_batch, inputs)
    return fixture, inputs, pool_before, out
