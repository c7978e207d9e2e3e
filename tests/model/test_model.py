import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.model import K3ForCausalLM, count_parameters
from k3.model.adapter import CheckpointError


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny(seed=0, res_std=0.5, router_bias=True).eval()


@pytest.mark.parametrize("cuts", [
    [150],                          # one call
    [1, 2, 3, 150],                 # single-token steps at the start
    [63, 64, 65, 129, 150],         # around chunk boundaries
    [10, 37, 38, 100, 117, 150],    # splits inside a 64-token chunk
    list(range(100, 151)),          # prefill then 50 single-token decode steps
])
def test_extend_splits_match_full_forward(tiny, cuts):
    ids = torch.randint(0, tiny.config.vocab_size, (2, 150))
    with torch.no_grad():
        full = tiny(ids, use_cache=False).logits
        state, parts, start = None, [], 0
        for end in cuts:
            logits, state = tiny.extend(ids[:, start:end], state)
            parts.append(logits)
            start = end
    assert state.seq_len == 150
    diff = (torch.cat(parts, dim=1) - full).abs().max().item()
    assert diff <= 1e-4, diff


def test_clone_branches_independently(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (1, 40))
    a, b = torch.randint(0, tiny.config.vocab_size, (1, 5)), torch.randint(0, tiny.config.vocab_size, (1, 5))
    with torch.no_grad():
        _, root = tiny.extend(ids)
        la, _ = tiny.extend(a, root.clone())
        lb, _ = tiny.extend(b, root.clone())
        la2, _ = tiny.extend(a, root)  # root itself was not modified by the branches
        full_a = tiny(torch.cat([ids, a], 1), use_cache=False).logits[:, 40:]
        full_b = tiny(torch.cat([ids, b], 1), use_cache=False).logits[:, 40:]
    assert torch.equal(la, la2)
    assert (la - full_a).abs().max() < 1e-4 and (lb - full_b).abs().max() < 1e-4


def test_state_select_and_concat_roundtrip(tiny):
    from k3.model import K3State
    ids = torch.randint(0, tiny.config.vocab_size, (3, 20))
    nxt = torch.randint(0, tiny.config.vocab_size, (3, 1))
    with torch.no_grad():
        _, st = tiny.extend(ids)
        ref, _ = tiny.extend(nxt, st)
        parts = K3State.concat([st.select([2]), st.select([0, 1])])
        got, _ = tiny.extend(nxt[[2, 0, 1]], parts)
    assert (got - ref[[2, 0, 1]]).abs().max() < 1e-5


def test_routed_experts_record_and_replay(tiny):
    cfg = tiny.config
    ids = torch.randint(0, cfg.vocab_size, (2, 30))
    with torch.no_grad():
        out = tiny(ids, use_cache=False, return_routed_experts=True)
        r = out.routed_experts
        assert r.shape == (2, 30, len(cfg.moe_layer_ids), cfg.num_experts_per_token)
        assert r.min() >= 0 and r.max() < cfg.num_experts
        replay = tiny(ids, use_cache=False, routed_experts=r).logits
        assert torch.equal(replay, out.logits)
        forced = (r + 1) % cfg.num_experts  # a different expert set changes the output
        other = tiny(ids, use_cache=False, routed_experts=forced, return_routed_experts=True)
        assert torch.equal(other.routed_experts, forced)
        assert (other.logits - out.logits).abs().max() > 1e-4


def test_partial_replay_routes_free_rows(tiny):
    cfg = tiny.config
    ids = torch.randint(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ref = tiny(ids, use_cache=False, return_routed_experts=True)
        forced = ((ref.routed_experts + 1) % cfg.num_experts)
        forced[:, :10] = -1                      # first half free, second half replayed (shifted) experts
        out = tiny(ids, use_cache=False, routed_experts=forced, return_routed_experts=True)
    assert torch.equal(out.routed_experts[:, :10, 0], ref.routed_experts[:, :10, 0])   # layer 1 sees the same input
    assert torch.equal(out.routed_experts[:, 10:], forced[:, 10:])
    assert torch.equal(out.logits[:, :10], ref.logits[:, :10])
    bad = forced.clone(); bad[0, 12, 0, 0] = -1
    with pytest.raises(ValueError, match="all valid or all -1"):
        tiny(ids, use_cache=False, routed_experts=bad)


def test_routed_replay_recomputes_gate_weights_with_gradient(tiny):
    ids = torch.randint(0, tiny.config.vocab_size, (1, 12))
    with torch.no_grad():
        r = tiny(ids, use_cache=False, return_routed_experts=True).routed_experts
    tiny.zero_grad()
    tiny(ids, use_cache=False, routed_experts=r).logits.logsumexp(-1).mean().backward()
    router = tiny.model.layers[1].block_sparse_moe.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    tiny.zero_grad()


def test_bad_inputs_name_the_tensor(tiny):
    cfg = tiny.config
    with pytest.raises(ValueError, match="input_ids"):
        tiny(torch.tensor([[cfg.vocab_size]]))
    with pytest.raises(ValueError, match="input_ids"):
        tiny(torch.zeros(1, 0, dtype=torch.long))
    ids = torch.zeros(1, 4, dtype=torch.long)
    bad = torch.full((1, 4, len(cfg.moe_layer_ids), cfg.num_experts_per_token), cfg.num_experts)
    with pytest.raises(ValueError, match="routed_experts"):
        tiny(ids, routed_experts=bad)
    with pytest.raises(ValueError, match="routed_experts"):
        tiny(ids, routed_experts=bad[:, :2])
    _, st = tiny.extend(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="state"):
        tiny.extend(ids, st)


def test_backward_reaches_every_parameter(make_tiny):
    model = make_tiny(seed=1, res_std=0.1)
    ids = torch.randint(0, model.config.vocab_size, (2, 70))
    logits = model(ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    no_grad = [n for n, p in model.named_parameters()
               if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0) and ".experts." not in n]
    # layer 0's attention side reads the embedding directly (empty bank), as upstream: its mixer is unused
    assert no_grad == ["model.layers.0.self_attention_res_proj.weight",
                       "model.layers.0.self_attention_res_norm.weight"], no_grad
    assert model.model.layers[1].block_sparse_moe.experts.w1.grad.abs().sum() > 0


def test_checkpoint_names_match_upstream(tiny):
    names = set(tiny.state_dict())
    from k3.model.adapter import to_hf
    hf = set(to_hf(tiny.state_dict()))
    kda, mla, moe = "model.layers.0.self_attn.", "model.layers.3.self_attn.", "model.layers.1.block_sparse_moe."
    for n in ["q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj", "f_b_proj", "b_proj",
              "g_proj", "o_proj", "o_norm"]:
        assert kda + n + ".weight" in names, n
    assert kda + "A_log" in names and kda + "dt_bias" in names
    for n in ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj",
              "g_proj"]:
        assert mla + n + ".weight" in names, n
    for n in ["gate.weight", "gate.e_score_correction_bias", "experts.0.w1.weight", "experts.7.w2.weight",
              "experts.3.w3.weight", "shared_experts.gate_proj.weight", "routed_expert_down_proj.weight",
              "routed_expert_norm.weight", "routed_expert_up_proj.weight"]:
        assert moe + n in hf, n
    for n in ["model.layers.0.mlp.gate_proj.weight", "model.layers.5.self_attention_res_proj.weight",
              "model.layers.5.mlp_res_norm.weight", "model.output_attn_res_proj.weight", "model.norm.weight",
              "model.embed_tokens.weight", "lm_head.weight"]:
        assert n in hf, n


def test_save_load_bit_exact_and_strict(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    loaded = K3ForCausalLM.from_pretrained(tmp_path)
    a, b = tiny.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    hf = load_file(str(tmp_path / "model.safetensors"))
    hf.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight")
    hf.pop("model.norm.weight")
    hf["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    hf["model.extra.weight"] = torch.zeros(1)
    save_file(hf, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        K3ForCausalLM.from_pretrained(tmp_path)
    msg = str(e.value)
    for part in ["experts.{5}.w3", "missing: model.norm.weight", "q_proj.weight", "unexpected: model.extra.weight"]:
        assert part in msg, (part, msg)


def test_multimodal_checkpoint_layout_loads(tiny, tmp_path):
    """The published kimi_k3 layout: `language_model.` prefix, `mlp` for MoE blocks, vision weights, Kimi Linear's
    [1, 1, H, 1] A_log (K3's 128-for-96 A_log quirk: tests/model/test_checkpoint.py)."""
    from k3.model.adapter import from_hf, to_hf
    hf = {}
    for k, v in to_hf(tiny.state_dict()).items():
        k = k.replace("block_sparse_moe", "mlp")
        k = "language_model." + (k[len("model."):] if k.startswith("model.layers.") else k)
        if k.endswith("self_attn.A_log"):
            v = v.view(1, 1, -1, 1)
        hf[k] = v
    hf["vision_tower.patch_embed.weight"] = torch.zeros(2)
    state = from_hf(hf, tiny.state_dict())
    assert all(torch.equal(state[k], v) for k, v in tiny.state_dict().items())


def test_full_k3_builds_on_meta_quickly():
    t = time.perf_counter()
    counts = count_parameters(K3Config.preset("k3"))
    assert time.perf_counter() - t < 30
    assert counts["total"] > counts["active"] > 0
