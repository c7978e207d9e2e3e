import torch

from k3.model import ops


def test_linear_rows_do_not_depend_on_the_batch():
    """A row's result is bitwise the same alone, in small batches and in large ones (decode vs prefill)."""
    torch.manual_seed(0)
    for k, n in [(128, 512), (64, 32), (32, 128), (128, 2)]:
        w = torch.randn(n, k)
        x = torch.randn(300, k)
        full = ops.linear(x, w)
        for start, m in [(0, 1), (3, 2), (10, 5), (7, 9), (50, 11), (100, 64), (17, 200)]:
            assert torch.equal(ops.linear(x[start:start + m], w), full[start:start + m]), (k, n, start, m)
        assert torch.equal(ops.linear(x.view(3, 100, k), w).view(300, n), full)


def test_training_forward_takes_the_plain_gemm_and_agrees_with_the_invariant_one():
    """Autograd-recorded forwards (SFT, the learner) use one plain GEMM; inference uses the row-block path."""
    torch.manual_seed(1)
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(40, 32)
    y = ops.linear(x, w)
    assert torch.equal(y, torch.nn.functional.linear(x, w))
    with torch.no_grad():
        torch.testing.assert_close(ops.linear(x, w), y.detach(), rtol=1e-5, atol=1e-6)
