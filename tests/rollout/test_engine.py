"""Engine: cache on == cache off bitwise (greedy and seeded sampling) on a branching multi-turn workload, also
under pools so small that spills and evictions happen all the time; batch invariance; zero recompute at turn
resumes; scoping by (adapter, version); log-probs and routing against the reference forward; bad input."""
import pytest
import torch

from k3.rollout import Engine, Prompt, SamplingParams

from _engine_helpers import SMALL, TINY_POOLS, rand_tokens, same, workload



@pytest.mark.parametrize("greedy", [True, False])
def test_cache_on_equals_cache_off_bitwise(model, greedy):
    off = workload(Engine(model, prefix_cache=False, **SMALL), greedy)
    eng = Engine(model, prefix_cache=True, **SMALL)
    eng.check_each_step = True
    on = workload(eng, greedy)
    assert same(on, off)
    st = eng.cache_stats()
    assert st["hit_tokens"] > 0 and st["resume_recomputed_tokens"] == 0
    if greedy:
        return
    tiny = Engine(model, prefix_cache=True, **TINY_POOLS, **SMALL)
    tiny.check_each_step = True
    assert same(workload(tiny, greedy), off)
    st = tiny.cache_stats()
    assert st["mla_pages_spills"] > 0 and st["kda_states_spills"] > 0 and st["tree_state_drops"] > 0
    assert st["mla_pages_restores"] > 0 and st["kda_states_restores"] > 0 and st["tree_node_evictions"] > 0


def test_turn_resume_recomputes_nothing(model):
    eng = Engine(model, prefix_cache=True, **SMALL)
    c = eng.generate([rand_tokens(37, 4)], SamplingParams(temperature=0.0, max_tokens=9))[0]
    before = eng.cache_stats()["computed_tokens"]
    nxt = c.extend(rand_tokens(6, 5))
    c2 = eng.generate([nxt], SamplingParams(temperature=0.0, max_tokens=3))[0]
    st = eng.cache_stats()
    assert c2.hit_tokens == nxt.parent_len == 37 + 9 - 1
    assert st["resume_recomputed_tokens"] == 0 and st["resumes"] == 1
    # computed: the 7 new prefill tokens and 2 decode steps
    assert st["computed_tokens"] - before == 7 + 2


def test_n_samples_share_the_prompt_and_full_hits(model):
    eng = Engine(model, prefix_cache=True, **SMALL)
    p = rand_tokens(30, 6)
    out = eng.generate([p], SamplingParams(temperature=1.0, seed=3, max_tokens=4, n=3))
    assert len(out) == 3 and [c.index for c in out] == [0, 1, 2]
    assert eng.cache_stats()["computed_tokens"] == 30 + 3 * 3
    again = eng.generate([p], SamplingParams(temperature=1.0, seed=3, max_tokens=4, n=3))
    assert [c.token_ids for c in again] == [c.token_ids for c in out]
    assert again[0].hit_tokens == 30     # the prompt end was checkpointed with its logits


def test_batch_invariance(model):
    p = rand_tokens(45, 7)
    sp = SamplingParams(temperature=1.0, seed=1, max_tokens=8)
    alone = Engine(model, prefix_cache=False, **SMALL).generate([p], sp)[0]
    others = [rand_tokens(n, 8 + n) for n in (5, 60, 17, 33, 2)]
    mixed = Engine(model, prefix_cache=False, **SMALL).generate(others[:2] + [p] + others[2:], sp)[2]
    assert alone.token_ids == mixed.token_ids and alone.logprobs == mixed.logprobs


def test_logprobs_and_routing_match_reference_forward(model):
    eng = Engine(model, prefix_cache=True, **SMALL)
    p = rand_tokens(20, 9)
    c = eng.generate([p], SamplingParams(temperature=0.7, seed=2, max_tokens=5))[0]
    ids = torch.tensor([p + c.token_ids])
    with torch.no_grad():
        out = model(ids, return_routed_experts=True, use_cache=False)
    logp = torch.log_softmax(out.logits[0].float(), -1)
    want = [float(logp[len(p) - 1 + i, t]) for i, t in enumerate(c.token_ids)]
    assert max(abs(a - b) for a, b in zip(c.logprobs, want)) < 1e-4
    assert c.sampling_logprobs != c.logprobs    # tempered distribution reported separately
    cfg = model.config
    assert c.routed_experts.shape == (5, len(cfg.moe_layer_ids), cfg.num_experts_per_token)
    ref = out.routed_experts[0, len(p) - 1:len(p) + 4]
    assert (c.routed_experts.long() == ref).float().mean() > 0.95


def test_stop_tokens_and_lengths(model):
    eng = Engine(model, prefix_cache=False, **SMALL)
    p = rand_tokens(12, 10)
    free = eng.generate([p], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    stop = free.token_ids[2]
    c = eng.generate([p], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop,)))[0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


def test_scoping_by_version(model):
    """A weight update moves to a new cache scope (adapter scoping: test_engine_lora.py)."""
    eng = Engine(model, prefix_cache=True, **SMALL)
    p = rand_tokens(33, 11)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    eng.generate([p], sp)
    assert eng.generate([p], sp)[0].hit_tokens == 33
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        eng.update_weights({"lm_head.weight": state["lm_head.weight"] * 1.5}, version=1)
        c = eng.generate([p], sp)[0]
        assert c.hit_tokens == 0 and c.policy_version == 1
        assert all(s[1] == 1 for s in eng.tree.roots)     # old-version entries released
        ref = Engine(model, prefix_cache=False, **SMALL).generate([p], sp)[0]
        assert ref.logprobs == c.logprobs
    finally:
        model.load_state_dict(state)


def test_bad_input(model):
    eng = Engine(model, prefix_cache=True, **SMALL)
    with pytest.raises(ValueError, match="prompts\\[0\\]"):
        eng.generate([[1, 2, 10**6]], SamplingParams())
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="sampling.top_p"):
        eng.generate([[1, 2]], SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="device_pages"):
        eng.generate([[1] * 50], SamplingParams(max_tokens=10**5))
    with pytest.raises(ValueError, match="checkpoint_interval"):
        Engine(model, chunk_size=16, checkpoint_interval=40)
    with pytest.raises(ValueError, match="state_dict"):
        eng.update_weights({"nope": torch.zeros(1)}, version=3)
    with pytest.raises(ValueError, match="spans"):
        eng.generate([Prompt([1, 2, 3], [(2, "prefill"), (1, "decode")])], SamplingParams())
    assert eng.version == 0


def test_weight_payload_through_k3_sync_receiver(model):
    from k3.model import K3ForCausalLM
    from k3.sync import WeightReceiver, encode_delta
    serving = K3ForCausalLM(model.config, init=False).eval()
    serving.load_state_dict(model.state_dict())
    eng = Engine(serving, prefix_cache=True, **SMALL)
    p = rand_tokens(20, 12)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    eng.generate([p], sp)
    base = {k: v.detach().clone() for k, v in serving.state_dict().items()}
    new = dict(base, **{"lm_head.weight": base["lm_head.weight"] * 1.5})
    receiver = WeightReceiver(serving.state_dict(), 0)
    assert eng.apply_weight_payload(receiver, encode_delta(base, new, 0, 1)) == 1
    c = eng.generate([p], sp)[0]
    assert c.policy_version == 1 and c.hit_tokens == 0
    fresh = K3ForCausalLM(model.config, init=False).eval()
    fresh.load_state_dict(new)
    assert Engine(fresh, prefix_cache=False, **SMALL).generate([p], sp)[0].logprobs == c.logprobs


def test_batched_prefill_is_batch_invariant_and_runs_fewer_forwards(model):
    """prefill_batch > 1 runs prefill segments at the same position and length together in forwards of that many
    rows (many prompts arriving at once: the serverless service's merged sample rounds). A segment's shapes are
    then fixed by itself and the setting, so its bits do not depend on its companions or on the cache (they may
    differ from prefill_batch = 1: another shape); and there are fewer forwards, which is the point (on the GPU a
    forward's host cost is what a step pays)."""
    batched = dict(SMALL, prefill_batch=4)
    eng = Engine(model, prefix_cache=True, **batched)
    eng.check_each_step = True
    assert same(workload(eng, greedy=False), workload(Engine(model, prefix_cache=False, **batched), greedy=False))
    one = Engine(model, prefix_cache=True, **SMALL)
    workload(one, greedy=False)
    assert eng.cache_stats()["forwards"] < one.cache_stats()["forwards"]
    # many prompts at once, several of one length (their chunks share forwards): alone == among them
    sp = SamplingParams(temperature=1.0, seed=2, max_tokens=5)
    prompts = [rand_tokens(n, 30 + i) for i, n in enumerate((40, 40, 40, 23, 40, 7, 40))]
    mixed = Engine(model, prefix_cache=False, **batched).generate(prompts, sp)
    for i in (0, 3, 6):
        alone = Engine(model, prefix_cache=False, **batched).generate([prompts[i]], sp)[0]
        assert mixed[i].token_ids == alone.token_ids and mixed[i].logprobs == alone.logprobs, i
    with pytest.raises(ValueError, match="prefill_batch"):
        Engine(model, prefill_batch=0)


@pytest.mark.gpu
def test_gpu_batched_prefill_is_batch_invariant():
    """The CUDA half of the batched-prefill check: one row per decode forward (decode_batch 1, whose outputs are
    bitwise on CUDA, test_spec_engine.py), prefill in forwards of 4 rows: a prompt's completion is bitwise the same
    alone and among others whose chunks share its forwards. It rests on a fixed-shape GEMM giving a row the same
    bits wherever it sits (the serverless service's merged sample rounds need it)."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    torch.manual_seed(0)
    cuda_model = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    cfg = dict(SMALL, decode_batch=1, prefill_batch=4)
    sp = SamplingParams(temperature=1.0, seed=2, max_tokens=5)
    prompts = [rand_tokens(n, 30 + i) for i, n in enumerate((40, 40, 40, 23, 40, 7, 40))]
    eng = Engine(cuda_model, prefix_cache=False, **cfg)
    mixed = eng.generate(prompts, sp)
    one = Engine(cuda_model, prefix_cache=False, **dict(cfg, prefill_batch=1))
    one.generate(prompts, sp)
    assert eng.cache_stats()["forwards"] < one.cache_stats()["forwards"]
    for i in (0, 2, 3, 6):
        alone = Engine(cuda_model, prefix_cache=False, **cfg).generate([prompts[i]], sp)[0]
        assert mixed[i].token_ids == alone.token_ids and mixed[i].logprobs == alone.logprobs, i
