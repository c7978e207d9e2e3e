"""k3_kernels.sampling.greedy_pick: the engine's greedy token and its log-prob on the device. Why it exists: the
engine copied each row's whole logits to the host and ran argmax and log-softmax there (~1 ms a row at K3's
vocabulary, the decode step's main per-row cost on the GPU). A row's pick must be the spec's (first maximum, the
log-softmax value within fp32 rounding) and must not depend on the other rows of the call, or speculative verifies
(rows stacked by depth) would report other log-probs than plain decoding. Interpreter on CPU; the `gpu` test
repeats it at K3's vocabulary."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from k3_kernels.sampling import greedy_pick, naive_greedy_pick  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(x):
    tok, lp = greedy_pick(x)
    rtok, rlp = naive_greedy_pick(x)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(tok.cpu(), rtok.cpu())
    assert (lp.double() - rlp).abs().max() <= 1e-5 * (1 + rlp.abs().max())
    return tok, lp


@pytest.mark.parametrize("V", [1, 7, 2048, 5000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_spec(V, dtype):
    """Vocabularies inside one block, at a block edge and across several blocks with a ragged tail."""
    g = torch.Generator().manual_seed(V)
    _check((3 * torch.randn(4, V, generator=g)).to(DEV, dtype))


def test_ties_pick_the_first_maximum_across_blocks():
    """The maximum repeated in a later block (and within a block): the first index wins, as torch.argmax's."""
    x = torch.zeros(3, 5000)
    x[0, [4100, 10, 2500]] = 2.0
    x[1, [2047, 2048]] = 1.0
    x[2] = -1.0
    tok, _ = _check(x.to(DEV))
    assert tok.tolist() == [10, 2047, 0]


def test_a_row_alone_equals_it_among_others():
    """Bitwise: a row picked alone, among 7 others, at another position of the call, or read from a strided view."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3000, generator=g).to(DEV, torch.bfloat16)
    tok, lp = greedy_pick(x)
    for r in range(8):
        t1, l1 = greedy_pick(x[r:r + 1])
        assert t1.item() == tok[r].item() and torch.equal(l1, lp[r:r + 1])
    wide = torch.randn(8, 2, 3000, generator=g).to(DEV, torch.bfloat16)
    wide[:, 1] = x.flip(0)
    t2, l2 = greedy_pick(wide[:, 1])
    assert torch.equal(t2.flip(0), tok) and torch.equal(l2.flip(0), lp)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="logits"):
        greedy_pick(torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="logits"):
        greedy_pick(torch.zeros(2, 4, dtype=torch.int32, device=DEV))


@pytest.mark.gpu
def test_gpu_k3_vocabulary():
    """K3's vocabulary (163,840) at the decode batches, bf16 logits as the lm_head gives them."""
    g = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(32, 163840, generator=g)).to("cuda", torch.bfloat16)
    tok, lp = _check(x)
    for r in (0, 5, 31):
        t1, l1 = greedy_pick(x[r:r + 1])
        assert t1.item() == tok[r].item() and torch.equal(l1, lp[r:r + 1])
