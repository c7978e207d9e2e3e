"""k3_kernels.batch_invariant: a row's result is the same bits whatever rows share the call (the property a
bitwise [B, k+1] speculative verify needs from every projection), and matches the fp64 spec to the dtype's
rounding. Interpreter on CPU; the `gpu` test repeats it at K3 widths on CUDA."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.batch_invariant import MatmulConfig, batch_invariant_linear, config_for, naive_linear  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows_invariant(x, w, bias, cuts):
    full = batch_invariant_linear(x, w, bias)
    for start, stop in cuts:
        part = batch_invariant_linear(x[start:stop].clone(), w, bias)
        assert torch.equal(part, full[start:stop]), (start, stop)
    return full


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M,N,K", [(1, 40, 24), (37, 70, 100), (70, 33, 200)])
def test_matches_spec_and_rows_are_invariant(dtype, M, N, K):
    """Against fp64 (relative to the output scale), and every slice of rows alone equals its rows in the full
    call: single rows, a tile's worth, slices across tile boundaries at odd offsets."""
    g = torch.Generator().manual_seed(M * 1000 + N)
    x = torch.randn(M, K, generator=g).to(DEV, dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV, dtype)
    bias = torch.randn(N, generator=g).to(DEV, dtype)
    cuts = [(0, 1), (M - 1, M), (M // 3, M), (1, max(2, M - 2))]
    full = _rows_invariant(x, w, bias, cuts)
    ref = naive_linear(x, w, bias)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (full.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()


@pytest.mark.parametrize("split", [2, 3, 64])
def test_split_k_keeps_rows_invariant(split):
    """A configuration splitting K into fixed ranges (partials added in range order by a second kernel; 64 is
    clamped to one range per BLOCK_K step): rows alone equal their rows in the full call, bias included, the
    splits reproduce themselves, and the result matches fp64 to fp32 rounding."""
    M, N, K = 37, 70, 200
    g = torch.Generator().manual_seed(split)
    x = torch.randn(M, K, generator=g).to(DEV)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(DEV)
    bias = torch.randn(N, generator=g).to(DEV)
    base = config_for(torch.device(DEV), torch.float32, N, K)
    cfg = MatmulConfig(base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages, split_k=split)
    full = batch_invariant_linear(x, w, bias, config=cfg)
    for start, stop in [(0, 1), (M - 1, M), (M // 3, M), (5, 21)]:
        assert torch.equal(batch_invariant_linear(x[start:stop].clone(), w, bias, config=cfg), full[start:stop])
    assert torch.equal(batch_invariant_linear(x, w, bias, config=cfg), full)
    ref = naive_linear(x, w, bias)
    assert (full - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_batch_dims_and_no_bias():
    """[B, T, K] inputs come back [B, T, N]; a [B, 1] call (decode) equals the same tokens inside a [B, 4] call
    (a verify), token by token."""
    x = torch.randn(3, 4, 48, device=DEV)
    w = torch.randn(20, 48, device=DEV)
    verify = batch_invariant_linear(x, w)
    assert verify.shape == (3, 4, 20)
    for t in range(4):
        assert torch.equal(batch_invariant_linear(x[:, t:t + 1].contiguous(), w), verify[:, t:t + 1])


def test_bad_inputs_name_the_tensor():
    w = torch.randn(8, 16, device=DEV)
    for x, wt, b, field in [(torch.randn(2, 15, device=DEV), w, None, "x"),
                            (torch.randn(2, 16, device=DEV), w[0], None, "weight"),
                            (torch.randn(2, 16, device=DEV, dtype=torch.bfloat16), w, None, "dtype"),
                            (torch.randn(2, 16, device=DEV), w, torch.randn(7, device=DEV), "bias")]:
        with pytest.raises(ValueError, match=field if field != "dtype" else "bf16"):
            batch_invariant_linear(x, wt, b)
    assert batch_invariant_linear(torch.randn(0, 16, device=DEV), w).shape == (0, 8)


@pytest.mark.gpu
def test_k3_widths_on_cuda():
    """K3 projections (7168 -> 1536, 7168 -> 576, 12288 -> 7168) in bf16: decode sizes 1 .. 128 rows and a
    4096-row prefill give every row the same bits; error against fp64 at bf16 rounding."""
    torch.manual_seed(0)
    for N, K in [(1536, 7168), (576, 7168), (7168, 12288)]:
        x = torch.randn(4096, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(N, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
        full = batch_invariant_linear(x, w)
        for m in (1, 2, 4, 8, 32, 128):
            assert torch.equal(batch_invariant_linear(x[5:5 + m].clone(), w), full[5:5 + m]), (N, K, m)
        ref = naive_linear(x[:64], w)
        assert (full[:64].float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
        base = config_for(x.device, x.dtype, N, K)   # the same with K split into four fixed ranges
        cfg = MatmulConfig(base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages, split_k=4)
        split = batch_invariant_linear(x, w, config=cfg)
        for m in (1, 8, 32):
            assert torch.equal(batch_invariant_linear(x[5:5 + m].clone(), w, config=cfg), split[5:5 + m]), (N, K, m)
        assert (split[:64].float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()
