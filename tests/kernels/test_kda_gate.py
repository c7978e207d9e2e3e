"""The in-kernel gate's backward pass (kernels/kda/gate.py) against fp64 autograd over the reference gates
(naive.py), and chunk_kda's gradients with it against the torch-autograd gate backward it replaces."""
from __future__ import annotations

import pytest
import torch

from k3_kernels.kda import chunk_kda, naive_kda_gate, naive_kda_lowerbound_gate
from k3_kernels.kda.gate import gate_backward
from test_kda import DEV, _run, assert_close, make_inputs


def _reference_grads(g, dG, A_log, dt_bias, gate, lower_bound):
    leaves = [x.detach().double().requires_grad_(True) if x is not None else None for x in (g, A_log, dt_bias)]
    y = naive_kda_gate(*leaves) if gate == 1 else naive_kda_lowerbound_gate(*leaves, lower_bound)
    live = [x for x in leaves if x is not None]
    grads = iter(torch.autograd.grad(y, live, dG.double()))
    return [next(grads) if x is not None else None for x in leaves]


@pytest.mark.parametrize("gate,has_a,has_dt", [(1, True, True), (2, True, True), (2, False, True), (2, True, False)],
                         ids=["default", "safe", "safe_no_A", "safe_no_dt"])
def test_gate_backward_matches_autograd(bounds_guard, gate, has_a, has_dt):
    """Tokens not a multiple of a program's 256, K = 60 (masked tiles), two heads; bitwise reruns."""
    B, T, HV, K = 2, 300, 2, 60
    g = torch.randn(B, T, HV, K, device=DEV) * 2
    dG = torch.randn(B, T, HV, K, device=DEV)
    A_log = torch.rand(HV, device=DEV) if has_a else None
    dt_bias = torch.randn(HV * K, device=DEV) if has_dt else None
    lb = -5.0 if gate == 2 else None
    dg, dA, ddt = gate_backward(g, dG, A_log, dt_bias, gate, lb)
    rg, rA, rdt = _reference_grads(g, dG, A_log, dt_bias, gate, lb)
    assert dg.dtype == g.dtype and dg.shape == g.shape
    assert_close("dg", rg, dg, 1e-5)
    assert (dA is None) == (A_log is None) and (ddt is None) == (dt_bias is None)
    if dA is not None:
        assert dA.shape == A_log.shape
        assert_close("dA_log", rA, dA, 1e-5)
    if ddt is not None:
        assert ddt.shape == dt_bias.shape
        assert_close("ddt_bias", rdt, ddt, 1e-5)
    again = gate_backward(g, dG, A_log, dt_bias, gate, lb)
    assert all(a is None or torch.equal(a, b) for a, b in zip((dg, dA, ddt), again))
    assert bounds_guard is None or bounds_guard.checked > 0


def test_chunk_gate_backward_replaces_autograd(monkeypatch):
    """chunk_kda with K3's safe gate in the kernel: every gradient with gate.py's pass is the torch-autograd
    path's within fp32 rounding (dq, dk, dv, dbeta, dh0 bitwise: the gate's backward only touches dg and the gate
    parameters)."""
    from k3_kernels.kda import chunk as chunk_mod
    B, T, HV, K, V = 1, 100, 2, 32, 16
    inp = make_inputs(B, T, 1, HV, K, V, gate_raw=True)
    inp["h0"] = torch.randn(B, HV, K, V, device=DEV)
    inp["A_log"] = torch.rand(HV, device=DEV)
    inp["dt_bias"] = torch.randn(HV * K, device=DEV)
    grads = {"o": torch.randn(B, T, HV, V, device=DEV), "ht": torch.randn(B, HV, K, V, device=DEV)}
    kw = dict(output_final_state=True, use_gate_in_kernel=True, lower_bound=-5.0)
    runs = {}
    for how in ("torch", "triton"):
        monkeypatch.setitem(chunk_mod.CONFIG, "gate_bwd", how)
        runs[how] = _run(chunk_kda, inp, grads, **kw)[1]
    for n in ("q", "k", "v", "beta", "h0"):
        assert torch.equal(runs["torch"][n], runs["triton"][n]), n
    for n in ("g", "A_log", "dt_bias"):
        assert_close("d" + n, runs["torch"][n].double(), runs["triton"][n], 1e-5)


def _two_regime_case(T: int, K: int, V: int, dtype=torch.float32, cu=None):
    """Raw gate inputs whose head 0 decays ~-5 a token under the safe gate (dt_bias +20: its chunks take the
    16-row-block intra launch) and head 1 almost not at all (dt_bias -20: the whole-chunk launch), so both intra
    launches have work and read the G tiles the first one wrote."""
    inp = make_inputs(1, T, 1, 2, K, V, dtype=dtype, gate_raw=True)
    inp["h0"] = torch.randn(1 if cu is None else len(cu) - 1, 2, K, V, device=DEV)
    inp["A_log"] = torch.rand(2, device=DEV)
    inp["dt_bias"] = torch.cat([torch.full((K,), 20.), torch.full((K,), -20.)]).to(DEV)
    grads = {"o": torch.randn(1, T, 2, V, device=DEV).to(dtype), "ht": torch.randn(*inp["h0"].shape, device=DEV)}
    return inp, grads


def _fused_cumsum_runs(monkeypatch, inp, grads, **kw):
    from k3_kernels.kda import chunk as chunk_mod
    runs = []
    for fused in (False, True):
        monkeypatch.setitem(chunk_mod.CONFIG, "fwd_fused_cumsum", fused)
        runs.append(_run(chunk_kda, inp, grads, output_final_state=True, **kw))
    return runs


@pytest.mark.parametrize("gate", ["safe", "default", "none"])
def test_fused_cumsum_keeps_bits(monkeypatch, gate):
    """CONFIG `fwd_fused_cumsum`: the whole-chunk intra launch computes every chunk's G tile (gate + in-chunk
    cumsum) itself instead of reading the cumsum launch's. Same arithmetic, so outputs, final states and every
    gradient must be bitwise the separate launch's: a packed batch with an empty sequence and lengths not a multiple
    of 64 (masked rows), K = 60 (masked columns), both intra launches busy (`_two_regime_case`), and a lone
    sequence cut into forward time segments (each segment's launches start at a later chunk)."""
    from k3_kernels.kda import chunk as chunk_mod
    from test_kda import _assert_same_bits
    kw = dict(use_gate_in_kernel=gate != "none", lower_bound=-5.0 if gate == "safe" else None)
    cu = [0, 150, 150, 230]
    inp, grads = _two_regime_case(cu[-1], 60, 16, cu=cu)
    if gate == "none":
        inp = {n: x for n, x in inp.items() if n not in ("A_log", "dt_bias")}
        inp["g"] = -torch.rand_like(inp["g"]) * torch.tensor([5., 0.01], device=DEV)[:, None]
    _assert_same_bits(_fused_cumsum_runs(monkeypatch, inp, grads, cu_seqlens=torch.tensor(cu, device=DEV), **kw))
    for key in ("fwd_segment_chunks", "fwd_segment_programs"):
        monkeypatch.setitem(chunk_mod.CONFIG, key, 2)
    monkeypatch.setitem(chunk_mod.CONFIG, "fwd_segments", 3)
    chunk_mod._chunk_plan.cache_clear()
    if gate == "safe":
        inp, grads = _two_regime_case(400, 32, 16)
        _assert_same_bits(_fused_cumsum_runs(monkeypatch, inp, grads, **kw))
    chunk_mod._chunk_plan.cache_clear()


@pytest.mark.gpu
def test_gpu_fused_cumsum_keeps_bits(monkeypatch):
    """On the GPU the fused prologue's G tile is read back by other threads of the block after a barrier, and its
    cumsum is compiled inside another kernel (CPU counterpart: `test_fused_cumsum_keeps_bits`): bf16 at
    K = V = 128, K3's safe gate, 4K tokens with both intra launches busy, outputs, final state and gradients
    bitwise the separate cumsum launch's."""
    from test_kda import _assert_same_bits
    inp, grads = _two_regime_case(4096, 128, 128, dtype=torch.bfloat16)
    for n in ("q", "k", "v", "beta"):
        inp[n] = inp[n].to(torch.bfloat16)
    _assert_same_bits(_fused_cumsum_runs(monkeypatch, inp, grads, use_gate_in_kernel=True, lower_bound=-5.0))
