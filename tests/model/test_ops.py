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


def test_training_forward_is_the_inference_bits_and_its_gradients_are_right():
    """Training forwards take the inference path's row blocks (the learner's log-probs are the rollout's bits, on any
    CPU: Zen 4's plain GEMM differs from its row-block bmm); the input gradient is row-invariant too (a packed
    multi-session backward gives each session its bits alone) and both gradients match plain autograd."""
    torch.manual_seed(1)
    w = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(40, 32, requires_grad=True)
    y = ops.linear(x, w)
    with torch.no_grad():
        assert torch.equal(y, ops.linear(x, w))
    g = torch.randn(40, 64)
    dx, dw = torch.autograd.grad(y, (x, w), g)
    rx, rw = torch.autograd.grad(torch.nn.functional.linear(x, w), (x, w), g)
    torch.testing.assert_close(dx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, rw, rtol=1e-5, atol=1e-5)
    part = x[5:12].detach().requires_grad_()
    (dpart,) = torch.autograd.grad(ops.linear(part, w), (part,), g[5:12])
    assert torch.equal(dpart, dx[5:12])
    frozen = w.detach()   # a frozen base under a trained input (LoRA): the same path
    assert torch.equal(ops.linear(x, frozen), y.detach())
