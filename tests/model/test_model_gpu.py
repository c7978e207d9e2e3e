"""The model on CUDA runs the Triton kernels (KDA, AttnRes, norms, SiTU): same math as the CPU references."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_cuda_kernels_match_cpu_reference(make_tiny):
    cpu = make_tiny()
    gpu = make_tiny().cuda()
    ids = torch.randint(0, cpu.config.vocab_size, (2, 150))
    with torch.no_grad():
        ref = cpu(ids, use_cache=False).logits
        out = gpu(ids.cuda(), use_cache=False).logits.cpu()
    rel = (out - ref).norm() / ref.norm()
    assert rel < 5e-3, rel


def test_cuda_extend_splits_match_full_forward(make_tiny):
    model = make_tiny().cuda().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 150), device="cuda")
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        state, parts, start = None, [], 0
        for end in [1, 40, 64, 65, 100, 101, 102, 150]:
            logits, state = model.extend(ids[:, start:end], state)
            parts.append(logits)
            start = end
    rel = (torch.cat(parts, 1) - full).norm() / full.norm()
    assert rel < 5e-3, rel


def test_cuda_backward_finite_and_deterministic(make_tiny):
    model = make_tiny().cuda()
    ids = torch.randint(0, model.config.vocab_size, (2, 130), device="cuda")
    grads = []
    for _ in range(2):
        model.zero_grad()
        logits = model(ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert all(torch.isfinite(g).all() for g in grads[0].values())
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0]), "backward is not bitwise deterministic"
