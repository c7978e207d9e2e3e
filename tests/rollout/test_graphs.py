"""Decode steps as CUDA graphs (k3.rollout.graphs): the fixed-shape forward over `StaticView` -- indices in one
device buffer, idle seats on the pools' spare page and state, the key length a power-of-two page table -- must give
bitwise what the eager `PoolView` forward gives, or replaying it would change rollouts. On CPU the same forward
runs eagerly (`capture=False`): that checks the view's indexing everywhere CI runs; the `gpu` test captures and
replays."""
import pytest
import torch

from k3.lora import LoRAConfig
from k3.rollout import Engine, EngineConfig, SamplingParams
from k3.rollout.graphs import DecodeGraphs, StaticView, page_bucket
from k3.rollout.pools import TieredPool

from _engine_helpers import SMALL, TINY_POOLS, lora_served, rand_tokens, same, workload


def _static_engine(model, **kw) -> Engine:
    eng = Engine(model, **kw)
    eng.graphs = DecodeGraphs(eng, capture=False)
    return eng


@pytest.mark.parametrize("prefix_cache, greedy, pools", [(False, True, {}), (True, True, TINY_POOLS),
                                                         (True, False, TINY_POOLS)])
def test_static_view_decode_is_the_eager_decode(model, prefix_cache, greedy, pools):
    """Multi-turn branching workload (greedy and sampled; prefix cache with pools small enough to spill, restore
    and evict): tokens, both log-prob lists and routing bitwise the eager engine's, over several page-table
    widths, with idle seats in most steps; the pools' accounting never sees the spare slots."""
    ref = workload(Engine(model, prefix_cache=prefix_cache, **SMALL, **pools), greedy)
    eng = _static_engine(model, prefix_cache=prefix_cache, **SMALL, **pools)
    eng.check_each_step = True
    assert same(workload(eng, greedy), ref)
    assert eng.graphs.stats["replays"] > 10
    assert len({k.pages for k in eng.graphs.shapes}) >= 2   # several page-table widths were used
    eng.check()


@pytest.mark.parametrize("spec", ["ngram:3:batched", "ngram:2x3:batched", "ngram:3x2:batched"])
def test_static_verify_is_the_eager_verify(model, spec):
    """Speculative decoding with the batched chain verify over `StaticVerifyView` (fixed seats and width, the
    step inputs into the shared scratch, the committed states only read), token trees over `StaticTreeView`
    (parents, ancestor mask, conv-window columns and the KDA kernel's node paths in a static buffer), and the
    commit as one fold over every seat (`DecodeGraphs.commit`, idle seats on the spare state): bitwise plain
    decoding, turns and branches, prefix cache on with tiny pools."""
    from test_spec_engine import GREEDY, _prompts, _spec_engine, _turns
    plain = Engine(model, prefix_cache=False, **SMALL)
    ref = plain.generate(_prompts(), GREEDY)
    ref_turns = _turns(Engine(model, prefix_cache=False, **SMALL))
    refs = [list(c.prompt) + c.token_ids for c in ref + ref_turns]
    eng = _spec_engine(model, refs, prefix_cache=True, spec=spec, **TINY_POOLS)
    eng.graphs = DecodeGraphs(eng, capture=False, trees=True)
    assert same(eng.generate(_prompts(), GREEDY), ref)
    assert same(_turns(eng), ref_turns)
    assert eng.stats["spec_accepted_tokens"] > 0
    verifies = [k for k in eng.graphs.shapes if k.verify]
    assert any(k.tokens > 1 for k in verifies) and not any(k.features for k in verifies)
    assert any(k.tree for k in verifies) == (spec != "ngram:3:batched")
    assert {c.verify for c in eng.graphs.commits} <= set(verifies) and eng.graphs.commits   # commits captured
    eng.check()


@pytest.mark.parametrize("overlap", [False, True])
def test_verify_prepared_while_the_head_drafts(model, overlap):
    """Chains of the trained head: the verify's pages and packed indices are prepared before the drafts are
    read (`DecodeGraphs.prepare_verify`, at 1 + the longest draft limit), the verify then writes only the ids
    (rows whose chain is shorter, e.g. near their token budget, padded to that width): bitwise plain decoding,
    with and without pre-drafting, and the prepared pack is what the verifies used."""
    from k3.rollout.spec import SpecConfig
    from k3.rollout.spec.drafter import DraftHead, TrainedDrafter
    from test_spec_engine import GREEDY, _prompts
    torch.manual_seed(0)
    ref = Engine(model, prefix_cache=False, **SMALL).generate(_prompts(), GREEDY)
    eng = Engine(model, prefix_cache=True, speculative=SpecConfig(draft_len=3, verify="batched"), **SMALL)
    head = DraftHead(model.config.hidden_size)
    eng.spec.drafter = TrainedDrafter(head, model, draft_vocab=sorted({t for c in ref for t in c.token_ids}))
    eng.spec.drafter.capture_graphs(capture=False)
    eng.spec.overlap_drafting = overlap
    eng.graphs = DecodeGraphs(eng, capture=False)
    calls, verify = [], eng.graphs.verify
    eng.graphs.verify = lambda *a, **kw: calls.append(1) or verify(*a, **kw)
    eng.check_each_step = True
    assert same(eng.generate(_prompts(), GREEDY), ref)
    verifies = [k for k in eng.graphs.shapes if k.verify]
    assert verifies and all(k.features for k in verifies)
    assert eng.graphs.stats["prepared_verifies"] == len(calls) > 0   # every verify was prepared
    assert (eng.stats["spec_predrafted"] > 0) == overlap
    eng.check()


def test_a_failed_step_after_the_prepared_verify_leaves_nothing_behind(model):
    """A head draft refused after the verify was prepared (pages allocated, indices packed): the request fails
    naming the drafter, the pools' accounting holds, and the next call on the same engine -- same shapes, same
    rows' positions -- is plain decoding's bits (the stale pack is never replayed)."""
    from k3.rollout import RequestFailed
    from k3.rollout.spec import SpecConfig
    from k3.rollout.spec.drafter import DraftHead, TrainedDrafter
    from test_spec_engine import GREEDY, _prompts
    torch.manual_seed(0)
    ref = Engine(model, prefix_cache=False, **SMALL).generate(_prompts(), GREEDY)
    eng = Engine(model, prefix_cache=True, speculative=SpecConfig(draft_len=3, verify="batched"), **SMALL)
    drafter = TrainedDrafter(DraftHead(model.config.hidden_size), model,
                             draft_vocab=sorted({t for c in ref for t in c.token_ids}))
    drafter.capture_graphs(capture=False)
    eng.spec.drafter = drafter
    eng.graphs = DecodeGraphs(eng, capture=False)
    launch, calls = drafter.launch_chains, []

    def bad_third(feats, last, steps):
        calls.append(1)
        drafts = launch(feats, last, steps)
        return drafts + model.config.vocab_size if len(calls) == 3 else drafts
    drafter.launch_chains = bad_third
    with pytest.raises(RequestFailed) as err:
        eng.generate(_prompts(), GREEDY)
    assert "drafter" in str(err.value.__cause__) and "vocabulary" in str(err.value.__cause__)
    assert eng.graphs._prepared is not None   # prepared, never replayed
    eng.check()
    assert not eng.running
    drafter.launch_chains = launch
    assert same(eng.generate(_prompts(), GREEDY), ref)
    eng.check()


ADAPTER_CONFIGS = {"a": LoRAConfig(rank=4, alpha=8.0, init_scale=0.05),
                   "b": LoRAConfig(rank=2, alpha=4.0, init_scale=0.05)}


@pytest.fixture(scope="module")
def served():
    """A tiny model with two adapters of different ranks on the default targets (attention and dense MLPs)."""
    model, lora = lora_served(ADAPTER_CONFIGS)
    yield model, lora
    lora.close()


ADAPTERS = ["a", None, "b", "a", "b", None]


def _adapter_turns(eng: Engine, greedy: bool = True, max_tokens: int = 7) -> list:
    """Rows of adapters a, b and the base side by side, two turns, then a batch of base rows only."""
    prompts = [rand_tokens(9 + 4 * i, 60 + i) for i in range(len(ADAPTERS))]
    params = [SamplingParams(temperature=0.0 if greedy else 0.9, seed=70 + i, max_tokens=max_tokens, adapter_id=a)
              for i, a in enumerate(ADAPTERS)]
    out = eng.generate(prompts, params)
    out += eng.generate([c.extend(rand_tokens(5, 90 + i)) for i, c in enumerate(out)], params)
    return out + eng.generate(prompts[1::4], SamplingParams(temperature=0.0, max_tokens=4))


@pytest.mark.parametrize("greedy", [True, False])
def test_static_view_with_adapters_is_the_eager_engine(served, greedy):
    """Multi-LoRA rows (`DecodeGraphs(adapters=True)`): each seat's adapter slot in the index buffer, the forward
    under the manager's captured plan (every adapter in it) -- bitwise the eager engine's per-forward selection;
    steps without an adapter row take the base shapes."""
    model, _ = served
    ref = _adapter_turns(Engine(model, prefix_cache=True, **SMALL), greedy)
    eng = Engine(model, prefix_cache=True, **SMALL)
    eng.graphs = DecodeGraphs(eng, capture=False, adapters=True)
    assert same(_adapter_turns(eng, greedy), ref)
    keys = {k.adapters for k in eng.graphs.shapes}
    assert (0, 1) in keys and None in keys
    eng.check()
    if greedy:   # speculative chain verifies of adapter rows (drafts: the references' continuations)
        from test_spec_engine import _spec_engine
        spec = _spec_engine(model, [list(c.prompt) + c.token_ids for c in ref], spec="ngram:3:batched")
        spec.graphs = DecodeGraphs(spec, capture=False, adapters=True)
        assert same(_adapter_turns(spec), ref)
        assert any(k.verify and k.adapters for k in spec.graphs.shapes) and spec.stats["spec_accepted_tokens"] > 0


def test_adapter_set_changes_and_expert_adapters(served):
    """Adding an adapter drops the graphs made for the old set (their plan stacks the adapters it had); an
    adapter on routed experts (host-read routing) sends adapter rows to the eager path; both stay bitwise the
    eager engine."""
    from k3.lora import LoRAConfig
    model, lora = served
    eng = Engine(model, prefix_cache=False, **SMALL)
    eng.graphs = DecodeGraphs(eng, capture=False, adapters=True)
    ref = _adapter_turns(Engine(model, prefix_cache=False, **SMALL), max_tokens=4)
    assert same(_adapter_turns(eng, max_tokens=4), ref)
    lora.create("c", LoRAConfig(rank=2, alpha=2.0, init_scale=0.05), seed=3)
    try:
        assert same(_adapter_turns(eng, max_tokens=4), ref)   # "c" unused: the rows are unchanged
        assert {k.adapters for k in eng.graphs.shapes} <= {None, (0, 1, 2)}
    finally:
        lora.remove("c")
    lora.create("e", LoRAConfig(rank=2, alpha=2.0, targets=("experts",), init_scale=0.05), seed=4)
    try:
        assert not lora.capturable()
        assert same(_adapter_turns(eng, max_tokens=4), ref)
        assert {k.adapters for k in eng.graphs.shapes} <= {None}
    finally:
        lora.remove("e")
    eng.check()


def test_captured_plan_runs_the_per_token_kernel(served, monkeypatch):
    """The captured plan's fused path (stacked adapters, the slot lookup in the forward, BGMV with no host read of
    the slots) gives the eager plan's SGMV bits, in Triton's interpreter on CPU (the kernels the GPU runs)."""
    from k3.model import ops
    model, lora = served
    monkeypatch.setattr(ops, "LORA_KERNELS_ON_CPU", True)
    ids = torch.tensor([rand_tokens(2, 5), rand_tokens(2, 6)])
    plan = lora.captured_plan(torch.tensor([lora.slot("b")] * 2 + [lora.slot("a")] * 2), 2, 2)
    with torch.no_grad():
        with lora.use(["b", "a"]):
            eager = model(ids).logits
        with lora.use_plan(plan):
            captured = model(ids).logits
        plan.slots.copy_(torch.tensor([lora.slot("a")] * 2 + [-1] * 2))   # the caller rewrites the slots
        with lora.use_plan(plan):
            again = model(ids).logits
        with lora.use(["a", None]):
            eager2 = model(ids).logits
    assert torch.equal(captured, eager) and torch.equal(again, eager2) and not torch.equal(eager, eager2)
    with pytest.raises(ValueError, match="captured plan"), torch.no_grad(), lora.use_plan(plan):
        model(ids[:1])


def test_long_decode_crosses_page_buckets(model):
    """One row decoding across several page-table widths at decode batch 1 and 4 (rows of different lengths
    side by side): bitwise the eager engine's."""
    prompts = [rand_tokens(5, 31), rand_tokens(29, 32), rand_tokens(12, 33)]
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    for batch in (1, 4):
        cfg = {**SMALL, "decode_batch": batch, "page_size": 4}
        ref = Engine(model, prefix_cache=False, **cfg).generate(prompts, sp)
        eng = _static_engine(model, prefix_cache=False, **cfg)
        assert same(eng.generate(prompts, sp), ref)
        assert {k.pages for k in eng.graphs.shapes} >= {4, 8, 16}


def test_page_bucket():
    assert [page_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 1000)] == [1, 2, 4, 4, 8, 8, 16, 1024]


def test_spare_slots_are_outside_the_pool():
    """A pool's spare rows exist on the device and are never handed out, even when the pool is full."""
    pool = TieredPool("p", {"x": ((3,), torch.float32)}, 2, 0, "cpu", spare=1)
    assert pool.dev["x"].shape[0] == 3 and list(pool.spare_slots) == [2]
    a, b = pool.alloc(), pool.alloc()
    assert {pool.slot(a), pool.slot(b)} == {0, 1}
    pool.check()
    with pytest.raises(ValueError, match="spare"):
        TieredPool("p", {"x": ((3,), torch.float32)}, 2, 0, "cpu", spare=-1)


def test_bad_settings_are_refused(model):
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes").validate()
    eng = Engine(model, prefix_cache=False, **SMALL)
    assert eng.graphs is None   # a CPU engine runs eagerly
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphs(eng)
    view = StaticView(eng, seats=2, tokens=1, pages=1)
    with pytest.raises(ValueError, match="seats"):
        view.pack([None])


def test_captured_call_refuses_other_shapes():
    from k3.rollout.graphs import CapturedCall
    call = CapturedCall(lambda x: x * 2, (torch.ones(2, 3),), capture=False)
    assert torch.equal(call(torch.full((2, 3), 3.0)), torch.full((2, 3), 6.0))
    with pytest.raises(ValueError, match="do not match"):
        call(torch.ones(3, 3))


@pytest.mark.gpu
def test_gpu_captured_drafts_are_the_eager_drafts():
    """The trained drafter's chain steps and tree levels as CUDA graphs draft exactly what the eager steps draft,
    for several group sizes and draft lengths (graphs made on first use, replayed after)."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.rollout.spec.drafter import DraftHead, TrainedDrafter
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    d = model.config.hidden_size
    head = DraftHead(d).cuda()
    eager = TrainedDrafter(head, model, draft_vocab=list(range(3, 40)))
    graphed = TrainedDrafter(head, model, draft_vocab=list(range(3, 40)))
    graphed.capture_graphs()
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.inference_mode():
        for rows, ks in ((1, [3]), (4, [3, 2, 3, 1]), (4, [3, 3, 3, 3]), (1, [3])):
            for _ in range(2):
                feats = torch.randn(rows, 3 * d, device="cuda", generator=g)
                last = torch.randint(3, 40, (rows,), generator=g, device="cuda").tolist()
                assert graphed.propose_chains(feats, last, ks) == eager.propose_chains(feats, last, ks)
                for tree, want in zip(graphed.propose_trees(feats, last, 2, ks, 14),
                                      eager.propose_trees(feats, last, 2, ks, 14)):
                    assert (tree.tokens, tree.parents) == (want.tokens, want.parents)
    # one graph per (rows, longest draft), reused
    assert sorted(graphed.captured) == [("chain", 1, 3), ("chain", 4, 3), ("tree", 1, 2, 3), ("tree", 4, 2, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_graph_replays_are_the_eager_decode(batch):
    """On the GPU: the multi-turn workload and a long decode crossing page-table widths, graphs on against graphs
    off, bitwise (tokens, log-probs, routing); graphs were captured and replayed."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    cfg = {**SMALL, "decode_batch": batch}
    eager = Engine(model, prefix_cache=True, cuda_graphs=False, **cfg)
    graphed = Engine(model, prefix_cache=True, **cfg)
    assert eager.graphs is None and graphed.graphs is not None
    assert same(workload(graphed, True), workload(eager, True))
    assert same(workload(graphed, False), workload(eager, False))
    prompts = [rand_tokens(5, 31), rand_tokens(29, 32), rand_tokens(12, 33)]
    sp = SamplingParams(temperature=0.0, max_tokens=40)
    assert same(graphed.generate(prompts, sp), eager.generate(prompts, sp))
    assert graphed.graphs.stats["captures"] >= 3 and graphed.graphs.stats["replays"] > 40
    graphed.check()
    # speculative decoding with captured chain and tree verifies (the engine's default) against the eager engine's
    # plain decoding
    from test_spec_engine import GREEDY, _prompts, _spec_engine
    ref = eager.generate(_prompts(), GREEDY)
    for shape in ("ngram:3:batched", "ngram:2x3:batched"):
        spec = _spec_engine(model, [list(c.prompt) + c.token_ids for c in ref], spec=shape, **cfg)
        assert same(spec.generate(_prompts(), GREEDY), ref)
        assert any(k.verify for k in spec.graphs.shapes) and spec.graphs.commits
        assert any(k.tree for k in spec.graphs.shapes) == (shape == "ngram:2x3:batched")
        assert spec.stats["spec_accepted_tokens"] > 0


@pytest.mark.gpu
def test_gpu_captured_adapters_are_the_eager_engine():
    """On the GPU: multi-LoRA rows through captured graphs (the engine's default: the captured plan, BGMV) against
    graphs off, bitwise, at decode batch 1 and 4, greedy and sampled; again after an in-place adapter update (the
    graphs read the adapters at every replay); and speculative chain verifies of adapter rows."""
    from test_spec_engine import _spec_engine
    model, lora = lora_served(ADAPTER_CONFIGS, "cuda")
    for batch in (1, 4):
        cfg = {**SMALL, "decode_batch": batch}
        eager = Engine(model, prefix_cache=True, cuda_graphs=False, **cfg)
        graphed = Engine(model, prefix_cache=True, **cfg)
        for greedy in (True, False):
            assert same(_adapter_turns(graphed, greedy), _adapter_turns(eager, greedy))
        assert any(k.adapters for k in graphed.graphs.shapes) and graphed.graphs.stats["captures"] >= 2
        with torch.no_grad():   # new adapter values, written in place (as k3.sync's receiver does)
            for t in lora.adapters["a"].tensors().values():
                t.add_(0.01 * torch.randn_like(t))
        for eng in (eager, graphed):
            eng.update_weights(None, eng.version + 1)
        captures = graphed.graphs.stats["captures"]
        assert same(_adapter_turns(graphed), _adapter_turns(eager))
        assert graphed.graphs.stats["captures"] == captures   # replayed, not re-captured
        graphed.check()
    ref = _adapter_turns(Engine(model, prefix_cache=False, cuda_graphs=False, **SMALL))
    spec = _spec_engine(model, [list(c.prompt) + c.token_ids for c in ref], spec="ngram:3:batched")
    assert same(_adapter_turns(spec), ref)
    assert any(k.verify and k.adapters for k in spec.graphs.shapes) and spec.stats["spec_accepted_tokens"] > 0
    lora.close()


@pytest.mark.gpu
def test_gpu_overlapped_drafting_is_bitwise_and_drafts_the_same():
    """`SpecDecoder.overlap_drafting`: each continuing row's next chain drafted after the walk by the trained
    head's captured steps on a side stream, beside the commit on the engine's stream, its drafts read from pinned
    host memory at the next step. The head reads only the verify's features (the side stream waits for the verify,
    not for the commit), so the drafts, the acceptance counts and the output are the same as drafting at the next
    step on the engine's stream, and bitwise plain decoding. (CPU: the same path without streams,
    test_spec_drafter.py's predrafting test.)"""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.rollout.spec import SpecConfig
    from k3.rollout.spec.drafter import DraftHead, TrainedDrafter
    from test_spec_engine import GREEDY, _prompts
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    head = DraftHead(model.config.hidden_size).cuda()
    ref = Engine(model, prefix_cache=False, **SMALL).generate(_prompts(), GREEDY)
    runs = []
    for overlap in (False, True):
        eng = Engine(model, prefix_cache=True, speculative=SpecConfig(draft_len=3, verify="batched"), **SMALL)
        eng.spec.drafter = TrainedDrafter(head, model, draft_vocab=sorted({t for c in ref for t in c.token_ids}))
        eng.spec.drafter.capture_graphs()
        eng.spec.overlap_drafting = overlap
        out = eng.generate(_prompts(), GREEDY)
        assert same(out, ref)
        assert (eng.spec._draft_stream is not None) == overlap
        assert (eng.stats["spec_predrafted"] > 0) == overlap
        runs.append({k: eng.stats[k] for k in ("spec_verifies", "spec_draft_tokens", "spec_accepted_tokens")})
    assert runs[0] == runs[1] and runs[0]["spec_draft_tokens"] > 0
