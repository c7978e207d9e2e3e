"""Multi-LoRA SGMV kernels (k3_kernels.lora) against the reference (naive.py) and against the model's LoRA
path; Triton's interpreter on CPU, the real kernels on the GPU (`gpu` test)."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.lora import naive_multi_lora, segments  # noqa: E402
from k3_kernels.lora.sgmv import bgmv_lora, sgmv_lora  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(N, K, O, R, S, slots, dtype=torch.float32, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g).to(device, dtype)
    base = torch.randn(N, O, generator=g).to(device, dtype)
    a = (torch.randn(S, R, K, generator=g) / K ** 0.5).to(device, dtype)
    b = (torch.randn(S, O, R, generator=g) / R ** 0.5).to(device, dtype)
    scale = torch.rand(S, generator=g) + 0.5
    return x, base, a, b, torch.tensor(slots, device=device), scale


def test_segments():
    s = torch.tensor([0, 0, -1, 2, 2, 2, 0, -1, -1, 1])
    assert segments(s).tolist() == [[0, 2, 0], [3, 3, 2], [6, 1, 0], [9, 1, 1]]
    assert segments(torch.tensor([-1, -1])).shape == (0, 3)


@pytest.mark.parametrize("slots", [
    [0] * 5 + [1] * 20 + [-1] * 3 + [2] * 9,            # SGMV: segments, one of them longer than a tile
    [2, 0, 1, -1, 1, 0, 2, 2],                           # BGMV: per-token adapters (decode)
    [-1] * 4,                                            # no adapter at all
])
def test_matches_reference_fp32(slots):
    x, base, a, b, s, scale = _case(len(slots), 40, 72, 8, 3, slots)
    got = sgmv_lora(x, base, a, b, s, scale)
    want = naive_multi_lora(x, base, a, b, s, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(got[s < 0], base[s < 0])           # rows without an adapter are bitwise the base


@pytest.mark.parametrize("slots", [
    [0] * 5 + [1] * 20 + [-1] * 3 + [2] * 9,
    [2, 0, 1, -1, 1, 0, 2, 2],
    [-1] * 4,
])
def test_bgmv_is_sgmv(slots):
    """The per-token entry (one length-1 segment a token built on the device, the captured decode's path) gives
    every row the bits the host-segmented SGMV gives it, and the reference's values; rows of slot -1 are the
    base."""
    x, base, a, b, s, scale = _case(len(slots), 40, 72, 8, 3, slots)
    got = bgmv_lora(x, base, a, b, s, scale)
    assert torch.equal(got, sgmv_lora(x, base, a, b, s, scale))
    torch.testing.assert_close(got, naive_multi_lora(x, base, a, b, s, scale), atol=2e-5, rtol=2e-5)
    assert torch.equal(got[s < 0], base[s < 0])


def test_bgmv_is_inference_only():
    x, base, a, b, s, scale = _case(4, 8, 8, 4, 2, [0, 1, -1, 0])
    with pytest.raises(ValueError, match="inference only"):
        bgmv_lora(x.requires_grad_(), base, a, b, s, scale)
    with pytest.raises(ValueError, match="base"):
        bgmv_lora(x.detach(), base[:, :4], a, b, s, scale)


def test_padded_ranks_add_exact_zeros_and_runs_repeat_bitwise():
    slots = [0] * 6 + [1] * 6
    x, base, a, b, s, scale = _case(12, 24, 20, 8, 2, slots, seed=1)
    a[1, 4:] = 0                                         # adapter 1 is rank 4, padded to 8
    b[1, :, 4:] = 0
    y1 = sgmv_lora(x, base, a, b, s, scale)
    assert torch.equal(y1, sgmv_lora(x, base, a, b, s, scale))
    ref = naive_multi_lora(x[6:], base[6:], a[1:, :4], b[1:, :, :4], torch.zeros(6, dtype=torch.long, device=DEV),
                           scale[1:])
    torch.testing.assert_close(y1[6:], ref, atol=2e-5, rtol=2e-5)


def test_bad_input_names_the_tensor():
    x, base, a, b, s, scale = _case(4, 8, 8, 4, 2, [0, 0, 1, 1])
    with pytest.raises(ValueError, match="lora_a"):
        sgmv_lora(x, base, a[:, :, :4], b, s, scale)
    with pytest.raises(ValueError, match="slots"):
        sgmv_lora(x, base, a, b, torch.tensor([0, 0, 2, 1], device=DEV), scale)
    with pytest.raises(ValueError, match="scale"):
        sgmv_lora(x, base, a, b, s, scale[:1])


@pytest.mark.gpu
def test_gpu_matches_reference():
    slots = [0] * 700 + [1] * 300 + [-1] * 24 + [2] * 1000
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        x, base, a, b, s, scale = _case(len(slots), 2048, 4096, 64, 3, slots, dtype=dtype)
        got = sgmv_lora(x, base, a, b, s, scale)
        want = naive_multi_lora(x, base, a, b, s, scale)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        assert torch.equal(got, sgmv_lora(x, base, a, b, s, scale))
        assert torch.equal(got, bgmv_lora(x, base, a, b, s, scale))   # the captured decode's path: same bits


def _grads(fn, x, base, a, b, s, scale, dy):
    ins = [t.detach().clone().requires_grad_() for t in (x, base, a, b)]
    y = fn(*ins, s, scale)
    y.backward(dy)
    return y.detach(), [t.grad for t in ins]


def test_backward_matches_reference():
    """The autograd of sgmv_lora (training forwards on the GPU go through it) against autograd through the
    reference: dx, dbase, dA, dB; an adapter absent from the batch gets an exact zero gradient."""
    slots = [0] * 5 + [-1] * 2 + [1] * 6 + [0] * 3 + [-1]
    x, base, a, b, s, scale = _case(len(slots), 24, 40, 8, 3, slots, seed=2)   # slot 2 unused
    dy = torch.randn(len(slots), 40, generator=torch.Generator().manual_seed(3)).to(DEV)
    y, g = _grads(sgmv_lora, x, base, a, b, s, scale, dy)
    y_ref, g_ref = _grads(naive_multi_lora, x, base, a, b, s, scale, dy)
    torch.testing.assert_close(y, y_ref, atol=2e-5, rtol=2e-5)
    for name, got, want in zip(("x", "base", "lora_a", "lora_b"), g, g_ref):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=name)
    assert not g[2][2].any() and not g[3][2].any()
    assert torch.equal(g[0][s < 0], torch.zeros_like(g[0][s < 0]))
    _, g2 = _grads(sgmv_lora, x, base, a, b, s, scale, dy)                     # deterministic
    assert all(torch.equal(p, q) for p, q in zip(g, g2))


def test_an_adapters_gradient_depends_only_on_its_rows():
    """Adapter 0's rows alone give adapter 0 the same gradient (bitwise) as inside a batch with other adapters."""
    slots = [1] * 4 + [0] * 6 + [2] * 5
    x, base, a, b, s, scale = _case(len(slots), 16, 24, 4, 3, slots, seed=4)
    dy = torch.randn(len(slots), 24, generator=torch.Generator().manual_seed(5)).to(DEV)
    _, g = _grads(sgmv_lora, x, base, a, b, s, scale, dy)
    _, g0 = _grads(sgmv_lora, x[4:10], base[4:10], a, b, s[4:10], scale, dy[4:10])
    assert torch.equal(g[2][0], g0[2][0]) and torch.equal(g[3][0], g0[3][0])
    assert torch.equal(g[0][4:10], g0[0])


@pytest.mark.gpu
def test_gpu_backward_matches_reference():
    slots = [0] * 300 + [1] * 100 + [-1] * 20 + [2] * 200
    x, base, a, b, s, scale = _case(len(slots), 1024, 512, 32, 3, slots)
    dy = torch.randn(len(slots), 512, generator=torch.Generator().manual_seed(3)).to(DEV)
    _, g = _grads(sgmv_lora, x, base, a, b, s, scale, dy)
    _, g_ref = _grads(naive_multi_lora, x, base, a, b, s, scale, dy)
    for name, got, want in zip(("x", "base", "lora_a", "lora_b"), g, g_ref):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3, msg=name)


def test_segment_memo_follows_the_slots_values():
    """sgmv_lora memoises the host segments of the last slots tensor: an in-place change must not reuse them."""
    slots = [0] * 4 + [1] * 4
    x, base, a, b, s, scale = _case(8, 8, 8, 4, 2, slots, seed=6)
    sgmv_lora(x, base, a, b, s, scale)
    s[:4] = 1                                             # same object, new version
    torch.testing.assert_close(sgmv_lora(x, base, a, b, s, scale), naive_multi_lora(x, base, a, b, s, scale),
                               atol=2e-5, rtol=2e-5)
    s[0] = 5
    with pytest.raises(ValueError, match="slots"):
        sgmv_lora(x, base, a, b, s, scale)
