"""Multi-session compute: rows of several sessions (different ranks, losses and lengths) in one forward/backward
give every session exactly (bitwise) the log-probs, losses and gradients of running that session alone."""
import pytest
import torch

from k3.config import K3Config
from k3.lora import LoRAConfig, LoRAManager
from k3.model import K3ForCausalLM
from k3.serverless.compute import Work, bucket_len, prompt_logprobs, run_packed
from k3.serverless.losses import LossConfig, session_loss

from _serverless_helpers import rand_datum

BUCKET = 32


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    model.requires_grad_(False)
    lora = LoRAManager(model)
    for name, rank, seed in (("a", 4, 1), ("b", 8, 2), ("c", 16, 3)):
        ad = lora.create(name, LoRAConfig(rank=rank, alpha=16.0, init_scale=0.02), seed=seed)
        ad.requires_grad_(True)
    yield model, lora
    lora.close()


LOSSES = {"a": "cross_entropy", "b": "gspo", "c": "ppo"}


def _works():
    # lengths straddle bucket boundaries (several buckets per session)
    return [Work(n, [rand_datum(10 * i + j, loss_fn=LOSSES[n]) for j in range(3 + i)], LOSSES[n], LossConfig())
            for i, n in enumerate(("a", "b", "c"))]


def _run(model, lora, works):
    for ad in lora.adapters.values():
        ad.zero_grad(set_to_none=True)
    res = run_packed(model, lora, works, bucket=BUCKET, backward=True)
    grads = {w.adapter: [p.grad.clone() for p in lora.adapters[w.adapter].parameters()] for w in works}
    return res, grads


def test_mixed_call_equals_each_session_alone(base):
    model, lora = base
    works = _works()
    assert len({bucket_len(d.model_input.length, BUCKET) for w in works for d in w.data}) >= 2
    mixed, mixed_grads = _run(model, lora, works)
    for i, w in enumerate(works):
        alone, alone_grads = _run(model, lora, [w])
        assert alone[0].logprobs == mixed[i].logprobs, w.adapter
        assert alone[0].metrics == mixed[i].metrics, w.adapter
        assert all(torch.equal(x, y) for x, y in zip(alone_grads[w.adapter], mixed_grads[w.adapter])), w.adapter
        assert any(bool(g.abs().sum() > 0) for g in alone_grads[w.adapter])   # there is a gradient at all


def test_sessions_do_not_leak_into_each_other(base):
    """Changing one session's adapter changes only that session's results."""
    model, lora = base
    works = _works()
    before, _ = _run(model, lora, works)
    b = lora.adapters["b"]
    saved = [p.detach().clone() for p in b.parameters()]
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.05)
    try:
        after, _ = _run(model, lora, works)
    finally:
        with torch.no_grad():
            for p, s in zip(b.parameters(), saved):
                p.copy_(s)
    assert before[0].logprobs == after[0].logprobs and before[2].logprobs == after[2].logprobs
    assert before[1].logprobs != after[1].logprobs


def test_logprobs_match_the_training_forward_and_the_model(base):
    model, lora = base
    d = rand_datum(5, n=40)
    toks = list(d.model_input.tokens) + [d.loss_fn_inputs["target_tokens"][-1]]
    got = prompt_logprobs(model, lora, [("a", toks), ("b", toks[:20]), (None, toks)], bucket=BUCKET)
    assert got[0][0] is None and len(got[0]) == len(toks) and len(got[1]) == 20
    with torch.no_grad(), lora.use("a"):
        logits = model(torch.tensor([toks]), use_cache=False).logits[0].float()
    ref = (logits[:-1].gather(-1, torch.tensor(toks[1:])[:, None])[:, 0] - torch.logsumexp(logits[:-1], -1))
    assert torch.allclose(torch.tensor(got[0][1:]), ref, atol=1e-5)
    assert got[0] != got[2]   # the adapter is applied (and None is the base)
    fwd = run_packed(model, lora, [Work("a", [d], "cross_entropy")], bucket=BUCKET, backward=False)[0]
    assert torch.allclose(torch.tensor(fwd.logprobs[0]), torch.tensor(got[0][1:]), atol=1e-5)


def test_losses_follow_their_definitions():
    torch.manual_seed(1)
    lp = -torch.rand(2, 6) * 3
    old = lp + 0.1 * torch.randn(2, 6)
    adv = torch.randn(2, 6)
    w = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]], dtype=torch.float32)
    inputs = {"weights": w, "logprobs": old, "advantages": adv}
    ce, _ = session_loss("cross_entropy", lp, inputs, LossConfig())
    assert torch.allclose(ce, -(w * lp).sum())
    is_, _ = session_loss("importance_sampling", lp, inputs, LossConfig())
    assert torch.allclose(is_, -(w * torch.exp(lp - old) * adv).sum())
    ppo, _ = session_loss("ppo", lp, inputs, LossConfig(clip_low=0.05, clip_high=0.05))
    r = torch.exp(lp - old)
    assert torch.allclose(ppo, -(w * torch.minimum(r * adv, r.clamp(0.95, 1.05) * adv)).sum())
    # gspo: at lp == old every ratio is 1 (inside the clip): loss = -sum_t A_t over kept tokens
    g, _ = session_loss("gspo", old.clone(), inputs, LossConfig())
    assert torch.allclose(g, -(w * adv).sum(), atol=1e-6)
    with pytest.raises(ValueError, match="loss_fn"):
        session_loss("dpo", lp, inputs, LossConfig())
