"""KDA Triton kernels (chunk_kda fwd/bwd, fused_recurrent_kda decode) against the fp64 references, FLA's metric.
On CPU the kernels run under TRITON_INTERPRET=1 at small shapes; GPU tests also compare with fla-core's chunk_kda."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3_kernels.kda import (chunk_kda, fused_recurrent_kda, l2norm, naive_chunk_kda, naive_kda_gate,
                            naive_kda_lowerbound_gate, naive_recurrent_kda)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # on CPU, tests/conftest.py has set TRITON_INTERPRET=1 before triton's import


def assert_close(name: str, ref: torch.Tensor, tri: torch.Tensor, ratio: float) -> None:
    """FLA's metric: pass if max |ref - tri| <= 1e-6, else require rms(ref - tri) / rms(ref) < ratio."""
    assert torch.isfinite(tri).all(), f"{name}: non-finite values"
    diff = (ref.double() - tri.double())
    if diff.abs().max().item() <= 1e-6:
        return
    err = diff.pow(2).mean().sqrt().item() / max(ref.double().pow(2).mean().sqrt().item(), 1e-30)
    assert err < ratio, f"{name}: relative RMS error {err:.3e} >= {ratio}"


def make_inputs(B: int, T: int, H: int, HV: int, K: int, V: int, dtype=torch.float32, gate_raw: bool = False,
                device: str = DEV) -> dict[str, torch.Tensor]:
    """Fresh random KDA inputs in FLA's layouts: unit-norm k, log-decay g <= 0 (or raw gate input), beta in (0,1)."""
    q = torch.randn(B, T, H, K, device=device).to(dtype)
    k = l2norm(torch.randn(B, T, H, K, device=device)).to(dtype)
    v = torch.randn(B, T, HV, V, device=device).to(dtype)
    if gate_raw:
        g = torch.randn(B, T, HV, K, device=device)
    else:
        g = F.logsigmoid(torch.randn(B, T, HV, K, device=device)) * 0.5
    beta = torch.rand(B, T, HV, device=device).to(dtype)
    return dict(q=q, k=k, v=v, g=g, beta=beta)


# ---------------------------------------------------------------------------------------------- chunk_kda

TOL = dict(o=5e-3, ht=5e-3, q=8e-3, k=8e-3, v=8e-3, g=2e-2, beta=2e-2, h0=8e-3, A_log=2e-2, dt_bias=8e-3)


def _run(fn, inp: dict, grads: dict | None, **kw):
    """Run fn on fresh leaf copies of inp; backprop `grads` (for o and ht); return outputs and input grads."""
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inp.items()}
    args = {n: leaves[n] for n in ("q", "k", "v", "g", "beta")}
    if "h0" in leaves:
        kw["initial_state"] = leaves["h0"]
    for n in ("A_log", "dt_bias"):
        if n in leaves:
            kw[n] = leaves[n]
    o, ht = fn(**args, **kw)
    outs = {"o": o, "ht": ht}
    if grads is not None:
        pairs = [(outs[n], grads[n]) for n in ("o", "ht") if outs[n] is not None]
        torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
    return outs, {n: x.grad for n, x in leaves.items()}


def _reference(inp: dict, gate: str | None = None, lower_bound=None, l2=False, cu=None, **kw):
    """fp64 naive_recurrent_kda with autograd (per sequence when packed), with the gate / l2norm in torch."""
    def fn(q, k, v, g, beta, initial_state=None, output_final_state=False, A_log=None, dt_bias=None, scale=None):
        q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
        if l2:
            q, k = l2norm(q), l2norm(k)
        if gate == "default":
            g = naive_kda_gate(g, A_log.double(), dt_bias.double() if dt_bias is not None else None)
        elif gate == "safe":
            g = naive_kda_lowerbound_gate(g, A_log.double() if A_log is not None else None,
                                          dt_bias.double() if dt_bias is not None else None, lower_bound)
        h0 = initial_state.double() if initial_state is not None else None
        if cu is None:
            return naive_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0,
                                       output_final_state=output_final_state)
        os_, hs = [], []
        for i in range(len(cu) - 1):
            s = slice(cu[i], cu[i + 1])
            o, h = naive_recurrent_kda(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], scale=scale,
                                       initial_state=h0[i:i + 1] if h0 is not None else None, output_final_state=True)
            os_.append(o)
            hs.append(h)
        return torch.cat(os_, 1), (torch.cat(hs, 0) if output_final_state else None)
    return fn


def _check_against_reference(inp, cu=None, gate=None, lower_bound=None, l2=False, scale=None):
    kw = dict(output_final_state=True, scale=scale)
    ours_kw = dict(kw, use_qk_l2norm_in_kernel=l2, use_gate_in_kernel=gate is not None, lower_bound=lower_bound,
                   cu_seqlens=torch.tensor(cu, device=DEV) if cu is not None else None)
    B, T, HV, V = inp["v"].shape
    N = B if cu is None else len(cu) - 1
    grads = {"o": torch.randn(B, T, HV, V, device=DEV), "ht": torch.randn(N, HV, inp["k"].shape[-1], V, device=DEV)}
    ours, dours = _run(chunk_kda, inp, grads, **ours_kw)
    ref, dref = _run(_reference(inp, gate, lower_bound, l2, cu), {n: x.double() for n, x in inp.items()},
                     {n: x.double() for n, x in grads.items()}, **kw)
    for n in ("o", "ht"):
        assert_close(n, ref[n], ours[n], TOL[n])
    for n in inp:
        assert dours[n] is not None and dours[n].shape == inp[n].shape, n
        assert_close("d" + n, dref[n], dours[n], TOL[n])
    return dref, dours


@pytest.mark.parametrize("B,T,H,HV,K,V", [
    (2, 80, 1, 1, 32, 32),    # T not a chunk multiple, batch of two
    (1, 71, 1, 2, 16, 24),    # grouped value heads, V not a power of two
    (1, 37, 1, 1, 32, 16),    # shorter than one chunk
])
def test_chunk_matches_reference(B, T, H, HV, K, V):
    inp = make_inputs(B, T, H, HV, K, V)
    inp["h0"] = torch.randn(B, HV, K, V, device=DEV)
    _check_against_reference(inp, scale=0.3 if K == 16 else None)


@pytest.mark.parametrize("cu", [[0, 37, 100, 106, 300],  # the last is long enough to get its own state-pass group
                                [0, 0, 70, 70, 150]], ids=["groups", "empty"])  # empty sequences: h0 -> ht
def test_chunk_varlen_matches_reference(cu):
    inp = make_inputs(1, cu[-1], 1, 1, 16, 16)
    inp["h0"] = torch.randn(len(cu) - 1, 1, 16, 16, device=DEV)
    _check_against_reference(inp, cu=cu)


@pytest.mark.parametrize("decay", ["strong", "mixed"])
def test_chunk_strong_decay_takes_the_exact_path(decay):
    """Log-decays so steep that a 16-step tile spans more than e^80 (every tile, or some channels of it): the
    diagonal blocks fall back from the two-exponential dots to the exact column-by-column form. "mixed" makes
    only the first chunk's first 16 channels steep: that chunk goes to the forward intra kernel's 16-row-block
    launch, the second chunk (every channel spans <= 80) to its whole-chunk launch."""
    inp = make_inputs(1, 100, 1, 1, 64, 16)
    steep = -15. * torch.rand(1, 100, 1, 64, device=DEV) - 5.
    where = (torch.arange(100, device=DEV) < 64)[:, None] & (torch.arange(64, device=DEV) < 16)[None, :]
    inp["g"] = steep if decay == "strong" else torch.where(where[None, :, None, :], steep, inp["g"])
    inp["h0"] = torch.randn(1, 1, 64, 16, device=DEV)
    _check_against_reference(inp)


def test_chunk_correlated_keys_couple_every_block():
    """Nearly parallel keys, beta near 1 and slow decay make A = beta <k_i e^{G_i-G_j}, k_j> large in every
    16-row block, so (I + A)^-1 depends on every block of the chunk (the last row block on the first through
    all the ones between): with random keys those long-range terms are too small for the tolerance to see."""
    inp = make_inputs(1, 128, 1, 1, 32, 16)
    base = torch.randn(1, 1, 1, 32, device=DEV)
    inp["k"] = l2norm(base + 0.3 * torch.randn(1, 128, 1, 32, device=DEV))
    inp["beta"] = 0.7 + 0.3 * torch.rand(1, 128, 1, device=DEV)
    inp["g"] = -0.02 * torch.rand(1, 128, 1, 32, device=DEV)
    inp["h0"] = torch.randn(1, 1, 32, 16, device=DEV)
    _check_against_reference(inp)


@pytest.mark.parametrize("gate", ["default", "safe"])
def test_chunk_gate_and_l2norm_in_kernel(gate):
    B, T, H, HV, K, V = 1, 70, 1, 1, 16, 16
    inp = make_inputs(B, T, H, HV, K, V, gate_raw=True)
    inp["q"], inp["k"] = inp["q"] * 3, inp["k"] * 2  # not unit norm: the in-kernel l2norm matters
    inp["A_log"] = torch.rand(HV, device=DEV) * (1.5 if gate == "default" else 0.5)
    inp["dt_bias"] = torch.randn(HV * K, device=DEV) * 0.5
    _check_against_reference(inp, gate=gate, lower_bound=-5.0 if gate == "safe" else None, l2=True)


def _tf32_operands(x):
    """fp32 array rounded as the tensor cores read a TF32 operand (10-bit mantissa, round to nearest, ties away)."""
    import numpy as np
    if x.dtype != np.float32:
        return x
    return ((np.ascontiguousarray(x).view(np.uint32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.skipif(CUDA, reason="interpreter-only emulation; on the GPU, test_gpu_bf16_against_reference[True] "
                                 "runs the real TF32 dots")
@pytest.mark.parametrize("lower_bound", [-5.0, -1.0], ids=["blocks", "whole_chunk"])
def test_chunk_tf32_safe_gate_gradients(monkeypatch, lower_bound):
    """K3's safe gate decays fast (down to -5 per token), so every in-chunk pair (i, j) adds a large term to dG_i and
    subtracts it from dG_j and the reverse cumsum over tokens cancels the two: rounded independently on the two
    sides, TF32 dot operands left dg 6e-3 and ddt_bias 3.8e-2 from the fp64 reference (FLA's tolerance 8e-3; the H200
    measured 7.3e-3 / 4.1e-2 with bf16 inputs). The interpreter computes dots in fp32, so this rounds the operands
    of every dot asked for TF32 first, as the GPU does, and runs the backward in TF32 (what bf16 inputs get).
    Lower bound -5: chunks span more than e^80 of decay (the backward intra's 16-row blocks); -1: at most e^64 (its
    whole-chunk dots around each channel's midpoint, `_bwd_whole`)."""
    import k3_kernels.kda.chunk as chunk_mod
    from triton.runtime import interpreter
    create_dot = interpreter.InterpreterBuilder.create_dot

    def tf32_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if str(input_precision).upper().endswith("TF32"):  # not TF32x3 / IEEE
            a = interpreter.TensorHandle(_tf32_operands(a.data), a.dtype.scalar)
            b = interpreter.TensorHandle(_tf32_operands(b.data), b.dtype.scalar)
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", tf32_dot)
    monkeypatch.setitem(chunk_mod.CONFIG, "dot_precision", "tf32")
    B, T, H, HV, K, V = 2, 300, 2, 2, 128, 128
    inp = make_inputs(B, T, H, HV, K, V, gate_raw=True)
    inp["h0"] = torch.randn(B, HV, K, V, device=DEV)
    inp["A_log"] = torch.zeros(HV, device=DEV)
    inp["dt_bias"] = torch.randn(HV * K, device=DEV) * 0.1
    dref, dours = _check_against_reference(inp, gate="safe", lower_bound=lower_bound)
    for n in ("g", "dt_bias"):  # rounding each pair once leaves them at dq's error level (~4e-4; fla-core's GPU: ~3e-3)
        assert_close("d" + n + " (tight)", dref[n], dours[n], 2e-3)


def test_chunk_matches_naive_chunk_without_grad():
    inp = make_inputs(1, 128, 1, 1, 16, 16)
    with torch.no_grad():
        o, ht = chunk_kda(**inp, output_final_state=True)
        o2, ht2 = naive_chunk_kda(**inp, output_final_state=True)
    assert_close("o", o2, o, 5e-3)
    assert_close("ht", ht2, ht, 5e-3)


def test_chunk_deterministic_and_batch_invariant():
    """Bitwise-equal reruns, and a sequence's outputs/grads do not depend on what else is packed with it."""
    cu = [0, 20, 90]
    inp = make_inputs(1, cu[-1], 1, 1, 16, 16)
    inp["h0"] = torch.randn(2, 1, 16, 16, device=DEV)
    grads = {"o": torch.randn(1, cu[-1], 1, 16, device=DEV), "ht": torch.randn(2, 1, 16, 16, device=DEV)}
    kw = dict(output_final_state=True, cu_seqlens=torch.tensor(cu, device=DEV))
    a, da = _run(chunk_kda, inp, grads, **kw)
    b, db = _run(chunk_kda, inp, grads, **kw)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    for n in da:
        assert torch.equal(da[n], db[n]), "d" + n
    # the second sequence alone
    s = slice(cu[1], cu[2])
    alone = {n: (x[:, s] if n != "h0" else x[1:]) for n, x in inp.items()}
    c, dc = _run(chunk_kda, alone, {"o": grads["o"][:, s], "ht": grads["ht"][1:]}, output_final_state=True)
    assert torch.equal(c["o"], a["o"][:, s]) and torch.equal(c["ht"], a["ht"][1:])
    for n in ("q", "k", "v", "g", "beta"):
        assert torch.equal(dc[n], da[n][:, s]), "d" + n
    assert torch.equal(dc["h0"], da["h0"][1:])


def test_packed_plan_shared_by_equal_batches():
    """Every KDA layer of a step packs the same batch: equal cu_seqlens (new tuples) get the one cached plan, another
    batch its own, with the right chunk -> (sequence, chunk) map, each sequence's first chunk, and chunks numbered
    class by class (`_state_classes`: the long sequences first), each class one range."""
    from k3_kernels.kda.chunk import _chunk_plan
    dev = torch.device(DEV)
    a, b = _chunk_plan((0, 70, 150), 1, 150, dev), _chunk_plan(tuple([0, 70, 150]), 1, 150, dev)
    c = _chunk_plan((0, 10, 150), 1, 150, dev)
    assert a is b and c is not a
    assert a[1].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]] and a[2].tolist() == [0, 2]
    assert [(s.tolist(), n, first, chunks) for s, n, first, chunks in a[3]] == [([0, 1], 2, 0, 4)]
    assert c[1].tolist() == [[1, 0], [1, 1], [1, 2], [0, 0]] and c[2].tolist() == [3, 0]
    assert [(s.tolist(), n, first, chunks) for s, n, first, chunks in c[3]] == [([1], 1, 0, 3), ([0], 1, 3, 1)]


def _case_with_states(B: int, T: int, N: int, K: int, V: int) -> tuple[dict, dict]:
    """One-head inputs with initial states for N sequences, and upstream gradients for o and the final states."""
    inp = make_inputs(B, T, 1, 1, K, V)
    inp["h0"] = torch.randn(N, 1, K, V, device=DEV)
    return inp, {"o": torch.randn(B, T, 1, V, device=DEV), "ht": torch.randn(N, 1, K, V, device=DEV)}


def _assert_same_bits(runs: list) -> None:
    """Every (outputs, gradients) pair of `_run` results is bitwise equal to the first."""
    (a, da), rest = runs[0], runs[1:]
    for b, db in rest:
        for n in a:
            assert torch.equal(a[n], b[n]), n
        for n in da:
            assert torch.equal(da[n], db[n]), "d" + n


def test_chunk_state_split_keeps_bits(monkeypatch):
    """The state passes' V block is chosen from the batch's parallelism (`_state_split`), so it must not change a
    single bit: every V block gives the same outputs and gradients (batch invariance rests on it)."""
    from k3_kernels.kda import chunk as chunk_mod
    cu = [0, 70, 150]
    inp, grads = _case_with_states(1, cu[-1], 2, 32, 64)
    runs = []
    for bv in (16, 32, 64):
        monkeypatch.setitem(chunk_mod.CONFIG, "fwd_state_bv", bv)
        monkeypatch.setitem(chunk_mod.CONFIG, "bwd_state_bv", bv)
        runs.append(_run(chunk_kda, inp, grads, output_final_state=True, cu_seqlens=torch.tensor(cu, device=DEV)))
    _assert_same_bits(runs)


def test_state_classes_group_sequences_by_halving_length():
    from k3_kernels.kda.chunk import _state_classes
    bench = [9, 34, 254, 15, 102, 95, 5, 3]  # benchmarks/kda.py's packed batch, in chunks
    assert _state_classes(bench, 3) == [[2], [4, 5], [0, 1, 3, 6, 7]]
    assert _state_classes(bench, 2) == [[2], [0, 1, 3, 4, 5, 6, 7]]
    assert _state_classes(bench, 1) == [list(range(8))]
    assert _state_classes(bench, 9) == [[2], [4, 5], [1], [0, 3], [6, 7]]
    assert _state_classes([4, 4, 3], 3) == [[0, 1, 2]]
    assert _state_classes([0, 6, 2], 3) == [[1], [0, 2]]  # an empty sequence still gets its state (h0 -> ht)
    assert _state_classes([0, 0], 3) == [[0, 1]]


def test_chunk_state_classes_keep_bits(monkeypatch):
    """How many classes a packed batch is split into changes only the order of launches: outputs, final states and
    gradients are bitwise the same with 1, 2 or 3 classes (lengths 500 / 180 / 40 / 20 tokens: classes {0}, {1} and
    {2, 3} at most 3)."""
    from k3_kernels.kda import chunk as chunk_mod
    cu = [0, 500, 680, 720, 740]
    inp, grads = _case_with_states(1, cu[-1], 4, 32, 32)
    runs = []
    for most in (1, 2, 3):
        monkeypatch.setitem(chunk_mod.CONFIG, "state_classes", most)
        chunk_mod._chunk_plan.cache_clear()  # the plan holds the classes
        plan = chunk_mod._chunk_plan(tuple(cu), 1, cu[-1], torch.device(DEV))
        assert len(plan[3]) == most
        runs.append(_run(chunk_kda, inp, grads, output_final_state=True, cu_seqlens=torch.tensor(cu, device=DEV)))
    chunk_mod._chunk_plan.cache_clear()
    _assert_same_bits(runs)


def test_chunk_time_segments_keep_bits(monkeypatch):
    """A one-sequence class may be cut into time segments: in the forward (`CONFIG["fwd_segments"]`) each segment's
    state pass runs beside the next one's intra work, in the backward (`bwd_segments`, a batch of one sequence)
    each segment's chunk work beside the previous one's reverse pass, the state / dS handed over in fp32. Outputs,
    final states and gradients are bitwise those of the uncut passes, for a lone sequence with an initial state
    (both directions cut) and for a packed batch whose longest sequence is a class of its own (the forward cut;
    458 tokens: 8 chunks, cut 2 / 3 / 3)."""
    from k3_kernels.kda import chunk as chunk_mod
    from k3_kernels.kda.plan import forward_segments, segment_bounds
    for key in ("fwd_segment_chunks", "bwd_segment_chunks", "fwd_segment_programs"):
        monkeypatch.setitem(chunk_mod.CONFIG, key, 2)
    for cu in ([0, 458], [0, 458, 600, 640, 650]):
        inp, grads = _case_with_states(1, cu[-1], len(cu) - 1, 32, 32)
        runs = []
        for segments in (1, 3):
            monkeypatch.setitem(chunk_mod.CONFIG, "fwd_segments", segments)
            monkeypatch.setitem(chunk_mod.CONFIG, "bwd_segments", segments)
            chunk_mod._chunk_plan.cache_clear()
            first = chunk_mod._chunk_plan(tuple(cu), 1, cu[-1], torch.device(DEV))[3][0]
            assert len(forward_segments(first, 1)) == len(segment_bounds(first, segments, 2)) == segments
            runs.append(_run(chunk_kda, inp, grads, output_final_state=True,
                             cu_seqlens=torch.tensor(cu, device=DEV)))
        _assert_same_bits(runs)
    chunk_mod._chunk_plan.cache_clear()


def test_segment_bounds_cover_the_sequence_in_near_equal_parts():
    from k3_kernels.kda.plan import SeqClass, segment_bounds
    one = SeqClass(torch.zeros(1, dtype=torch.int32), 1, 0, 256)
    assert segment_bounds(one, 4, 16) == [(0, 64), (64, 128), (128, 192), (192, 256)]
    assert segment_bounds(one, 1, 16) == [(0, 256)]
    assert segment_bounds(one._replace(chunks=40), 4, 16) == [(0, 20), (20, 40)]  # at least 16 chunks a segment
    assert segment_bounds(one._replace(chunks=10), 4, 16) == [(0, 10)]
    assert segment_bounds(one._replace(count=2), 4, 16) == [(0, 256)]  # several sequences: not cut


def test_state_stages_keep_two_for_narrow_16bit_blocks():
    """A one-stage sm_90 build of the 16-bit forward state pass with V blocks of 16 / 32 gave NaN / an illegal
    address on an H100 (session 39): such a request gets two stages; fp32 and V block 64 may still take one."""
    from k3_kernels.kda.plan import state_stages
    assert [state_stages(1, 128, bv, 2) for bv in (16, 32, 64)] == [2, 2, 1]
    assert state_stages(3, 128, 16, 4) == 1  # fp32 at K = 128: one stage is all that fits (and was right)


def test_forward_segments_only_where_each_intra_launch_stays_full():
    """The default cut (measured on an H100, kernels/kda/NOTES.md session 39): 16K tokens at K3's 96 heads in 4
    segments (6144 intra programs each: forward 3.8% faster), at 16 heads not at all (1024 programs a segment left
    the launches part-filled), longer sequences at 16 heads in as many as keep 6144 programs."""
    from k3_kernels.kda.plan import CONFIG, SeqClass, forward_segments
    assert (CONFIG["fwd_segments"], CONFIG["fwd_segment_programs"], CONFIG["bwd_segments"]) == (4, 6144, 1)
    chunks = {"16K": 256, "64K": 1024, "128K": 2048}
    one = SeqClass(torch.zeros(1, dtype=torch.int32), 1, 0, 0)
    assert [len(forward_segments(one._replace(chunks=chunks[t]), 96)) for t in chunks] == [4, 4, 4]
    assert [len(forward_segments(one._replace(chunks=chunks[t]), 16)) for t in chunks] == [1, 2, 4]


def test_chunk_bad_input_names_the_tensor():
    inp = make_inputs(1, 16, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="beta"):
        chunk_kda(**dict(inp, beta=inp["beta"][..., :1]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda(**inp, initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_kda(**inp, cu_seqlens=torch.tensor([0, 20], device=DEV))
    with pytest.raises(ValueError, match="A_log"):
        chunk_kda(**inp, use_gate_in_kernel=True)


# ---------------------------------------------------------------------------------------------- fused_recurrent_kda

def test_recurrent_matches_reference_with_gate_and_varlen():
    cu = [0, 1, 4, 6]
    HV, K, V = 4, 16, 24
    inp = make_inputs(1, cu[-1], 2, HV, K, V, gate_raw=True)
    A_log, dt_bias = torch.rand(HV, device=DEV), torch.randn(HV * K, device=DEV)
    h0 = torch.randn(len(cu) - 1, HV, K, V, device=DEV)
    for gate, lb in (("default", None), ("safe", -5.0)):
        o, ht = fused_recurrent_kda(**inp, A_log=A_log, dt_bias=dt_bias, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=lb,
                                    cu_seqlens=torch.tensor(cu, device=DEV))
        ref, _ = _run(_reference(inp, gate, lb, True, cu), {**inp, "h0": h0, "A_log": A_log, "dt_bias": dt_bias},
                      None, output_final_state=True)
        assert_close("o", ref["o"], o, 1e-4)
        assert_close("ht", ref["ht"], ht, 1e-4)


def test_recurrent_state_pool_in_place():
    """Sequences read and write their pool slots in place; other slots and padding rows (-1) are untouched."""
    N, HV, K, V, P = 3, 2, 16, 16, 6
    pool = torch.randn(P, HV, K, V, device=DEV)
    before = pool.clone()
    idx = torch.tensor([4, -1, 1], device=DEV)
    inp = make_inputs(N, 2, 2, HV, K, V)
    o, ht = fused_recurrent_kda(**inp, initial_state=pool, ssm_state_indices=idx)
    assert ht is pool
    h0 = torch.stack([before[4], torch.zeros_like(before[0]), before[1]])
    ref_o, ref_h = naive_recurrent_kda(**inp, initial_state=h0, output_final_state=True)
    assert_close("o", ref_o, o, 1e-4)
    assert_close("slot4", ref_h[0], pool[4], 1e-4)
    assert_close("slot1", ref_h[2], pool[1], 1e-4)
    for s in (0, 2, 3, 5):
        assert torch.equal(pool[s], before[s]), s
    # not in place: the pool stays, the final states come back per sequence
    pool2 = before.clone()
    o2, ht2 = fused_recurrent_kda(**inp, initial_state=pool2, ssm_state_indices=idx, inplace_final_state=False,
                                  output_final_state=True)
    assert torch.equal(pool2, before) and torch.equal(o2, o)
    assert_close("ht", ref_h, ht2, 1e-4)


def test_decode_continues_chunk_prefill():
    """Prefill with chunk_kda, then decode token by token from the state: same as one pass over everything."""
    B, T, H, HV, K, V = 1, 70, 2, 2, 16, 16
    inp = make_inputs(B, T + 3, H, HV, K, V)
    with torch.no_grad():
        full, _ = naive_recurrent_kda(**inp)
        o, state = chunk_kda(**{n: x[:, :T] for n, x in inp.items()}, output_final_state=True)
        outs = [o]
        for t in range(T, T + 3):
            step, state = fused_recurrent_kda(**{n: x[:, t:t + 1] for n, x in inp.items()}, initial_state=state,
                                              output_final_state=True)
            outs.append(step)
    assert_close("o", full, torch.cat(outs, 1), 5e-3)


def test_recurrent_bad_input():
    inp = make_inputs(2, 1, 2, 2, 16, 16)
    with pytest.raises(ValueError, match="ssm_state_indices"):
        fused_recurrent_kda(**inp, initial_state=torch.zeros(4, 2, 16, 16, device=DEV),
                            ssm_state_indices=torch.tensor([0], device=DEV))
    with pytest.raises(ValueError, match="initial_state"):
        fused_recurrent_kda(**inp, ssm_state_indices=torch.tensor([0, 1], device=DEV))


# ---------------------------------------------------------------------------------------------- GPU: vs fla-core

def _bf16_case(safe: bool, B: int, T: int, K: int, V: int) -> tuple[dict, dict, dict]:
    """bf16 inputs for 2 heads with an initial state, upstream gradients for o and the final state, and chunk_kda's
    gate keywords: plain log-decay, or K3's safe gate in the kernel."""
    inp = make_inputs(B, T, 2, 2, K, V, dtype=torch.bfloat16, gate_raw=safe)
    inp["h0"] = torch.randn(B, 2, K, V, device=DEV)
    kw = {}
    if safe:
        inp["A_log"] = torch.zeros(2, device=DEV)
        inp["dt_bias"] = torch.randn(2 * K, device=DEV) * 0.1
        kw = dict(use_gate_in_kernel=True, lower_bound=-5.0)
    grads = {"o": torch.randn(B, T, 2, V, device=DEV, dtype=torch.bfloat16), "ht": torch.randn_like(inp["h0"])}
    return inp, grads, kw


def _bf16_against_reference(safe: bool, B: int, T: int, K: int, V: int) -> None:
    """bf16 chunk_kda against the fp64 reference with FLA's tolerances (`_bf16_case`); bitwise reruns."""
    inp, grads, kw = _bf16_case(safe, B, T, K, V)
    ours, dours = _run(chunk_kda, inp, grads, output_final_state=True, **kw)
    ref, dref = _run(_reference(inp, "safe" if safe else None, kw.get("lower_bound")),
                     {n: x.double() for n, x in inp.items()}, {n: x.double() for n, x in grads.items()},
                     output_final_state=True)
    for n in ("o", "ht"):
        assert_close(n, ref[n], ours[n], TOL[n])
    for n in inp:
        assert_close("d" + n, dref[n], dours[n], TOL[n])
    again, dagain = _run(chunk_kda, inp, grads, output_final_state=True, **kw)
    assert all(torch.equal(ours[n], again[n]) for n in ours)
    assert all(torch.equal(dours[n], dagain[n]) for n in dours)


@pytest.mark.skipif(CUDA, reason="interpreter run at small shapes; on the GPU, test_gpu_bf16_against_reference")
@pytest.mark.parametrize("safe", [False, True])
def test_chunk_bf16_interpreter(safe):
    """The bf16 path (bf16 intermediates and state-pass dots) on CPU, with tests/kernels/conftest.py's bf16 fixes
    to Triton's interpreter (without them o is off by ~1e11: the interpreter multiplies bf16 bit patterns)."""
    _bf16_against_reference(safe, B=2, T=100, K=32, V=32)


@pytest.mark.gpu
@pytest.mark.parametrize("safe", [False, True])
def test_gpu_bf16_against_reference(safe):
    """bf16 at K = V = 128 against the fp64 reference. (Apart from the fla-core comparison, whose cold autotuning
    takes minutes on a fresh machine: `-k "gpu and not fla"` runs the rest quickly.)"""
    _bf16_against_reference(safe, B=2, T=300, K=128, V=128)


@pytest.mark.gpu
def test_gpu_bf16_against_fla():
    """bf16 at K = V = 128 against fla-core's chunk_kda (plain log-decay: its safe-gate path takes its own flags)."""
    fla = pytest.importorskip("fla.ops.kda")
    inp, grads, _ = _bf16_case(False, B=2, T=300, K=128, V=128)
    ours, dours = _run(chunk_kda, inp, grads, output_final_state=True)
    theirs, dtheirs = _run(fla.chunk_kda, inp, grads, output_final_state=True)
    for n in ("o", "ht"):
        assert_close(n + " vs fla", theirs[n].float(), ours[n].float(), TOL[n])
    for n in inp:
        assert_close("d" + n + " vs fla", dtheirs[n].float(), dours[n].float(), TOL[n])


@pytest.mark.gpu
def test_gpu_time_segments_keep_bits(monkeypatch):
    """On the GPU the segments' state passes run on a side stream beside the chunk work (CPU counterpart:
    `test_chunk_time_segments_keep_bits`, one stream): bf16 at K = V = 128, 4K tokens in 4 / 8 segments, outputs,
    final state and gradients bitwise the uncut passes'."""
    from k3_kernels.kda import chunk as chunk_mod
    inp, grads, _ = _bf16_case(False, B=1, T=4096, K=128, V=128)
    runs = []
    for segments in (1, 4, 8):
        monkeypatch.setitem(chunk_mod.CONFIG, "fwd_segments", segments)
        monkeypatch.setitem(chunk_mod.CONFIG, "bwd_segments", segments)
        monkeypatch.setitem(chunk_mod.CONFIG, "fwd_segment_chunks", 8)
        monkeypatch.setitem(chunk_mod.CONFIG, "fwd_segment_programs", 1)
        monkeypatch.setitem(chunk_mod.CONFIG, "bwd_segment_chunks", 8)
        runs.append(_run(chunk_kda, inp, grads, output_final_state=True))
    _assert_same_bits(runs)


@pytest.mark.gpu
@pytest.mark.parametrize("bv", [16, 32, 64])
def test_gpu_fp32_one_stage_state_passes_against_reference(monkeypatch, bv):
    """fp32 inputs at K = V = 128 leave shared memory for one state-pass stage (`plan.state_stages`): that build
    (unlike the 16-bit one at V blocks 16 / 32, which `state_stages` no longer gives one stage) must be right, forward
    and backward, against the fp64 reference (CPU counterpart: the interpreter runs every stage count alike)."""
    from k3_kernels.kda import chunk as chunk_mod
    monkeypatch.setitem(chunk_mod.CONFIG, "fwd_state_bv", bv)
    monkeypatch.setitem(chunk_mod.CONFIG, "bwd_state_bv", bv)
    inp = make_inputs(1, 1024, 2, 2, 128, 128)
    do = torch.randn(1, 1024, 2, 128, device=DEV)
    ours, dours = _run(chunk_kda, inp, {"o": do})
    ref, dref = _run(_reference(inp), {n: x.double() for n, x in inp.items()}, {"o": do.double()})
    assert_close("o", ref["o"], ours["o"], 1e-4)
    for n in ("q", "k", "v", "g", "beta"):
        assert_close("d" + n, dref[n], dours[n], 1e-3)


@pytest.mark.gpu
def test_gpu_recurrent_pool_against_reference():
    """Decode on the GPU: pool slots read and written in place, K = V = 128, bf16 inputs."""
    N, HV, K, V, P = 4, 4, 128, 128, 8
    pool = torch.randn(P, HV, K, V, device=DEV)
    before = pool.clone()
    idx = torch.tensor([5, 0, -1, 2], device=DEV)
    inp = make_inputs(N, 3, 2, HV, K, V, dtype=torch.bfloat16)
    o, _ = fused_recurrent_kda(**inp, initial_state=pool, ssm_state_indices=idx)
    h0 = torch.stack([before[5], before[0], torch.zeros_like(before[0]), before[2]])
    ref_o, ref_h = naive_recurrent_kda(**{n: x.double() for n, x in inp.items()}, initial_state=h0.double(),
                                       output_final_state=True)
    assert_close("o", ref_o, o, 5e-3)
    for n, s in ((0, 5), (1, 0), (3, 2)):
        assert_close(f"slot{s}", ref_h[n], pool[s], 5e-3)
    for s in (1, 3, 4, 6, 7):
        assert torch.equal(pool[s], before[s]), s


def _decode_runs(monkeypatch, settings: list[tuple[int, bool]], dtype=torch.bfloat16, K: int = 128):
    """Outputs and pool states of one packed decode batch (3, 0 and 4 tokens; pool slots 4, 1, 2) under each
    (`DECODE_STAGES`, `DECODE_PREFETCH_QK`) setting."""
    from k3_kernels.kda import fused_recurrent as recurrent_mod
    torch.manual_seed(7)
    HV, V, P = 4, K, 6
    pool = torch.randn(P, HV, K, V, device=DEV)
    idx = torch.tensor([4, 1, 2], device=DEV)
    inp = make_inputs(1, 7, 2, HV, K, V, dtype=dtype, gate_raw=True)
    cu = torch.tensor([0, 3, 3, 7], device=DEV)
    A_log, dt_bias = torch.rand(HV, device=DEV), torch.randn(HV * K, device=DEV) * 0.1
    runs = []
    for stages, prefetch in settings:
        monkeypatch.setattr(recurrent_mod, "DECODE_STAGES", stages)
        monkeypatch.setattr(recurrent_mod, "DECODE_PREFETCH_QK", prefetch)
        states = pool.clone()
        o, _ = fused_recurrent_kda(**inp, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=-5.,
                                   initial_state=states, ssm_state_indices=idx, cu_seqlens=cu)
        runs.append((o, states))
    return runs


def test_decode_with_prefetched_q_k_gives_the_same_bits(monkeypatch):
    """`DECODE_PREFETCH_QK` (token t + 1's q, k and beta loaded during token t, masked past the sequence's end)
    gives the plain loop's bits on a packed batch with an empty sequence and a head dim that is not a power of two
    (interpreter on CPU, the kernel on the GPU)."""
    for K in (128, 60):
        plain, prefetched = _decode_runs(monkeypatch, [(1, False), (1, True)], K=K)
        assert torch.equal(plain[0], prefetched[0]) and torch.equal(plain[1], prefetched[1]), K


@pytest.mark.gpu
@pytest.mark.parametrize("stages,prefetch", [(2, False), (3, False), (2, True)])
def test_gpu_pipelined_decode_loop_gives_the_same_bits(monkeypatch, stages, prefetch):
    """The decode kernel's token loop software-pipelined (`DECODE_STAGES`, the loads of token t + 1 issued during
    token t's update), with or without q / k prefetched by hand, gives the plain loop's bits: outputs and the
    pool's states (CPU counterpart: the interpreter ignores the pipelining; the prefetch test above)."""
    plain, other = _decode_runs(monkeypatch, [(1, False), (stages, prefetch)])
    assert torch.equal(plain[0], other[0]) and torch.equal(plain[1], other[1])
