"""Multi-LoRA SGMV kernels (k3_kernels.lora) against the reference (naive.py) and against the model's LoRA
path; Triton's interpreter on CPU, the real kernels on the GPU (`gpu` test)."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.lora import naive_multi_lora, segments  # noqa: E402
from k3_kernels.lora.sgmv import sgmv_lora  # noqa: E402

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
