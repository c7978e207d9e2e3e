"""fla-core 0.6.0's full `chunk_kda` / `fused_recurrent_kda` interface on our kernels: state_v_first, per-chunk
intermediate states (chunk_size 64 / 32), beta logits (use_beta_sigmoid_in_kernel, allow_neg_eigval), head dims that
are not powers of two and up to 256, T not a multiple of 64 and empty sequences in packed batches, each checked
against the fp64 references (ours, and fla-core's naive recurrence) and, on CPU, under `bounds_guard` (no kernel
touches memory outside its tensors); clear ValueErrors before any launch; bitwise determinism and batch invariance
on the new paths."""
from __future__ import annotations

import pytest
import torch

from k3_kernels.kda import chunk_kda, fused_recurrent_kda, naive_recurrent_kda
from test_kda import DEV, TOL, _check_against_reference, _reference, _run, assert_close, make_inputs

CUDA = DEV == "cuda"


def _checked(guard) -> int:
    return guard.checked if guard is not None else -1


@pytest.mark.parametrize("B,T,H,HV,K,V,cu", [
    (2, 100, 1, 1, 60, 100, None),                  # non-powers of two, T not a chunk multiple
    (1, 170, 1, 2, 100, 60, [0, 0, 40, 40, 170]),   # packed, empty sequences first and between
])
def test_chunk_odd_dims_in_bounds(bounds_guard, B, T, H, HV, K, V, cu):
    """fwd + bwd with the safe gate in the kernel against the fp64 reference; on CPU every load and store of every
    kernel inside the launch's tensors."""
    inp = make_inputs(B, T, H, HV, K, V, gate_raw=True)
    N = B if cu is None else len(cu) - 1
    inp["h0"] = torch.randn(N, HV, K, V, device=DEV)
    inp["A_log"] = torch.rand(HV, device=DEV) * 0.5
    inp["dt_bias"] = torch.randn(HV * K, device=DEV) * 0.5
    _check_against_reference(inp, cu=cu, gate="safe", lower_bound=-5.0)
    assert _checked(bounds_guard) != 0


def test_chunk_head_dim_256_in_bounds(bounds_guard):
    """K = V = 256 (fla-core's limit): the state passes take one pipeline stage there (plan.state_stages: the GPU's
    shared memory), the result is the reference's."""
    inp = make_inputs(1, 40, 1, 1, 256, 256)
    inp["h0"] = torch.randn(1, 1, 256, 256, device=DEV)
    _check_against_reference(inp)
    assert _checked(bounds_guard) != 0


def _beta_reference(inp: dict, neg: bool):
    """The fp64 reference with beta = sigmoid(logits) (2 sigmoid with allow_neg_eigval) in torch."""
    ref = _reference(inp)

    def fn(beta, **kw):
        return ref(beta=torch.sigmoid(beta) * (2. if neg else 1.), **kw)
    return fn


@pytest.mark.parametrize("neg", [False, True], ids=["sigmoid", "neg_eigval"])
def test_chunk_beta_logits_and_state_v_first(neg):
    """use_beta_sigmoid_in_kernel / allow_neg_eigval against the reference (dbeta through the sigmoid), with the
    state in [N, HV, V, K] layout: initial state, final state and their gradients transposed, nothing else changed."""
    B, T, HV, K, V = 2, 70, 2, 16, 32
    inp = make_inputs(B, T, 1, HV, K, V)
    inp["beta"] = torch.randn(B, T, HV, device=DEV) * 2
    inp["h0"] = torch.randn(B, HV, K, V, device=DEV)
    grads = {"o": torch.randn(B, T, HV, V, device=DEV), "ht": torch.randn(B, HV, K, V, device=DEV)}
    kw = dict(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg, output_final_state=True)
    ours, dours = _run(chunk_kda, inp, grads, **kw)
    ref, dref = _run(_beta_reference(inp, neg), {n: x.double() for n, x in inp.items()},
                     {n: x.double() for n, x in grads.items()}, output_final_state=True)
    for n in ("o", "ht"):
        assert_close(n, ref[n], ours[n], TOL[n])
    for n in inp:
        assert_close("d" + n, dref[n], dours[n], TOL[n])
    vf = dict(inp, h0=inp["h0"].transpose(-1, -2).contiguous())
    t, dt = _run(chunk_kda, vf, dict(grads, ht=grads["ht"].transpose(-1, -2)), state_v_first=True, **kw)
    assert torch.equal(t["o"], ours["o"]) and torch.equal(t["ht"], ours["ht"].transpose(-1, -2))
    assert torch.equal(dt["h0"], dours["h0"].transpose(-1, -2))
    for n in ("q", "k", "v", "g", "beta"):
        assert torch.equal(dt[n], dours[n]), "d" + n


def _states_at(inp: dict, cu: list[int], every: int, h0: torch.Tensor) -> torch.Tensor:
    """fp64 reference states before each `every`-token chunk of each sequence, in sequence order [NT, HV, K, V]."""
    out = []
    for n in range(len(cu) - 1):
        for s in range(cu[n], cu[n + 1], every):
            x = {name: t[:, cu[n]:s].double() for name, t in inp.items()}
            _, h = naive_recurrent_kda(**x, initial_state=h0[n:n + 1].double(), output_final_state=True)
            out.append(h[0])
    return torch.stack(out) if out else h0.new_zeros(0, *h0.shape[1:]).double()


@pytest.mark.parametrize("chunk_size", [64, 32])
def test_chunk_intermediate_states(bounds_guard, chunk_size):
    """return_intermediate_states: the state before every chunk of chunk_size tokens of every sequence (packed, with
    an empty sequence and lengths that are no chunk multiple), in sequence order, fp32 inputs so the saved states
    are fp32; [V, K] with state_v_first; the same slice for a sequence run alone (batch invariant)."""
    cu = [0, 150, 150, 190]
    HV, K, V = 2, 16, 32
    inp = make_inputs(1, cu[-1], 1, HV, K, V)
    h0 = torch.randn(len(cu) - 1, HV, K, V, device=DEV)
    kw = dict(initial_state=h0, cu_seqlens=torch.tensor(cu, device=DEV), chunk_size=chunk_size,
              return_intermediate_states=True, output_final_state=True)
    with torch.no_grad():
        o, ht, h = chunk_kda(**inp, **kw)
        o2, ht2, h_vf = chunk_kda(**inp, **dict(kw, initial_state=h0.transpose(-1, -2).contiguous()),
                                  state_v_first=True)
        _, _, alone = chunk_kda(**{n: x[:, 150:] for n, x in inp.items()}, initial_state=h0[2:],
                                return_intermediate_states=True, chunk_size=chunk_size)
    ref = _states_at(inp, cu, chunk_size, h0)
    assert h.shape == (1, ref.shape[0], HV, K, V) and h.dtype == inp["k"].dtype
    assert_close("h", ref, h[0], 1e-5)
    assert torch.equal(h_vf, h.transpose(-1, -2)) and torch.equal(o2, o) and torch.equal(ht2, ht.transpose(-1, -2))
    n_first = -(-150 // chunk_size)
    assert torch.equal(alone[0], h[0, n_first:])
    assert _checked(bounds_guard) != 0


def test_chunk_intermediate_states_fixed_length_bf16():
    """Fixed-length batch: h [B, NT, HV, K, V] in bf16, each sequence's states in order."""
    B, T, HV, K, V = 2, 100, 1, 16, 16
    inp = make_inputs(B, T, 1, HV, K, V, dtype=torch.bfloat16)
    h0 = torch.randn(B, HV, K, V, device=DEV)
    with torch.no_grad():
        _, _, h = chunk_kda(**inp, initial_state=h0, return_intermediate_states=True, chunk_size=32)
    assert h.shape == (B, 4, HV, K, V) and h.dtype == torch.bfloat16
    flat = {n: x.reshape(1, B * T, *x.shape[2:]) for n, x in inp.items()}
    ref = _states_at(flat, [0, T, 2 * T], 32, h0)
    assert_close("h", ref, h.reshape(-1, HV, K, V).float(), 1e-2)


def test_recurrent_options_against_fla_naive(bounds_guard):
    """fused_recurrent_kda with odd head dims, beta logits with allow_neg_eigval, the safe gate in the kernel and the
    state pool in [P, HV, V, K] layout updated in place, against fla-core's naive recurrence (gate, sigmoid and
    layout applied in torch); the other slots untouched."""
    fla_naive = pytest.importorskip("fla.ops.kda.naive")
    N, HV, K, V, P = 3, 2, 60, 100, 5
    inp = make_inputs(N, 2, 1, HV, K, V, gate_raw=True)
    A_log, dt_bias = torch.rand(HV, device=DEV), torch.randn(HV * K, device=DEV)
    pool = torch.randn(P, HV, V, K, device=DEV)
    before = pool.clone()
    idx = torch.tensor([3, -1, 0], device=DEV)
    o, ht = fused_recurrent_kda(**inp, A_log=A_log, dt_bias=dt_bias, initial_state=pool, ssm_state_indices=idx,
                                use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
                                allow_neg_eigval=True, state_v_first=True)
    assert ht is pool
    from k3_kernels.kda import naive_kda_lowerbound_gate
    h0 = torch.stack([before[3], torch.zeros_like(before[0]), before[0]]).transpose(-1, -2)
    x = {n: t.double() for n, t in inp.items()}
    x["g"] = naive_kda_lowerbound_gate(x["g"], A_log.double(), dt_bias.double(), -5.0)
    x["beta"] = 2 * torch.sigmoid(x["beta"])
    ref_o, ref_h = fla_naive.naive_recurrent_kda(**x, initial_state=h0.double(), output_final_state=True)
    assert_close("o", ref_o, o, 1e-4)
    assert_close("slot3", ref_h[0].transpose(-1, -2), pool[3], 1e-4)
    assert_close("slot0", ref_h[2].transpose(-1, -2), pool[0], 1e-4)
    for s in (1, 2, 4):
        assert torch.equal(pool[s], before[s]), s
    assert _checked(bounds_guard) != 0


def test_new_paths_deterministic_and_batch_invariant():
    """Beta logits + state_v_first + the safe gate, packed: bitwise reruns, and the second sequence alone gives the
    same bits for its outputs, final state and every gradient."""
    cu = [0, 30, 110]
    inp = make_inputs(1, cu[-1], 1, 1, 16, 16, gate_raw=True)
    inp["beta"] = torch.randn(1, cu[-1], 1, device=DEV)
    inp["h0"] = torch.randn(2, 1, 16, 16, device=DEV)
    inp["dt_bias"] = torch.randn(16, device=DEV)
    grads = {"o": torch.randn(1, cu[-1], 1, 16, device=DEV), "ht": torch.randn(2, 1, 16, 16, device=DEV)}
    kw = dict(output_final_state=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, use_gate_in_kernel=True,
              lower_bound=-5.0)
    a, da = _run(chunk_kda, inp, grads, cu_seqlens=torch.tensor(cu, device=DEV), **kw)
    b, db = _run(chunk_kda, inp, grads, cu_seqlens=torch.tensor(cu, device=DEV), **kw)
    assert all(torch.equal(a[n], b[n]) for n in a) and all(torch.equal(da[n], db[n]) for n in da)
    s = slice(cu[1], cu[2])
    alone = {n: (x[:, s] if n not in ("h0", "dt_bias") else (x[1:] if n == "h0" else x)) for n, x in inp.items()}
    c, dc = _run(chunk_kda, alone, {"o": grads["o"][:, s], "ht": grads["ht"][1:]}, **kw)
    assert torch.equal(c["o"], a["o"][:, s]) and torch.equal(c["ht"], a["ht"][1:])
    for n in ("q", "k", "v", "g", "beta"):
        assert torch.equal(dc[n], da[n][:, s]), "d" + n
    assert torch.equal(dc["h0"], da["h0"][1:])


def test_bad_options_raise_before_any_launch(bounds_guard):
    """Each unsupported or inconsistent argument is a ValueError naming it, raised before any kernel runs."""
    inp = make_inputs(1, 20, 1, 1, 16, 16)
    cases = [
        (dict(chunk_size=48), "chunk_size"),
        (dict(allow_neg_eigval=True), "allow_neg_eigval"),
        (dict(use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0, A_log=torch.zeros(1, device=DEV)),
         "lower_bound"),
        (dict(use_gate_in_kernel=True, safe_gate=True, A_log=torch.zeros(1, device=DEV)), "lower_bound"),
        (dict(cp_context=object()), "cp_context"),
        (dict(use_graph=True), "use_graph"),
        (dict(initial_state=torch.zeros(1, 1, 16, 16, device=DEV)[..., :8]), "initial_state"),
        (dict(state_v_first=True, initial_state=torch.zeros(1, 1, 16, 8, device=DEV)), r"\[N, HV, V, K\]"),
        (dict(state_v_first=True, transpose_state_layout=True), "transpose_state_layout"),
        (dict(cu_seqlens=torch.tensor([0, 5, 3, 20], device=DEV)), "cu_seqlens"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            chunk_kda(**inp, **kw)
    with pytest.raises(ValueError, match="return_intermediate_states"):
        chunk_kda(**{n: x.requires_grad_(True) if n == "v" else x for n, x in inp.items()},
                  return_intermediate_states=True)
    big = make_inputs(1, 4, 1, 1, 300, 16)
    with pytest.raises(ValueError, match="K"):
        chunk_kda(**big)
    with pytest.raises(ValueError, match="K"):
        fused_recurrent_kda(**big)
    wide = make_inputs(1, 4, 1, 1, 16, 257)
    with pytest.raises(ValueError, match="V"):
        chunk_kda(**wide)
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        fused_recurrent_kda(**inp, allow_neg_eigval=True)
    pool = torch.zeros(2, 1, 16, 16, device=DEV)
    with pytest.raises(ValueError, match="ssm_state_indices"):
        fused_recurrent_kda(**inp, initial_state=pool, ssm_state_indices=torch.tensor([2], device=DEV))
    with pytest.raises(TypeError, match="no_such_option"):
        chunk_kda(**inp, no_such_option=1)
    assert _checked(bounds_guard) in (0, -1)
    with pytest.warns(DeprecationWarning, match="state_v_first"):
        o, _ = chunk_kda(**inp, transpose_state_layout=True)
    assert torch.equal(o, chunk_kda(**inp)[0])


@pytest.mark.gpu
def test_gpu_head_dim_256_refused_before_launch():
    """On CUDA, head dims above 128 are refused with a ValueError naming the dim (256 faulted in the chunk backward
    on the H200); the interpreter path (test_chunk_head_dim_256_in_bounds) still takes 256."""
    inp = make_inputs(1, 64, 1, 1, 256, 64, dtype=torch.bfloat16)
    for fn in (chunk_kda, fused_recurrent_kda):
        with pytest.raises(ValueError, match="K \\(q/k head dim\\) = 256 is not supported on CUDA"):
            fn(**{n: x for n, x in inp.items() if n in ("q", "k", "v", "g", "beta")})


@pytest.mark.gpu
@pytest.mark.parametrize("D", [60, 100, 128])
def test_gpu_head_dims_against_reference(D):
    """On the GPU: bf16, head dims 60 / 100 (fla-core's shapes that faulted before chunk_kda zero-padded them to the
    tiles) and 128, safe gate in the kernel, packed with an empty sequence, fwd + bwd against the fp64 reference."""
    cu = [0, 300, 300, 1000]
    inp = make_inputs(1, cu[-1], 2, 2, D, D, dtype=torch.bfloat16, gate_raw=True)
    inp["h0"] = torch.randn(3, 2, D, D, device=DEV)
    inp["A_log"] = torch.zeros(2, device=DEV)
    inp["dt_bias"] = torch.randn(2 * D, device=DEV) * 0.1
    _check_against_reference(inp, cu=cu, gate="safe", lower_bound=-5.0)
    o, _ = fused_recurrent_kda(**{n: x[:, :3] for n, x in inp.items() if n in ("q", "k", "v", "g", "beta")})
    assert torch.isfinite(o).all()


def test_state_stages_fit_shared_memory_and_tiles_pad_on_cuda():
    """The state passes' stages always fit the H200's shared memory by plan.state_stages' count (the figures in its
    docstring: bf16 K = 256 one stage, K3's bf16 K = 128 V block 64 keeps its 2, fp32 K = 128 drops to 1), and
    16-bit inputs on CUDA get tiles of at least 128 (tile_dims), the interpreter plain powers of two."""
    from k3_kernels.kda.plan import SHARED_LIMIT, state_stages, tile_dims
    assert state_stages(3, 256, 32, 2) == 1 and state_stages(2, 128, 64, 2) == 2 and state_stages(3, 128, 16, 2) == 3
    assert state_stages(2, 128, 64, 4) == 1
    for BK in (16, 32, 64, 128, 256):
        for BV in (16, 32, 64):
            for elsize in (2, 4):
                s = state_stages(3, BK, BV, elsize)
                assert 1 <= s <= 3 and s * ((3 * 64 * BK + 64 * 64 + 64 * BV) * elsize + 4 * BK) < SHARED_LIMIT
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert tile_dims(60, 16, torch.bfloat16, cuda) == (128, 128)
    assert tile_dims(256, 100, torch.bfloat16, cuda) == (256, 128)
    assert tile_dims(60, 16, torch.float32, cuda) == (64, 16) and tile_dims(60, 16, torch.bfloat16, cpu) == (64, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", [64, 32])
def test_gpu_interface_against_fla(chunk_size):
    """The new options against fla-core's chunk_kda itself (bf16, packed with an empty sequence, inference): state in
    [N, HV, V, K], beta logits with allow_neg_eigval, K3's safe gate in the kernel, and the per-chunk states h
    (layout, order, dtype) that SGLang's prefix caching reads."""
    fla = pytest.importorskip("fla.ops.kda")
    cu = [0, 200, 200, 330]
    HV, K, V = 2, 128, 128
    inp = make_inputs(1, cu[-1], 2, HV, K, V, dtype=torch.bfloat16, gate_raw=True)
    inp["beta"] = torch.randn(1, cu[-1], HV, device=DEV).to(torch.bfloat16)
    h0 = torch.randn(3, HV, V, K, device=DEV)
    kw = dict(initial_state=h0, output_final_state=True, state_v_first=True, use_beta_sigmoid_in_kernel=True,
              allow_neg_eigval=True, use_gate_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              A_log=torch.zeros(HV, device=DEV), dt_bias=torch.randn(HV * K, device=DEV) * 0.1,
              cu_seqlens=torch.tensor(cu, device=DEV), return_intermediate_states=True, chunk_size=chunk_size)
    with torch.inference_mode():
        o, ht, h = chunk_kda(**inp, **kw)
        fo, fht, fh = fla.chunk_kda(**inp, **kw)
    assert h.shape == fh.shape and h.dtype == fh.dtype and ht.shape == fht.shape
    assert_close("o vs fla", fo.float(), o.float(), TOL["o"])
    assert_close("ht vs fla", fht.float(), ht.float(), TOL["ht"])
    assert_close("h vs fla", fh.float(), h.float(), TOL["ht"])


@pytest.mark.parametrize("case", ["v100_bv16", "packed_gated"])
def test_chunk_reads_no_unwritten_memory(monkeypatch, case):
    """Every intermediate a kernel reads was written first, and every output element is written: with torch.empty
    poisoned to NaN (floats), (a) V = 100 in tiles of 128 with state-pass V blocks of 16 (7 blocks cover 112
    columns; the backward prep reads all 128: these columns were left unwritten before), (b) a packed batch with
    empty sequences, K = 60, grouped value heads and the safe gate in the kernel; fwd + bwd against the reference,
    and the per-chunk states at chunk_size 32."""
    from k3_kernels.kda import chunk as chunk_mod
    empty = torch.empty

    def poisoned(*args, **kwargs):
        x = empty(*args, **kwargs)
        return x.fill_(float("nan")) if x.is_floating_point() else x
    monkeypatch.setitem(chunk_mod.CONFIG, "fwd_state_bv", 16)
    monkeypatch.setitem(chunk_mod.CONFIG, "bwd_state_bv", 16)
    if case == "v100_bv16":
        cu, inp = None, make_inputs(1, 80, 1, 1, 32, 100)
        inp["h0"] = torch.randn(1, 1, 32, 100, device=DEV)
        kw = {}
    else:
        cu, inp = [0, 0, 90, 90, 130], make_inputs(1, 130, 1, 2, 60, 24, gate_raw=True)
        inp["h0"] = torch.randn(4, 2, 60, 24, device=DEV)
        inp["dt_bias"] = torch.randn(2 * 60, device=DEV)
        kw = dict(gate="safe", lower_bound=-5.0)
    monkeypatch.setattr(torch, "empty", poisoned)
    _check_against_reference(inp, cu=cu, **kw)
    with torch.no_grad():
        o, _, h = chunk_kda(**{n: inp[n] for n in ("q", "k", "v", "g", "beta")}, initial_state=inp["h0"],
                            cu_seqlens=torch.tensor(cu, device=DEV) if cu else None, return_intermediate_states=True,
                            chunk_size=32, use_gate_in_kernel=case != "v100_bv16", lower_bound=kw.get("lower_bound"),
                            dt_bias=inp.get("dt_bias"))
    assert torch.isfinite(o).all() and torch.isfinite(h).all()


@pytest.mark.gpu
def test_gpu_recurrent_device_indices_bounded_in_kernel():
    """Decode never syncs: device-side ssm_state_indices past the pool and cu_seqlens past the tokens are bounded in
    the kernel (a padding row: zero start, nothing written; boundaries clamped), so nothing outside the pool or the
    inputs is touched."""
    HV, K, V, P = 2, 128, 128, 3
    pool = torch.randn(P, HV, K, V, device=DEV)
    before = pool.clone()
    inp = make_inputs(2, 1, 1, HV, K, V, dtype=torch.bfloat16)
    o, _ = fused_recurrent_kda(**inp, initial_state=pool, ssm_state_indices=torch.tensor([7, 1], device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[2], before[2]) and not torch.equal(pool[1], before[1])
    ref, _ = naive_recurrent_kda(**{n: x[:1].double() for n, x in inp.items()})
    assert_close("padding row", ref, o[:1], 5e-3)
    flat = {n: x.reshape(1, 2, *x.shape[2:]) for n, x in inp.items()}
    o2, _ = fused_recurrent_kda(**flat, cu_seqlens=torch.tensor([0, 1, 9], device=DEV))
    torch.cuda.synchronize()
    assert torch.isfinite(o2).all()
