"""Latent-MoE kernels (k3_kernels.moe) against the plain-torch spec (naive.py): router (ids, weights, replay,
ties, gradients), permutation and combine, the grouped-GEMM experts forward and backward (fp32 tight, bf16
loose), FP8 (bitwise against the spec's dequantised math under the interpreter; its error against bf16 reported),
MXFP4 dequantisation, determinism and batch-composition invariance, and bad input. Triton's interpreter on CPU at
tiny shapes; the `gpu` tests run K3 shapes."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _moe_interp import experts_case as _experts, random_ids as _ids, rel_rms  # noqa: E402  (+ the FP8 fix)
from k3_kernels.moe import naive  # noqa: E402
from k3_kernels.moe.layer import Precision, moe_experts  # noqa: E402
from k3_kernels.moe.permute import combine, permute_rows, plan_routing  # noqa: E402
from k3_kernels.moe.quant import dequantize_mxfp4, quantize_weight_fp8  # noqa: E402
from k3_kernels.moe.router import fused_router  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------------ router
@pytest.fixture(scope="module")
def router_case():
    g = torch.Generator().manual_seed(1)
    N, D, E, k = 21, 40, 24, 4
    x = torch.randn(N, D, generator=g).to(DEV)
    W = torch.randn(E, D, generator=g).to(DEV)
    b = (torch.randn(E, generator=g) * 0.1).to(DEV)
    return x, W, b, k


def test_router_matches_spec(router_case):
    x, W, b, k = router_case
    x, W = x.clone().requires_grad_(), W.clone().requires_grad_()
    ids, w = fused_router(x, W, b, k)
    ids_r, w_r = naive.naive_router(x, W, b, k)
    assert ids.dtype == torch.int64 and torch.equal(ids, ids_r)
    torch.testing.assert_close(w, w_r, atol=1e-6, rtol=1e-6)
    dw = torch.randn_like(w)
    for a, r in zip(torch.autograd.grad(w, [x, W], dw), torch.autograd.grad(w_r, [x, W], dw)):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)


def test_router_replay(router_case):
    """Router Replay: forced ids are used as given and the weights recomputed; rows of -1 route freely."""
    x, W, b, k = router_case
    g = torch.Generator().manual_seed(2)
    forced = _ids(x.shape[0], W.shape[0], k, g)
    forced[1] = -1
    ids, w = fused_router(x, W, b, k, forced=forced)
    ids_r, w_r = naive.naive_router(x, W, b, k, forced=forced)
    assert torch.equal(ids, ids_r) and torch.equal(ids[0], forced[0])
    assert torch.equal(ids[1], fused_router(x, W, b, k)[0][1])
    torch.testing.assert_close(w, w_r, atol=1e-6, rtol=1e-6)


def test_router_ties_lowest_id(router_case):
    """All scores equal (zero input, no bias): the lowest ids win, in ascending order."""
    x, W, _, k = router_case
    ids, w = fused_router(torch.zeros(3, x.shape[1], device=DEV), W, None, k)
    assert ids.tolist() == [list(range(k))] * 3
    torch.testing.assert_close(w, torch.full_like(w, 1 / k))


def test_router_bad_input(router_case):
    x, W, b, k = router_case
    with pytest.raises(ValueError, match="weight"):
        fused_router(x, W[:, :-1], b, k)
    with pytest.raises(ValueError, match="top_k"):
        fused_router(x, W, b, W.shape[0] + 1)
    with pytest.raises(ValueError, match="forced"):
        fused_router(x, W, b, k, forced=torch.zeros(2, k, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="bias"):
        fused_router(x, W, b[:-1], k)


# -------------------------------------------------------------------------------------------------- permutation
def test_plan_and_permute_into_buffer():
    g = torch.Generator().manual_seed(3)
    N, D, E, k = 11, 256, 6, 3
    x = torch.randn(N, D, generator=g).to(DEV)
    ids = _ids(N, E, k, g)
    plan = plan_routing(ids, E)
    order, pos, offsets = naive.naive_permutation(ids, E)
    assert torch.equal(plan.order, order) and torch.equal(plan.pos, pos) and torch.equal(plan.offsets, offsets)
    # rows staged into a caller's dispatch buffer at an offset, FP8 scales alongside; nothing else is touched
    buf = torch.full((N * k + 5, D), 7.0, device=DEV)
    qbuf = torch.zeros(N * k + 5, D, device=DEV, dtype=torch.float8_e4m3fn)
    sbuf = torch.full((N * k + 5, D // 128), -1.0, device=DEV)
    rows, q, s = permute_rows(x, plan, fp8=True, out=buf, out_q=qbuf, out_scale=sbuf, row_offset=2)
    assert rows.data_ptr() == buf[2].data_ptr()
    assert torch.equal(buf[2:2 + N * k], naive.naive_permute(x, order, k))
    assert (buf[:2] == 7).all() and (buf[2 + N * k:] == 7).all() and (sbuf[:2] == -1).all()
    q_r, s_r = naive.naive_quant_rows(naive.naive_permute(x, order, k))
    if DEV == "cpu":
        assert torch.equal(q.view(torch.uint8), q_r.view(torch.uint8)) and torch.equal(s, s_r)
    else:  # torch's CUDA division by a scalar multiplies by its reciprocal (1 ulp off IEEE division, ours)
        torch.testing.assert_close(s, s_r, rtol=2e-7, atol=0)
        torch.testing.assert_close(naive.naive_dequant_rows(q, s), naive.naive_dequant_rows(q_r, s_r),
                                   rtol=0.07, atol=0)
    with pytest.raises(ValueError, match="out"):
        permute_rows(x, plan, out=buf[:4])
    y = torch.randn(N * k, D, device=DEV)
    w = torch.rand(N, k, device=DEV)
    if DEV == "cpu":
        assert torch.equal(combine(y, plan, w), naive.naive_combine(y, pos, w))
    else:  # the GPU contracts w * y + acc into one FMA (one rounding; torch rounds twice)
        torch.testing.assert_close(combine(y, plan, w), naive.naive_combine(y, pos, w), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------ experts
@pytest.fixture(scope="module")
def fp32_case():
    """Expert 4 of 6 gets no tokens (its weight gradients must be zeros)."""
    z, ids, w, w1, w3, w2 = _experts(13, 48, 40, 6, 3, seed=4)
    used = torch.tensor([0, 1, 2, 3, 5])
    ids = used[_ids(13, 5, 3, torch.Generator().manual_seed(9), "cpu")].to(DEV)
    return z, ids, w, w1, w3, w2


def _fwd_bwd(fn, z, ids, w, w1, w3, w2, dy_seed=5, **kw):
    leaves = [t.clone().requires_grad_() for t in (z, w, w1, w3, w2)]
    zl, wl, a, b, c = leaves
    y = fn(zl, ids, wl, a, b, c, **kw)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(dy_seed)).to(y.device, y.dtype)
    return y, torch.autograd.grad(y, leaves, dy)


def test_experts_fp32_matches_spec(fp32_case, bounds_guard):
    z, ids, w, w1, w3, w2 = fp32_case
    y, grads = _fwd_bwd(moe_experts, *fp32_case)
    y_r, grads_r = _fwd_bwd(naive.naive_experts, *fp32_case)
    torch.testing.assert_close(y, y_r, atol=2e-6, rtol=2e-6)
    for name, a, r in zip(("dz", "dw", "dw1", "dw3", "dw2"), grads, grads_r):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5, msg=name)
    assert (grads[2][4] == 0).all() and (grads[4][4] == 0).all()  # the idle expert
    assert bounds_guard is None or bounds_guard.checked > 0


def test_situ_backward_fused_and_unfused_agree():
    """The SiTU backward in the down dgrad's epilogue and as its own pass give the same bits."""
    from k3_kernels.moe import grouped_gemm as gg
    z, ids, w, w1, w3, w2 = _experts(10, 64, 32, 4, 2, dtype=torch.bfloat16, seed=10)
    plan = plan_routing(ids, 4)
    gu = torch.randn(plan.rows, 64, device=DEV).bfloat16()
    dy = torch.randn(plan.rows, 64, device=DEV).bfloat16()
    a = gg.down_dgrad_situ(dy, w2, gu, plan, 4.0, 25.0)
    b = gg.down_dgrad_situ(dy, w2, gu, plan, 4.0, 25.0, fused=True)
    assert torch.equal(a, b)


def test_experts_bf16_matches_spec():
    case = _experts(10, 64, 32, 4, 2, dtype=torch.bfloat16, seed=6)
    y, grads = _fwd_bwd(moe_experts, *case)
    y_r, grads_r = _fwd_bwd(naive.naive_experts, *case)
    assert y.dtype == torch.bfloat16
    assert rel_rms(y, y_r) < 1e-2
    for a, r in zip(grads, grads_r):
        assert rel_rms(a, r) < 2e-2


def test_experts_deterministic_and_batch_invariant(fp32_case):
    """Same bits on a rerun, and a token's output does not depend on which other tokens share the batch."""
    z, ids, w, w1, w3, w2 = fp32_case
    y = moe_experts(z, ids, w, w1, w3, w2)
    assert torch.equal(y, moe_experts(z, ids, w, w1, w3, w2))
    sub = torch.tensor([3, 0, 7, 12], device=DEV)
    assert torch.equal(moe_experts(z[sub], ids[sub], w[sub], w1, w3, w2), y[sub])
    rev = torch.arange(z.shape[0] - 1, -1, -1, device=DEV)
    assert torch.equal(moe_experts(z[rev], ids[rev], w[rev], w1, w3, w2), y[rev])


def test_experts_fp8():
    """FP8 forward against the spec's dequantised math (bitwise under the interpreter), its error against bf16,
    and the gradients it gives (backward in bf16 from the FP8 forward's saved tensors)."""
    case = _experts(9, 128, 128, 3, 2, dtype=torch.bfloat16, seed=7)
    y8, g8 = _fwd_bwd(moe_experts, *case, precision=Precision.FP8)
    y16, g16 = _fwd_bwd(moe_experts, *case)
    y_spec = naive.naive_experts_fp8(*case)
    if DEV == "cpu":
        assert torch.equal(y8, y_spec)
    else:
        assert rel_rms(y8, y_spec) < 1e-2
    err = {"out": rel_rms(y8, y16), **{n: rel_rms(a, b) for n, a, b in zip(("dz", "dw", "dw1", "dw3", "dw2"), g8, g16)}}
    print("fp8 vs bf16 relative RMS:", err)
    assert all(v < 0.1 for v in err.values()), err
    q, s = quantize_weight_fp8(case[3])
    q_r, s_r = naive.naive_quant_weight(case[3])
    assert torch.equal(q.view(torch.uint8), q_r.view(torch.uint8))
    if DEV == "cpu":
        assert torch.equal(s, s_r)
    else:  # torch's CUDA division by a scalar multiplies by its reciprocal; ours is IEEE division
        torch.testing.assert_close(s, s_r, rtol=2e-7, atol=0)


def test_mxfp4_dequant():
    g = torch.Generator().manual_seed(8)
    packed = torch.randint(0, 256, (4, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 135, (4, 2), generator=g, dtype=torch.uint8)
    ref = naive.naive_dequant_mxfp4(packed, scales)
    assert torch.equal(dequantize_mxfp4(packed.to(DEV), scales.to(DEV)).cpu(), ref)
    # one hand-checked byte: low nibble 0b0011 = +1.5, high nibble 0b1111 = -6, scale 2^(128 - 127) = 2
    one = naive.naive_dequant_mxfp4(torch.full((1, 16), 0xF3, dtype=torch.uint8), torch.full((1, 1), 128,
                                                                                             dtype=torch.uint8))
    assert one[0, :2].tolist() == [3.0, -12.0]
    with pytest.raises(ValueError, match="scales"):
        dequantize_mxfp4(packed.to(DEV), scales[:, :1].to(DEV))


def test_experts_bad_input(fp32_case):
    z, ids, w, w1, w3, w2 = fp32_case
    with pytest.raises(ValueError, match="w2"):
        moe_experts(z, ids, w, w1, w3, w2[:, :-1])
    with pytest.raises(ValueError, match="weights"):
        moe_experts(z, ids, w[:, :1], w1, w3, w2)
    with pytest.raises(ValueError, match="ids"):
        moe_experts(z, ids + 100, w, w1, w3, w2)
    with pytest.raises(ValueError, match="w1"):
        moe_experts(z, ids, w, w1, w3, w2, precision=Precision.FP8)  # 48 / 40 are not multiples of 128
    with pytest.raises(ValueError, match="w3"):
        moe_experts(z, ids, w, w1, w3.double(), w2)


# ---------------------------------------------------------------------------------------------------- GPU, K3 size
@pytest.fixture(scope="module")
def k3_case():
    torch.manual_seed(0)
    N, L, I, E, k = 4096, 3584, 3072, 112, 16
    z = torch.randn(N, L, device="cuda", dtype=torch.bfloat16)
    W = (torch.randn(E, L, device="cuda") / L ** 0.5).bfloat16()
    ids, w = fused_router(z, W, None, k)
    w1 = (torch.randn(E, I, L, device="cuda") / L ** 0.5).bfloat16()
    w3 = (torch.randn(E, I, L, device="cuda") / L ** 0.5).bfloat16()
    w2 = (torch.randn(E, L, I, device="cuda") / I ** 0.5).bfloat16()
    return z, ids, w, w1, w3, w2


@pytest.mark.gpu
def test_gpu_k3_shapes(k3_case):
    y, grads = _fwd_bwd(moe_experts, *k3_case)
    y_r, grads_r = _fwd_bwd(naive.naive_experts, *k3_case)
    errs = {"out": rel_rms(y, y_r), **{n: rel_rms(a, b) for n, a, b in zip(("dz", "dw", "dw1", "dw3", "dw2"),
                                                                              grads, grads_r)}}
    print("bf16 vs spec relative RMS:", errs)
    assert all(v < 1e-2 for v in errs.values()), errs
    y2, grads2 = _fwd_bwd(moe_experts, *k3_case)
    assert torch.equal(y, y2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
    z, ids, w, w1, w3, w2 = k3_case
    sub = torch.arange(0, z.shape[0], 7, device="cuda")
    assert torch.equal(moe_experts(z[sub], ids[sub], w[sub], w1, w3, w2), y[sub])


@pytest.mark.gpu
def test_gpu_k3_fp8(k3_case):
    y8, g8 = _fwd_bwd(moe_experts, *k3_case, precision=Precision.FP8)
    y16, g16 = _fwd_bwd(moe_experts, *k3_case)
    errs = {"out": rel_rms(y8, y16), **{n: rel_rms(a, b) for n, a, b in zip(("dz", "dw", "dw1", "dw3", "dw2"), g8,
                                                                              g16)}}
    print("fp8 vs bf16 relative RMS:", errs)
    assert all(v < 0.1 for v in errs.values()), errs
    assert torch.equal(y8, _fwd_bwd(moe_experts, *k3_case, precision=Precision.FP8)[0])


@pytest.mark.gpu
def test_gpu_router_k3(k3_case):
    z = k3_case[0]
    torch.manual_seed(1)
    W = torch.randn(896, z.shape[1], device="cuda") / z.shape[1] ** 0.5
    b = torch.randn(896, device="cuda") * 0.01
    ids, w = fused_router(z.float(), W, b, 16)
    ids_r, w_r = naive.naive_router(z.float(), W, b, 16)
    assert (ids == ids_r).all(1).float().mean() > 0.99  # fp32 GEMM accumulation order differs: rare near-ties
    sub = torch.arange(0, z.shape[0], 5, device="cuda")
    assert torch.equal(fused_router(z.float()[sub], W, b, 16)[0], ids[sub])
