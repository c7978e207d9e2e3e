"""Weight-only FP8 linear (k3_kernels.fp8_linear: the trained draft head's steps at half a bf16 weight's bytes)
against its spec (naive.py): Triton's interpreter on CPU, the real kernel on the GPU (`gpu` test). Why it exists:
the head's three draft steps read 2.15 GB of bf16 weights a chain at K3's width, the largest speculative cost
beside the verify at batch 8 (k3/rollout/spec/NOTES.md)."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.fp8_linear import naive_fp8_weight_linear, quantize_weight_rows  # noqa: E402
from k3_kernels.fp8_linear.gemv import DEFAULT_TILE, Fp8LinearTile, fp8_weight_linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# both layouts, K split into ranges or not (the split's partial sums added by a second launch), at small tiles
TILES = [Fp8LinearTile("rows_major", block_n=32, block_k=256), Fp8LinearTile(block_n=32, block_k=64),
         Fp8LinearTile(block_n=64, block_k=64, split_k=3)]


def _case(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    w[3] = 0.0                                    # an all-zero row: scale 1, zeros out
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    q, scale = quantize_weight_rows(w)
    return x, q.to(DEV), scale.to(DEV), w


def test_row_quantisation_is_close_and_uses_the_range():
    _, q, scale, w = _case(1, 40, 96, torch.float32)
    deq = q.float().cpu() * scale.cpu()[:, None]
    assert ((deq - w).norm(dim=1) <= 2 ** -4 * w.norm(dim=1) + 1e-12).all()
    amax = q.float().abs().amax(1).cpu()
    assert torch.equal(amax[w.abs().amax(1) > 0], torch.full_like(amax[w.abs().amax(1) > 0], 448.0))
    assert scale[3].item() == 1.0 and (q[3].float() == 0).all()


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.layout}-split{t.split_k}")
@pytest.mark.parametrize("M", [1, 5, 16])
def test_kernel_matches_the_spec_fp32(M, tile):
    """N and K not multiples of the tiles (72 = 2 x 32 + 8 columns, 300 = 256 + 44 = 4 x 64 + 44; split in 3:
    128 + 128 + 44), rows below one tile."""
    x, q, scale, _ = _case(M, 72, 300, torch.float32)
    torch.testing.assert_close(fp8_weight_linear(x, q, scale, tile), naive_fp8_weight_linear(x, q, scale),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t.layout}-split{t.split_k}")
def test_kernel_bf16_rows_are_their_own(tile):
    """bf16 activations: within one bf16 rounding of the spec, and each row's output the same bits whatever rows
    share the call (a draft does not depend on the rows drafted beside it)."""
    x, q, scale, _ = _case(8, 64, 512, torch.bfloat16)
    got = fp8_weight_linear(x, q, scale, tile)
    ref = naive_fp8_weight_linear(x, q, scale)
    torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
    for r in (0, 5, 7):
        assert torch.equal(fp8_weight_linear(x[r:r + 1], q, scale, tile), got[r:r + 1])
    assert torch.equal(fp8_weight_linear(x[2:6], q, scale, tile), got[2:6])


def test_bad_arguments_are_named_before_any_launch():
    x, q, scale, _ = _case(2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="x: last dim"):
        fp8_weight_linear(x[:, :32], q, scale)
    with pytest.raises(ValueError, match="q: expected a float8_e4m3fn"):
        fp8_weight_linear(x, q.float(), scale)
    with pytest.raises(ValueError, match="scale: expected fp32"):
        fp8_weight_linear(x, q, scale[:-1])
    with pytest.raises(ValueError, match="x: expected bfloat16 or float32"):
        fp8_weight_linear(x.half(), q, scale)
    with pytest.raises(ValueError, match="at most 64"):
        fp8_weight_linear(x.new_zeros(65, 64), q, scale)
    with pytest.raises(ValueError, match="w: expected a non-empty"):
        quantize_weight_rows(torch.zeros(3))
    with pytest.raises(ValueError, match="split_k"):
        Fp8LinearTile("rows_major", split_k=2)
    with pytest.raises(ValueError, match="layout"):
        Fp8LinearTile("columns")


@pytest.mark.gpu
def test_gpu_head_shapes_match_the_spec():
    """The draft head's matrices at K3's width (fuse 21504 -> 7168, mix 14336 -> 7168, up 7168 -> 14336), 1 and
    8 rows, bf16, the default tile and both layouts at the head's sizes (K split in 4); a row's bits its own."""
    tiles = [DEFAULT_TILE, Fp8LinearTile("rows_major", 32, 512, 4, 3), Fp8LinearTile(block_n=128, split_k=4)]
    for N, K in ((7168, 21504), (7168, 14336), (14336, 7168)):
        for M in (1, 8):
            x, q, scale, _ = _case(M, N, K, torch.bfloat16)
            ref = naive_fp8_weight_linear(x, q, scale)
            for tile in tiles:
                got = fp8_weight_linear(x, q, scale, tile)
                torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
                assert torch.equal(fp8_weight_linear(x, q, scale, tile), got)
                assert torch.equal(fp8_weight_linear(x[:1], q, scale, tile), got[:1])
