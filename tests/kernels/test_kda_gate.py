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
