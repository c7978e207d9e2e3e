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
         Fp8LinearTile(block_n=64, block_k=64, split_k=3), Fp8LinearTile(block_n=32, block_k=64, f16_operands=True),
         Fp8LinearTile(block_n=64, block_k=64, split_k=3, f16_operands=True)]
TILE_IDS = lambda t: f"{t.layout}-split{t.split_k}" + ("-f16" if t.f16_operands else "")   # noqa: E731


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


@pytest.mark.parametrize("tile", TILES, ids=TILE_IDS)
@pytest.mark.parametrize("M", [1, 5, 16])
def test_kernel_matches_the_spec_fp32(M, tile):
    """N and K not multiples of the tiles (72 = 2 x 32 + 8 columns, 300 = 256 + 44 = 4 x 64 + 44; split in 3:
    128 + 128 + 44), rows below one tile."""
    x, q, scale, _ = _case(M, 72, 300, torch.float32)
    torch.testing.assert_close(fp8_weight_linear(x, q, scale, tile), naive_fp8_weight_linear(x, q, scale),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tile", TILES, ids=TILE_IDS)
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


@pytest.mark.parametrize("tile", TILES[3:], ids=TILE_IDS)
def test_f16_operands_keep_rows_of_any_magnitude(tile):
    """`f16_operands`: each bf16 row goes to fp16 scaled by its own power of two, so rows far outside fp16's range
    (1e30, 1e-20, and 2^116 / 2^-120 near bf16's ends) or all zero come out as the spec's, and no row's scaling
    touches another's."""
    x, q, scale, _ = _case(7, 72, 300, torch.bfloat16)
    x = x * torch.tensor([1.0, 1e30, 1e-20, 0.0, 7e4, 0.0, 2.0 ** -120], dtype=torch.bfloat16, device=DEV)[:, None]
    x[5, 7], x[5, 100] = 2.0 ** 116, -(2.0 ** 110)  # (a whole row at 2^116 would overflow the output itself)
    got = fp8_weight_linear(x, q, scale, tile).float()
    ref = naive_fp8_weight_linear(x, q, scale).float()
    assert torch.isfinite(got).all() and torch.equal(got[3], torch.zeros_like(got[3]))
    for r in (0, 1, 2, 4, 5, 6):
        torch.testing.assert_close(got[r] / ref[r].abs().max(), ref[r] / ref[r].abs().max(), rtol=0, atol=2 ** -7)
        assert torch.equal(fp8_weight_linear(x[r:r + 1], q, scale, tile), got[r:r + 1].to(torch.bfloat16))


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
    with pytest.raises(ValueError, match="f16_operands"):
        Fp8LinearTile("rows_major", f16_operands=True)


_PTX_OPS = """
import collections, json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3_kernels.fp8_linear import gemv
TYPES = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "part_ptr": "*fp32",
         "factor_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32", "x_stride": "i32", "k_per_split": "i32"}
out = {}
for f16 in (False, True):
    fn = gemv._swapped_kernel
    consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT=1, F16=f16, EVEN=True)
    sig = {n: "constexpr" if n in consts else ("*fp16" if n == "x_ptr" and f16 else TYPES[n]) for n in fn.arg_names}
    src = ASTSource(fn, sig, {(i,): consts[n] for i, n in enumerate(fn.arg_names) if n in consts},
                    {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in consts and n != "M"})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4)).asm["ptx"]
    out[str(f16)] = collections.Counter(re.findall(r"\\b(cvt\\.[a-z0-9.]+|wgmma\\.[a-z0-9._]+)", ptx))
print(json.dumps(out))
"""


def test_f16_operands_upcast_in_one_conversion_for_the_h200():
    """Why `f16_operands` exists, checked on the sm_90 build (no GPU needed): with bf16 operands the e4m3 weights
    go e4m3x2 -> f16x2, then f16 -> bf16 an element (cvt.bf16.f16: F2F in the SASS, 16 a clock an SM, about the
    HBM rate of e4m3 bytes on the H200); with fp16 operands the e4m3x2 -> f16x2 conversion alone feeds the
    wgmma."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PTX_OPS], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ops = json.loads(run.stdout.strip().splitlines()[-1])
    bf16, f16 = ops["False"], ops["True"]
    assert bf16.get("cvt.bf16.f16", 0) > 0 and f16.get("cvt.bf16.f16", 0) == 0, ops
    assert f16.get("cvt.rn.f16x2.e4m3x2", 0) > 0 and any(op.startswith("wgmma") and "f16" in op for op in f16), ops


@pytest.mark.gpu
def test_gpu_head_shapes_match_the_spec():
    """The draft head's matrices at K3's width (fuse 21504 -> 7168, mix 14336 -> 7168, up 7168 -> 14336), 1 and
    8 rows, bf16, the default tile and both layouts at the head's sizes (K split in 4); a row's bits its own."""
    tiles = [DEFAULT_TILE, Fp8LinearTile("rows_major", 32, 512, 4, 3), Fp8LinearTile(block_n=128, split_k=4),
             Fp8LinearTile(f16_operands=True), Fp8LinearTile(block_n=128, split_k=4, f16_operands=True)]
    for N, K in ((7168, 21504), (7168, 14336), (14336, 7168)):
        for M in (1, 8):
            x, q, scale, _ = _case(M, N, K, torch.bfloat16)
            ref = naive_fp8_weight_linear(x, q, scale)
            for tile in tiles:
                got = fp8_weight_linear(x, q, scale, tile)
                torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -7, atol=1e-3)
                assert torch.equal(fp8_weight_linear(x, q, scale, tile), got)
                assert torch.equal(fp8_weight_linear(x[:1], q, scale, tile), got[:1])
