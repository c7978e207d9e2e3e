"""Fused block AttnRes (k3_kernels.attnres.fused) against the K3 reference and fla-core's naive_attnres.

On CPU the Triton kernels run under TRITON_INTERPRET=1 at small shapes; the GPU tests repeat the checks at
K3's width on CUDA."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.attnres import naive_block_attnres  # noqa: E402
import k3_kernels.attnres.fused as fz  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(R, N=(2, 3), D=48, dtype=torch.float32, out_norm=False, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device)
    rows = [(r(*N, D) * (1 + i)).to(dtype).requires_grad_() for i in range(R)]
    partial = r(*N, D).to(dtype).requires_grad_()
    q = r(D, scale=0.3).requires_grad_()
    w = (1 + r(D, scale=0.1)).requires_grad_()
    ow = (1 + r(D, scale=0.1)).requires_grad_() if out_norm else None
    do = r(*N, D).to(dtype)
    return rows, partial, q, w, ow, do


def _err_ratio(x, ref):
    """RMS error relative to the reference's RMS (fla-core's test metric)."""
    x, ref = x.double(), ref.double()
    return ((x - ref).square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-30)).item()


def _grads(out, inputs, do):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], do)


@pytest.mark.parametrize("R", [0, 1, 3, 8])
@pytest.mark.parametrize("out_norm", [False, True])
def test_block_attnres_matches_reference_fp32(R, out_norm):
    rows, partial, q, w, ow, do = _inputs(R, out_norm=out_norm, seed=R)
    o = fz.fused_block_attnres(rows, partial, q, w, 1e-6, ow)
    o_ref = naive_block_attnres(rows, partial, q, w, 1e-6, ow)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    ins = [*rows, partial, q, w, ow]
    for a, b in zip(_grads(o, ins, do), _grads(o_ref, ins, do)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_block_attnres_bf16_rounds_mixture_before_norm():
    rows, partial, q, w, ow, do = _inputs(4, dtype=torch.bfloat16, out_norm=True, seed=11)
    o = fz.fused_block_attnres(rows, partial, q, w, 1e-6, ow)
    o_ref = naive_block_attnres(rows, partial, q, w, 1e-6, ow)
    assert o.dtype == torch.bfloat16
    # same K3 numerics (mixture rounded to bf16, then the fp32 norm): at most one bf16 ulp apart
    torch.testing.assert_close(o.float(), o_ref.float(), atol=1e-2, rtol=8e-3)
    ins = [*rows, partial, q, w, ow]
    for a, b in zip(_grads(o, ins, do), _grads(o_ref, ins, do)):
        torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("L", [1, 4, 10])
@pytest.mark.parametrize("out_norm", [False, True])
def test_fused_attnres_matches_fla_naive(L, out_norm):
    fla_naive = pytest.importorskip("fla.ops.attnres.naive")
    rows, partial, q, w, ow, do = _inputs(L - 1, out_norm=out_norm, seed=100 + L)
    res = [*rows, partial]
    o, p = fz.fused_attnres(q, res, w, ow, 1e-6, 0.7, return_weights=True)
    o_ref, p_ref = fla_naive.naive_attnres(q, res, w, ow, 1e-6, 0.7, return_weights=True)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p, p_ref, atol=1e-6, rtol=1e-5)
    ins = [*res, q, w, ow]
    for a, b in zip(_grads(o, ins, do), _grads(o_ref, ins, do)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_strided_bank_accumulates_into_existing_grad():
    """K3 layout: rows are views of one [N, R, D] bank; its existing .grad is accumulated in place."""
    N, R, D = 6, 3, 40
    bank = torch.randn(N, R, D, device=DEV, requires_grad=True)
    partial = torch.randn(N, D, device=DEV, requires_grad=True)
    q, w = torch.randn(D, device=DEV) * 0.3, torch.ones(D, device=DEV)
    pre_b, pre_p = torch.randn_like(bank), torch.randn_like(partial)
    bank.grad, partial.grad = pre_b.clone(), pre_p.clone()
    ptr_b, ptr_p = bank.grad.data_ptr(), partial.grad.data_ptr()
    do = torch.randn(N, D, device=DEV)
    fz.fused_block_attnres(list(bank.unbind(1)), partial, q, w).backward(do)
    assert bank.grad.data_ptr() == ptr_b and partial.grad.data_ptr() == ptr_p  # accumulated where it was
    b2, p2 = bank.detach().clone().requires_grad_(), partial.detach().clone().requires_grad_()
    naive_block_attnres(list(b2.unbind(1)), p2, q, w).backward(do)
    torch.testing.assert_close(bank.grad, pre_b + b2.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(partial.grad, pre_p + p2.grad, atol=1e-5, rtol=1e-5)


def test_autograd_grad_returns_instead_of_accumulating():
    rows, partial, q, w, _, do = _inputs(2, seed=5)
    partial.grad = torch.zeros_like(partial)
    o = fz.fused_block_attnres(rows, partial, q, w)
    g = torch.autograd.grad(o, [partial], do)[0]
    g_ref = torch.autograd.grad(naive_block_attnres(rows, partial, q, w), [partial], do)[0]
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    assert partial.grad.abs().max() == 0


def test_grad_sink_shares_one_buffer_across_consumers():
    """Bank rows produced inside the graph: two AttnRes consumers and a plain op feed one gradient."""
    N, D = 5, 32
    x = torch.randn(N, D, device=DEV, requires_grad=True)
    y = torch.randn(N, D, device=DEV, requires_grad=True)
    q1, q2, w = torch.randn(D, device=DEV) * 0.3, torch.randn(D, device=DEV) * 0.3, torch.ones(D, device=DEV)
    do = torch.randn(N, D, device=DEV)

    def model(attn, wrap):
        row0 = wrap(x * 2.0)
        row1 = wrap(torch.tanh(y) + row0)
        h = attn([row0], row1, q1, w)
        return (attn([row0, row1], h, q2, w) + row1 * 0.5) * do

    model(fz.fused_block_attnres, fz.attnres_grad_sink).sum().backward()
    gx, gy = x.grad.clone(), y.grad.clone()
    x.grad = y.grad = None
    model(naive_block_attnres, lambda t: t).sum().backward()
    torch.testing.assert_close(gx, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gy, y.grad, atol=1e-5, rtol=1e-5)


def test_source_passed_twice():
    rows, partial, q, w, _, do = _inputs(1, seed=9)
    o = fz.fused_block_attnres([rows[0], rows[0]], partial, q, w)
    o_ref = naive_block_attnres([rows[0], rows[0]], partial, q, w)
    for a, b in zip(_grads(o, [rows[0], partial, q, w], do), _grads(o_ref, [rows[0], partial, q, w], do)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _batch_invariance(N_list, D, dtype, device):
    g = torch.Generator().manual_seed(3)
    R = 3
    big = max(N_list) + 4
    srcs = [(torch.randn(big, D, generator=g) * (i + 1)).to(device, dtype) for i in range(R + 1)]
    q, w = (torch.randn(D, generator=g) * 0.3).to(device), torch.ones(D, device=device)
    ow = (1 + 0.1 * torch.randn(D, generator=g)).to(device)
    alone = [fz.block_attnres_decode([s[j:j + 1] for s in srcs[:-1]], srcs[-1][j:j + 1], q, w, 1e-6, ow)
             for j in range(big)]
    for n in N_list:
        for start in (0, 2, big - n):
            sl = slice(start, start + n)
            with torch.no_grad():
                o = fz.fused_block_attnres([s[sl] for s in srcs[:-1]], srcs[-1][sl], q, w, 1e-6, ow)
            for j in range(n):
                assert torch.equal(o[j], alone[start + j][0]), (n, start, j)
    # with autograd (stats saved) the forward bits are the same
    rows = [s[:5].clone().requires_grad_() for s in srcs[:-1]]
    o = fz.fused_block_attnres(rows, srcs[-1][:5], q, w, 1e-6, ow)
    assert torch.equal(o.detach(), torch.cat(alone[:5]))


def test_batch_invariance_and_decode_bits():
    _batch_invariance([1, 3, 7], 48, torch.float32, DEV)


def test_deterministic_gradients():
    rows, partial, q, w, ow, do = _inputs(3, N=(9,), out_norm=True, seed=21)
    ins = [*rows, partial, q, w, ow]
    g1 = _grads(fz.fused_block_attnres(rows, partial, q, w, 1e-6, ow), ins, do)
    g2 = _grads(fz.fused_block_attnres(rows, partial, q, w, 1e-6, ow), ins, do)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_bad_input_names_the_tensor():
    rows, partial, q, w, _, _ = _inputs(2)
    with pytest.raises(ValueError, match="sources\\[1\\]"):
        fz.fused_block_attnres([rows[0], rows[1][..., :10]], partial, q, w)
    with pytest.raises(ValueError, match="query"):
        fz.fused_block_attnres(rows, partial, q[:5], w)
    with pytest.raises(ValueError, match="sources"):
        fz.fused_block_attnres([rows[0]] * 16, partial, q, w)
    with pytest.raises(ValueError, match="sources\\[1\\]: dtype"):
        fz.fused_block_attnres([rows[0], rows[1].double()], partial, q, w)
    with pytest.raises(ValueError, match="checkpoint_level"):
        fz.fused_attnres(q, [*rows, partial], w, checkpoint_level=2)


def test_reference_evaluates_fp64_inputs_in_fp64():
    """The GPU tests' ground truth is the reference on fp64 inputs: it must not round through fp32."""
    rows, partial, q, w, ow, _ = _inputs(3, N=(4,), D=64, out_norm=True, seed=13)
    r64 = [t.detach().double() for t in (*rows, partial, q, w, ow)]
    o64 = naive_block_attnres(r64[:3], r64[3], *r64[4:6], 1e-6, r64[6])
    o32 = naive_block_attnres(rows, partial, q, w, 1e-6, ow)
    assert o64.dtype == torch.float64
    assert not torch.equal(o64, o32.double())  # fp32 rounding is visible against it
    torch.testing.assert_close(o64, o32.double(), atol=1e-5, rtol=1e-5)


def _grad_errors(grads, truth, n_sources):
    """RMS error of each gradient, relative to the scale of the gradient it belongs to.

    The sources' gradients are one object, the gradient of the op's input (the L stacked sources): each source's
    error is taken relative to that stacked gradient's RMS. A source whose softmax weight is e^-78 gets a
    gradient of ~1e-34, whose fp32 value carries a relative error of ~|s - lse| * eps_fp32 from the exponent
    alone; against its own RMS that says nothing about the op's accuracy. q / norm weights: their own RMS."""
    src = torch.cat([t.double().flatten() for t in truth[:n_sources]])
    src_scale = src.square().mean().sqrt().clamp_min(1e-300)
    out = []
    for i, (a, c) in enumerate(zip(grads, truth)):
        scale = src_scale if i < n_sources else c.double().square().mean().sqrt().clamp_min(1e-300)
        out.append(((a.double() - c.double()).square().mean().sqrt() / scale).item())
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("out_norm", [False, True])
def test_gpu_k3_width_matches_reference(out_norm):
    """fp32 at D = 7168: our error against an fp64 evaluation of the reference is within a few times the fp32
    reference's own error (sharp softmaxes at this width amplify rounding in both), or below 1e-5 of the
    gradient's scale (`_grad_errors`)."""
    rows, partial, q, w, ow, do = _inputs(8, N=(257,), D=7168, out_norm=out_norm, device="cuda", seed=1)
    ins = [*rows, partial, q, w, ow]
    ins64 = [t.detach().double().requires_grad_() if t is not None else None for t in ins]
    o = fz.fused_block_attnres(rows, partial, q, w, 1e-6, ow)
    o32 = naive_block_attnres(rows, partial, q, w, 1e-6, ow)
    o64 = naive_block_attnres(ins64[:8], ins64[8], *ins64[9:11], 1e-6, ins64[11])
    assert _err_ratio(o, o64) <= max(4 * _err_ratio(o32, o64), 1e-5)
    g64 = _grads(o64, ins64, do.double())
    ours = _grad_errors(_grads(o, ins, do), g64, 9)
    ref32 = _grad_errors(_grads(o32, ins, do), g64, 9)
    for i, (e, e32) in enumerate(zip(ours, ref32)):
        assert e <= max(4 * e32, 1e-5), (i, e, e32)


@pytest.mark.gpu
def test_gpu_bf16_and_fla_fused_agree():
    fla_fused = pytest.importorskip("fla.ops.attnres")
    fla_naive = pytest.importorskip("fla.ops.attnres.naive")
    rows, partial, q, w, _, do = _inputs(8, N=(1000,), D=7168, dtype=torch.bfloat16, device="cuda", seed=2)
    res = [*rows, partial]
    o = fz.fused_attnres(q, res, w)
    o_fla = fla_fused.fused_attnres(q, res, w)
    o_ref = fla_naive.naive_attnres(q, res, w)
    assert _err_ratio(o, o_ref) <= max(_err_ratio(o_fla, o_ref), 1e-3)
    ins = [*res, q, w]
    for i, e in enumerate(_grad_errors(_grads(o, ins, do), _grads(o_ref, ins, do), len(res))):
        assert e < 5e-3, (i, e)  # fla-core's bf16 ratio


@pytest.mark.gpu
def test_gpu_batch_invariance_and_determinism():
    _batch_invariance([1, 5, 33], 7168, torch.bfloat16, "cuda")
    rows, partial, q, w, ow, do = _inputs(8, N=(3000,), D=7168, dtype=torch.bfloat16, out_norm=True,
                                          device="cuda", seed=4)
    ins = [*rows, partial, q, w, ow]
    g1 = _grads(fz.fused_block_attnres(rows, partial, q, w, 1e-6, ow), ins, do)
    g2 = _grads(fz.fused_block_attnres(rows, partial, q, w, 1e-6, ow), ins, do)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def _ops_calls(device):
    from k3.model import ops
    g = torch.Generator().manual_seed(8)
    rows = [torch.randn(4, 64, generator=g).to(device) for _ in range(3)]
    partial = torch.randn(4, 64, generator=g).to(device)
    q, w = (torch.randn(64, generator=g) * 0.3).to(device), torch.ones(64, device=device)
    return ops, rows, partial, q, w


def test_ops_use_references_on_cpu():
    ops, rows, partial, q, w = _ops_calls("cpu")
    assert torch.equal(ops.block_attnres(rows, partial, q, w, 1e-6), naive_block_attnres(rows, partial, q, w, 1e-6))
    assert ops.attnres_bank_row(partial) is partial


@pytest.mark.gpu
def test_gpu_ops_dispatch_to_fused():
    ops, rows, partial, q, w = _ops_calls("cuda")
    assert torch.equal(ops.block_attnres(rows, partial, q, w, 1e-6), fz.fused_block_attnres(rows, partial, q, w, 1e-6))
    x = partial.clone().requires_grad_()
    assert ops.attnres_bank_row(x) is not x and ops.attnres_bank_row(partial) is partial
