"""k3_kernels.mla_decode: the per-query MLA attention that decode and speculative verifies share on CUDA. Why it
exists: a [B, k+1] verify's attention ran as batched einsums whose kernels depend on T and on the padded key
length, so a verified token's bits differed from plain decoding's. Here a query's result must depend only on its
own key sequence: the same bits alone or among other queries, under any padding of S, and whether its keys sit at
contiguous positions (decode, chain verify) or are gathered from scattered ones (a token-tree node). Against the
fp64 spec too. Interpreter on CPU; the `gpu` test repeats it at K3's dims."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.mla_decode import (causal_key_index, mask_key_index, naive_query_attention,  # noqa: E402
                                   query_attention)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, T, S, H, DN, DR, DV, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)   # noqa: E731
    return mk(B, T, H, DN), mk(B, T, H, DR), mk(B, S, H, DN), mk(B, S, DR), mk(B, S, H, DV)


@pytest.mark.parametrize("dims", [(2, 16, 8, 16), (3, 12, 6, 10)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_matches_spec(dims, dtype):
    """Causal calls (row b's query t sees keys 0 .. past[b] + t), power-of-two and odd head dims, key counts
    across block boundaries (1, 31, 33, 70 keys)."""
    H, DN, DR, DV = dims
    B, T, S = 3, 3, 72
    qn, qp, kn, kp, v = _inputs(B, T, S, H, DN, DR, DV, dtype)
    past = torch.tensor([0, 30, 67], device=DEV)
    index, count = causal_key_index(past, T, S)
    out = query_attention(qn, qp, kn, kp, v, index, count, 0.3)
    ref = naive_query_attention(qn, qp, kn, kp, v, index, count, 0.3)
    assert out.dtype == torch.float32 and out.shape == (B, T, H, DV)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_a_query_alone_equals_it_among_others_under_any_padding():
    """Decode ([B, 1], keys padded to the batch's longest row) vs a chain verify ([B, 4]): every query the same
    bits, whatever else shares the call and however long S is padded."""
    H, DN, DR, DV = 2, 16, 8, 16
    B, T, S = 3, 4, 60
    qn, qp, kn, kp, v = _inputs(B, T, S, H, DN, DR, DV, torch.bfloat16, seed=1)
    past = torch.tensor([5, 40, 33], device=DEV)
    index, count = causal_key_index(past, T, S)
    verify = query_attention(qn, qp, kn, kp, v, index, count, 0.2)
    for b in range(B):
        for t in range(T):
            n = int(past[b]) + t + 1
            for pad in (0, 7):   # the row alone, its keys padded by 7 more positions
                S1 = n + pad
                kn1, kp1, v1 = (torch.zeros(1, S1, *x.shape[2:], device=DEV, dtype=x.dtype) for x in (kn, kp, v))
                kn1[:, :n], kp1[:, :n], v1[:, :n] = kn[b:b + 1, :n], kp[b:b + 1, :n], v[b:b + 1, :n]
                i1, c1 = causal_key_index(torch.tensor([n - 1], device=DEV), 1, S1)
                one = query_attention(qn[b:b + 1, t:t + 1], qp[b:b + 1, t:t + 1], kn1, kp1, v1, i1, c1, 0.2)
                assert torch.equal(one, verify[b:b + 1, t:t + 1]), (b, t, pad)


def test_gathered_keys_equal_the_same_keys_in_place():
    """A tree node's keys (the prefix, then ancestors at scattered positions, through the mask) give the bits of
    the same key sequence stored contiguously (plain decoding of that path); the mask path matches the spec."""
    H, DN, DR, DV = 2, 16, 8, 16
    B, T, S = 2, 5, 50
    qn, qp, kn, kp, v = _inputs(B, T, S, H, DN, DR, DV, torch.float32, seed=2)
    g = torch.Generator().manual_seed(3)
    visible = torch.rand(B, T, S, generator=g).to(DEV) < 0.4
    visible[:, :, 0] = True
    index, count = mask_key_index(visible)
    out = query_attention(qn, qp, kn, kp, v, index, count, 0.25)
    ref = naive_query_attention(qn, qp, kn, kp, v, index, count, 0.25)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    for b in range(B):
        for t in range(T):
            keys = visible[b, t].nonzero().flatten()
            n = keys.numel()
            i1, c1 = causal_key_index(torch.tensor([n - 1], device=DEV), 1, n)
            one = query_attention(qn[b:b + 1, t:t + 1], qp[b:b + 1, t:t + 1], kn[b:b + 1, keys],
                                  kp[b:b + 1, keys], v[b:b + 1, keys], i1, c1, 0.25)
            assert torch.equal(one, out[b:b + 1, t:t + 1]), (b, t)


def test_bad_inputs_name_the_tensor():
    qn, qp, kn, kp, v = _inputs(1, 1, 4, 2, 16, 8, 16, torch.float32)
    index, count = causal_key_index(torch.tensor([3], device=DEV), 1, 4)
    with pytest.raises(ValueError, match="k_pe"):
        query_attention(qn, qp, kn, kp[:, :, :4], v, index, count, 1.0)
    with pytest.raises(ValueError, match="key_count"):
        query_attention(qn, qp, kn, kp, v, index, count[:, :0], 1.0)
    with pytest.raises(ValueError, match="key_index"):
        query_attention(qn, qp, kn, kp, v, index[0], count, 1.0)


@pytest.mark.gpu
def test_k3_dims_on_cuda():
    """K3's MLA (96 heads, nope 128, rope 64, v 128), bf16, 8 rows x 4 verify positions over ~1-2K keys: the spec's
    error, and every query alone (as decode runs it) equal to it in the verify call."""
    H, DN, DR, DV = 96, 128, 64, 128
    B, T, S = 8, 4, 2048
    qn, qp, kn, kp, v = _inputs(B, T, S, H, DN, DR, DV, torch.bfloat16, seed=4)
    past = torch.randint(900, S - T, (B,), generator=torch.Generator().manual_seed(5)).to(DEV)
    index, count = causal_key_index(past, T, S)
    out = query_attention(qn, qp, kn, kp, v, index, count, (DN + DR) ** -0.5)
    ref = naive_query_attention(qn[:2], qp[:2], kn[:2], kp[:2], v[:2], index[:2], count[:2], (DN + DR) ** -0.5)
    assert (out[:2].double() - ref).abs().max() <= 1e-4 * ref.abs().max()
    for b in range(B):
        for t in range(T):
            i1, c1 = causal_key_index(past[b:b + 1] + t, 1, S)
            one = query_attention(qn[b:b + 1, t:t + 1], qp[b:b + 1, t:t + 1], kn[b:b + 1], kp[b:b + 1], v[b:b + 1],
                                  i1, c1, (DN + DR) ** -0.5)
            assert torch.equal(one, out[b:b + 1, t:t + 1]), (b, t)
