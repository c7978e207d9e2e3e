"""Speculative decoding in the engine (chain drafts, ReplaySSM commit): greedy outputs -- tokens, both log-prob
lists, routing -- bitwise those of plain decoding, with the prefix cache on and off, under tiny pools, across turns;
the committed KDA and conv states equal plain decoding's after every step; sampled log-probs are the target's for
the emitted tokens; bad settings are refused before any request runs; a failed verify harms no later call."""
import contextlib

import pytest
import torch

import k3.rollout.engine as engine_module
from k3.rollout import Engine, EngineConfig, RequestFailed, SamplingParams
from k3.rollout.spec import SpecConfig
from k3.rollout.spec.accept import sampling_logprobs
from k3.rollout.spec.scratch import scratch_bytes_per_sequence_layer
from k3.rollout.spec.tree import DraftTree, build_tree

from _engine_helpers import SMALL, TINY_POOLS, rand_tokens, same, workload


class OracleDrafter:
    """Drafts the reference continuation (plain decoding's own greedy output), corrupting one token of every
    `corrupt_every`-th draft, so verifies accept full drafts, partial drafts and nothing."""

    def __init__(self, references: list[list[int]], vocab: int, corrupt_every: int = 3):
        self.refs, self.vocab, self.calls, self.corrupt_every = references, vocab, 0, corrupt_every

    def propose(self, context: list[int], k: int) -> list[int]:
        self.calls += 1
        for ref in self.refs:
            if len(ref) > len(context) and ref[:len(context)] == context:
                cont = list(ref[len(context):len(context) + k])
                if self.calls % self.corrupt_every == 0 and cont:
                    j = self.calls % len(cont)
                    cont[j] = (cont[j] + 1) % self.vocab
                return cont
        return []


class OracleTreeDrafter(OracleDrafter):
    """Token trees around the reference continuation: a wrong sibling first at alternate depths (the walk has to
    take the second child), the reference itself corrupted in every third tree (rejections inside the tree)."""

    def propose_tree(self, context: list[int], branching: int, depth: int, max_nodes: int) -> DraftTree:
        ref = self.propose(context, depth)
        wrong = [(t + 3 + j) % self.vocab for j, t in enumerate(ref)]
        paths = []
        for d in range(len(ref)):   # at depth d + 1, a decoy child beside the reference one
            decoy = ref[:d] + [wrong[d]]
            paths += [decoy, ref] if (d + self.calls) % 2 else [ref, decoy]
        return build_tree(paths or [ref], branching, depth, max_nodes)


def _prompts():
    # repeated material (prompt lookup finds it) and plain random prompts, several lengths
    return [rand_tokens(20, 1) * 2, rand_tokens(13, 2), rand_tokens(37, 3), rand_tokens(9, 4) * 3, rand_tokens(26, 5)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=(7,))


def _turns(eng: Engine) -> list:
    """Two greedy turns: the completions of turn 1 continue with new user tokens."""
    out = eng.generate(_prompts(), GREEDY)
    nxt = [c.extend(rand_tokens(6 + i, 30 + i)) for i, c in enumerate(out)]
    return out + eng.generate(nxt, GREEDY)


def _spec_engine(model, references, prefix_cache=True, spec="ngram:3", corrupt_every=3, **kw):
    eng = Engine(model, prefix_cache=prefix_cache, speculative=spec, **{**SMALL, **kw})
    oracle = OracleDrafter if eng.cfg.speculative.branching == 1 else OracleTreeDrafter
    eng.spec.drafter = oracle(references, model.config.vocab_size, corrupt_every)
    eng.check_each_step = True
    return eng


def _record_states(eng: Engine) -> dict:
    """(request id, sample, position) -> (recurrent, conv) of every running sequence after every engine step."""
    seen = {}
    step = eng._step

    def wrapped():
        step()
        for s in eng.running:
            slot = eng.states.slot(s.state)
            seen[(s.req.rid, s.index, s.pos)] = (eng.states.dev["rec"][slot].clone(),
                                                 eng.states.dev["conv"][slot].clone())
    eng._step = wrapped
    return seen


@pytest.fixture(scope="module")
def plain(model):
    eng = Engine(model, prefix_cache=False, **SMALL)
    states = _record_states(eng)
    out = _turns(eng)
    refs = [list(c.prompt) + c.token_ids for c in out]
    return out, refs, states


@pytest.mark.parametrize("prefix_cache, spec", [(False, "ngram:3"), (True, "ngram:3"), (False, "ngram:2x3"),
                                               (True, "ngram:2x3"), (False, "ngram:3:batched"),
                                               (True, "ngram:3:batched"), (False, "ngram:2x3:batched"),
                                               (True, "ngram:2x3:batched")])
def test_greedy_chain_and_tree_are_bitwise_plain_decoding(model, plain, prefix_cache, spec):
    """Chains and 2x3 token trees (the reference continuation behind a decoy sibling at alternate depths), verified
    position by position; and verified in one [decode_batch, positions] forward (bitwise on CPU: every op gives a
    token the bits of a one-token call, tests/model/test_verify_shapes.py; a tree node attends query by query to
    the prefix and its ancestors)."""
    out, refs, plain_states = plain
    eng = _spec_engine(model, refs, prefix_cache=prefix_cache, spec=spec)
    states = _record_states(eng)
    got = _turns(eng)
    assert same(got, out)
    st = eng.stats
    # drafts were accepted in full, in part and not at all: more tokens than verifies
    assert st["spec_accepted_tokens"] > 0 and st["spec_draft_tokens"] > st["spec_accepted_tokens"]
    assert st["spec_emitted_tokens"] > 1.5 * st["spec_verifies"]
    # committed KDA recurrent and conv states after every step equal plain decoding's at the same position
    common = set(states) & set(plain_states)
    assert len(common) > 40
    for key in common:
        assert torch.equal(states[key][0], plain_states[key][0]), key
        assert torch.equal(states[key][1], plain_states[key][1]), key


@pytest.mark.parametrize("spec", ["ngram:7", "ngram:3x2", "ngram:7:batched", "ngram:3x2:batched"])
def test_greedy_chain_and_tree_under_tiny_pools_and_long_drafts(model, plain, spec):
    """Spills, restores and evictions around verify passes; draft length 7 crosses pages and checkpoints; a 3x2
    tree (rejected branches never reach the pages past the commit)."""
    out, refs, _ = plain
    eng = _spec_engine(model, refs, spec=spec, **TINY_POOLS)
    assert same(_turns(eng), out)
    assert eng.pages.stats["spills"] + eng.states.stats["spills"] > 0
    # ReplaySSM scratch is per running request of a verify (at most decode_batch rows x 8 positions), whatever
    # the pools hold
    per_row = scratch_bytes_per_sequence_layer(model.config, torch.float32, 8) * len(eng.kda_index)
    assert 0 < eng.stats["spec_scratch_bytes_max"] <= SMALL["decode_batch"] * per_row


def test_ngram_drafter_runs_in_the_engine(model, plain):
    out, _, _ = plain
    eng = Engine(model, prefix_cache=True, speculative=SpecConfig(draft_len=3), **SMALL)
    eng.check_each_step = True
    assert same(eng.generate(_prompts(), GREEDY), out[:len(_prompts())])
    assert eng.stats["spec_verifies"] > 0


def test_sampled_logprobs_are_the_targets(model, plain, monkeypatch):
    """Temperature > 0: force plain decoding to emit the spec run's tokens; both log-prob lists match bitwise."""
    _, refs, _ = plain
    sp = SamplingParams(temperature=0.02, top_k=50, top_p=0.95, seed=3, max_tokens=12, n=2)
    eng = _spec_engine(model, refs)
    got = eng.generate(_prompts(), sp)
    assert eng.stats["spec_accepted_tokens"] > 0
    forced = {(c.request_id, c.index): list(c.token_ids) for c in got}

    base = Engine(model, prefix_cache=False, **SMALL)

    def sample_next(s, logits, routing):
        tok = forced[(s.req.rid, s.index)][len(s.out_tokens)]
        full, logp = sampling_logprobs(logits, s.req.params)
        base._emit(s, tok, float(full[tok]), float(logp[tok]), routing)
    base._sample_next = sample_next
    ref = base.generate(_prompts(), sp)
    assert same(got, ref)


@pytest.mark.parametrize("spec", ["ngram:3:exact:match", "ngram:2x3:exact:match"])
def test_sampled_match_acceptance_is_bitwise_plain_decoding(model, spec):
    """MATCH acceptance draws as plain decoding draws: the branching multi-turn workload (n = 2, sampled turns,
    top-k/top-p) gives bitwise plain decoding's samples, log-probs and routing, with the prefix cache on."""
    ref = workload(Engine(model, prefix_cache=False, **SMALL), greedy=False)
    eng = _spec_engine(model, [list(c.prompt) + c.token_ids for c in ref], spec=spec)
    assert same(workload(eng, greedy=False), ref)
    assert eng.stats["spec_accepted_tokens"] > 0


def test_job_rollouts_unchanged_by_speculation(model):
    """`k3 rl --set rollout.speculative=ngram:3:exact:match`: the job's engine (k3.jobs.config.engine_config) gives
    the same episodes, rewards and rollout log-probs as without speculation."""
    from k3.envs import CalculatorEnv
    from k3.envs.calc_task import train_tasks
    from k3.jobs.config import engine_config, load_config
    from k3.jobs.episodes import run_episodes
    env, tasks = CalculatorEnv(), train_tasks(0, 2)
    runs = []
    for spec in ("off", "ngram:3:exact:match"):
        cfg = load_config(None, {"rollout.speculative": spec, "rollout.state_slots": 64, "rollout.kv_pages": 2048})
        eng = Engine(model, prefix_cache=True, config=engine_config(cfg))
        assert (eng.spec is None) == (spec == "off")
        rs = run_episodes(eng, env, tasks, 2, temperature=1.0, top_p=1.0, top_k=0, max_turn_tokens=8, seed=3)
        runs.append([(r.episode.tokens, r.reward, r.logprobs) for r in rs])
    assert runs[0] == runs[1]


def test_sampling_logprobs_mirror_the_sampler():
    g = torch.Generator().manual_seed(0)
    for i in range(20):
        logits = torch.randn(64, generator=g) * 3
        p = SamplingParams(temperature=0.5 + i * 0.05, top_k=[0, 10][i % 2], top_p=[1.0, 0.8][i // 10], seed=1)
        tok, lp, slp = engine_module.sample(logits, p, torch.Generator().manual_seed(i))
        full, logp = sampling_logprobs(logits, p)
        assert float(full[tok]) == lp and float(logp[tok]) == slp


@pytest.mark.parametrize("bad, field", [("ngram:0", "draft_len"), ("ngram:16", "draft_len"), ("tree:3", "method"),
                                        ("ngram:x", "draft length"), ("ngram:3:fast", "verify"),
                                        ("ngram:4x2", "a 4x2 token tree has 20 draft nodes"),
                                        ("ngram:2x4", "30 draft nodes"), ("ngram:0x3", "branching"),
                                        ("ngram:2x3x1", "tree shape"), ("ngram:2x0", "draft_len"),
                                        (SpecConfig(ngram_min=3, ngram_max=2), "ngram_min")])
def test_bad_settings_are_refused_before_any_request(model, bad, field):
    with pytest.raises(ValueError, match=field):
        Engine(model, speculative=bad, **SMALL)
    with pytest.raises(ValueError, match="speculative"):
        EngineConfig(speculative=3).validate()


def test_failed_verify_harms_no_later_call(model, plain, monkeypatch):
    out, refs, _ = plain
    eng = _spec_engine(model, refs)
    real = engine_module.SpecDecoder.step
    calls = {"n": 0}

    def flaky(self, group):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected verify failure")
        return real(self, group)
    monkeypatch.setattr(engine_module.SpecDecoder, "step", flaky)
    with pytest.raises(RequestFailed):
        eng.generate(_prompts(), GREEDY)
    eng.check()
    assert not eng.running
    assert same(_turns(eng), out)


def test_a_draft_outside_the_vocabulary_is_refused(model, plain):
    """The engine feeds its forwards ids it range-checked on the host (the model's own check reads them back: two
    device syncs a forward on CUDA), so a drafter's token outside the vocabulary must be refused before the verify
    runs: the request fails naming the drafter, nothing is left half-applied, the next call is plain decoding's."""
    out, refs, _ = plain

    class OutOfVocabulary:
        def propose(self, context, k):
            return [model.config.vocab_size] * k
    eng = _spec_engine(model, refs)
    good = eng.spec.drafter
    eng.spec.drafter = OutOfVocabulary()
    with pytest.raises(RequestFailed) as err:
        eng.generate(_prompts(), GREEDY)
    assert "drafter" in str(err.value) + str(err.value.__cause__) and "vocabulary" in str(err.value.__cause__)
    eng.check()
    assert not eng.running
    eng.spec.drafter = good
    assert same(_turns(eng), out)


@pytest.mark.gpu
@pytest.mark.parametrize("prefix_cache, spec", [(False, "ngram:3"), (True, "ngram:3"), (True, "ngram:2x3"),
                                                (False, "ngram:3:batched"), (True, "ngram:3:batched"),
                                                (True, "ngram:2x3:batched")])
def test_gpu_chain_and_tree_are_bitwise_plain_decoding(prefix_cache, spec):
    """On the GPU, one row per decode forward and several, exact walks and batched verifies (one [B, k+1] forward;
    a tree under its mask): tokens and log-probs bitwise plain decoding's. CUDA inference is batch invariant
    (k3.model.ops: the fixed-tile GEMM for every projection and the lm_head, the per-query MLA kernel, the conv's
    fixed-order taps; Triton decode / replay / tree-verify kernels for KDA, the MoE kernels). Before, cuBLAS, cuDNN
    and the batched attention einsums made CUDA decoding depend on the batch composition (up to 4.8e-7 in
    log-prob on the H200) and a batched verify only close to plain decoding."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    one = dict(decode_batch=1)
    out = Engine(model, prefix_cache=False, **{**SMALL, **one}).generate(_prompts(), GREEDY)
    refs = [list(c.prompt) + c.token_ids for c in out]
    eng = _spec_engine(model, refs, prefix_cache=prefix_cache, spec=spec, **one)
    assert same(eng.generate(_prompts(), GREEDY), out)
    assert eng.stats["spec_accepted_tokens"] > 0
    plain = _turns(Engine(model, prefix_cache=False, **SMALL))
    got = _turns(_spec_engine(model, [list(c.prompt) + c.token_ids for c in plain], prefix_cache=prefix_cache,
                              spec=spec))
    assert same(got, plain)
    assert same(plain[:len(out)], out)   # plain decoding: one row per forward == several rows per forward


@pytest.mark.parametrize("spec", ["ngram:3", "ngram:2x3"])
def test_multi_lora_rows_are_bitwise_plain_decoding(spec):
    """Mixed adapters in one decode group: every row verifies and commits under its own adapter."""
    from k3.config import K3Config
    from k3.lora import LoRAConfig, LoRAManager
    from k3.model import K3ForCausalLM
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    lora = LoRAManager(model)
    try:
        cfg = LoRAConfig(rank=4, alpha=8.0, targets=("attn", "mlp", "experts"), init_scale=0.05)
        lora.create("a", cfg, seed=1)
        lora.create("b", cfg, seed=2)
        prompts = _prompts()[:4]
        params = [SamplingParams(temperature=0.0, max_tokens=12, adapter_id=a) for a in ("a", None, "b", "a")]
        ref = Engine(model, prefix_cache=False, **SMALL).generate(prompts, params)
        eng = _spec_engine(model, [list(c.prompt) + c.token_ids for c in ref], spec=spec)
        assert same(eng.generate(prompts, params), ref)
        assert eng.stats["spec_accepted_tokens"] > 0
        assert len({tuple(c.token_ids) for c in ref[:3]}) == 3
    finally:
        lora.close()


@pytest.mark.parametrize("bad", ["ngram:0", "ngram:16", "tree:3", "ngram:3:fast", "ngram:3:exact:maybe", "ngram:4x2"])
def test_job_config_refuses_bad_speculative_settings(bad):
    from k3.jobs.config import JobConfigError, load_config
    with pytest.raises(JobConfigError, match="rollout.speculative"):
        load_config(None, {"rollout.speculative": bad})


@pytest.mark.parametrize("layers_per_fold", [16, 4])
def test_commit_with_the_layers_folded_together_is_the_per_layer_commit(model, monkeypatch, layers_per_fold):
    """CUDA commits with the KDA layers side by side (`commit._fold_layers_together`: one replay call for up to
    LAYERS_PER_FOLD layers' states, folded in place in the pool, one gather and one write of the windows, instead
    of a handful of launches per layer; K3 has 69 KDA layers). Under the same fold kernel -- the Triton fold, in the
    interpreter on CPU, whose programs each own one row, head and value block -- it must commit exactly what the
    per-layer commit does: the
    same tokens and log-probs over several steps (a state that differed would change every later logit), with
    accepted, partial and rejected drafts, the tiny model's 6 KDA layers in one group and in groups of 4 + 2."""
    import k3.rollout.spec.commit as commit_module
    import k3.rollout.spec.decode as decode
    from k3.model import ops
    from k3_kernels.replay_ssm.replay import replay_commit, replay_commit_into
    monkeypatch.setattr(ops, "kda_replay_commit", replay_commit)
    monkeypatch.setattr(ops, "kda_replay_commit_into", replay_commit_into)
    monkeypatch.setattr(commit_module, "LAYERS_PER_FOLD", layers_per_fold)
    prompts = [rand_tokens(14 + 3 * i, 900 + i) for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=10)
    refs = [p + c.token_ids for p, c in zip(prompts, Engine(model, prefix_cache=False, **SMALL).generate(prompts, sp))]
    per_commit = decode.commit
    outs, folds = [], []
    for fold in (False, True):
        def commit(*a, fold=fold):
            folds.append(fold)
            return per_commit(*a, fold_layers=fold)
        monkeypatch.setattr(decode, "commit", commit)
        eng = Engine(model, prefix_cache=False, speculative=SpecConfig(draft_len=3, verify="batched"), **SMALL)
        eng.spec.drafter = OracleDrafter(refs, model.config.vocab_size)
        outs.append(eng.generate(prompts, sp))
        assert eng.stats["spec_accepted_tokens"] > 0 and eng.stats["spec_accepted_tokens"] < eng.stats[
            "spec_draft_tokens"]
    assert True in folds and False in folds
    assert same(outs[0], outs[1])


@contextlib.contextmanager
def _cuda_composition():
    """The CUDA engine's KDA path on CPU: the fused step-inputs kernel in the Triton interpreter, commits with the
    layers folded together (the CPU fold)."""
    import k3.rollout.spec.decode as decode
    from k3.model import ops
    per_commit = decode.commit
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "KDA_STEP_KERNEL_ON_CPU", True)
        patch.setattr(decode, "commit", lambda *a: per_commit(*a, fold_layers=True))
        yield


COMPOSITION_GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def plain_under_composition(model):
    """Plain decoding of two prompts under `_cuda_composition` (once per module: the interpreter is slow)."""
    prompts = [rand_tokens(9 + 3 * i, 900 + i) for i in range(2)]
    with _cuda_composition():
        eng = Engine(model, prefix_cache=False, **SMALL)
        states = _record_states(eng)
        return prompts, eng.generate(prompts, COMPOSITION_GREEDY), states


@pytest.mark.parametrize("spec", ["ngram:3:batched", "ngram:2x3:batched"])
def test_cuda_composition_in_the_interpreter_is_bitwise_plain_decoding(model, plain_under_composition, spec):
    """The CPU counterpart of the CUDA engine's KDA path: the fused step-inputs kernel (Triton interpreter) for
    prefill, decode, the batched verify and the commit, which rebuilds every accepted position in one call and
    rolls the windows in it (`roll`), the layers folded together (the CPU fold: the Triton fold's bits are not the
    CPU decode's, only the GPU decode's). Spec decoding must give plain decoding's tokens, log-probs and committed
    states under that composition too, for a chain and a tree (every second draft corrupted, so that six tokens
    see accepted and rejected drafts)."""
    prompts, ref, plain_states = plain_under_composition
    with _cuda_composition():
        eng = _spec_engine(model, [p + c.token_ids for p, c in zip(prompts, ref)], prefix_cache=False, spec=spec,
                           corrupt_every=2)
        states = _record_states(eng)
        assert same(eng.generate(prompts, COMPOSITION_GREEDY), ref)
    assert 0 < eng.stats["spec_accepted_tokens"] < eng.stats["spec_draft_tokens"]
    common = set(states) & set(plain_states)
    assert len(common) >= 4
    for key in common:
        assert torch.equal(states[key][0], plain_states[key][0]), key
        assert torch.equal(states[key][1], plain_states[key][1]), key
