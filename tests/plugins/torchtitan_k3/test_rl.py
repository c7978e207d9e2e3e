"""RL pieces of the TorchTitan plugin in process: LoRA (k3.lora) on the TorchTitan model with adapter-only files,
and GSPO (k3.rl) as a TorchTitan loss."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from k3.lora import LoRAConfig
from k3.model import K3ForCausalLM
from k3.rl import gspo_loss
from k3_torchtitan import model_registry
from k3_torchtitan.loss import GSPOLoss, RLBatch
from k3_torchtitan.lora import load_adapter, save_adapter


def _lora_model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = model_registry("k3_tiny").model
    cfg.lora = LoRAConfig.preset("tiny")
    with torch.device("meta"):
        model = cfg.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model


def test_lora_trains_only_the_adapter_and_saves_it_alone(tmp_path):
    model = _lora_model()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("lora.") for n in trainable)
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        before = model(ids)
        base = K3ForCausalLM.forward(model, ids, use_cache=False).logits
    assert torch.equal(before, base)  # B = 0 at creation: the adapter starts as a no-op
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(ids).float().logsumexp(-1).mean().backward()
        opt.step()
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    with torch.no_grad():
        after = model(ids)
    assert not torch.allclose(after, before)
    path = tmp_path / "adapter.safetensors"
    save_adapter(model, path)
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    assert keys and all(k.endswith((".lora_A", ".lora_B")) for k in keys)
    assert path.stat().st_size < 0.5 * sum(t.numel() * 4 for t in frozen.values())
    fresh = _lora_model()                      # same seed: the same base, a fresh adapter
    load_adapter(fresh, path)
    with torch.no_grad():
        assert torch.equal(fresh(ids), after)


def test_load_adapter_without_lora_names_the_field(tmp_path):
    model = model_registry("k3_tiny").model.build()
    with pytest.raises(ValueError, match="K3TitanModel.Config.lora"):
        load_adapter(model, tmp_path / "missing.safetensors")


def _rl_batch(logits, labels, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, T = labels.shape
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[:, T // 2:] = True
    with torch.no_grad():
        logp = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    old = logp + 0.01 * torch.randn(B, T, generator=g)
    return RLBatch(old_logp=old, advantages=torch.tensor([1.0, -0.5]), response_mask=mask)


def test_gspo_loss_is_k3_rl_gspo_on_the_label_log_probs():
    torch.manual_seed(0)
    model = model_registry("k3_tiny").model.build()
    model.init_weights()
    ids = torch.randint(0, 512, (2, 17))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    loss_fn = GSPOLoss.Config(eps_low=0.2, eps_high=0.28).build()
    logits = model(inputs)
    batch = _rl_batch(logits, labels)
    loss_fn.set_batch(batch)
    tokens = batch.response_mask.sum()
    ours, metrics = loss_fn(logits, labels, tokens)
    grads = torch.autograd.grad(ours, [model.lm_head.weight], retain_graph=True)[0]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    ref, ref_metrics = gspo_loss(logp, batch.old_logp, batch.advantages, batch.response_mask, 0.2, 0.28,
                                 agg="token-mean", num_tokens=tokens)
    assert torch.equal(ours, ref) and float(metrics["clip_frac"]) == ref_metrics["clip_frac"]
    assert torch.equal(grads, torch.autograd.grad(ref, [model.lm_head.weight])[0])
    # two data-parallel halves with the global token count sum to the whole batch's loss
    halves = []
    for rows in ([0], [1]):
        loss_fn.set_batch(RLBatch(batch.old_logp[rows], batch.advantages[rows], batch.response_mask[rows]))
        halves.append(loss_fn(logits[rows], labels[rows], tokens)[0])
    assert torch.allclose(halves[0] + halves[1], ours, rtol=1e-6, atol=1e-7)


def test_gspo_loss_errors_name_the_problem():
    loss_fn = GSPOLoss.Config().build()
    logits, labels = torch.zeros(2, 4, 8), torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="no RL batch set"):
        loss_fn(logits, labels)
    loss_fn.set_batch(RLBatch(torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool)))
    with pytest.raises(ValueError, match="old_logp"):
        loss_fn(logits, labels)
    with pytest.raises(TypeError, match="batch: expected an RLBatch"):
        loss_fn.set_batch({"old_logp": None})
