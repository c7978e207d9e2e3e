"""Decode steps as CUDA graphs (k3.rollout.graphs): the fixed-shape forward over `StaticView` -- indices in one
device buffer, idle seats on the pools' spare page and state, the key length a power-of-two page table -- must give
bitwise what the eager `PoolView` forward gives, or replaying it would change rollouts. On CPU the same forward
runs eagerly (`capture=False`): that checks the view's indexing everywhere CI runs; the `gpu` test captures and
replays."""
import pytest
import torch

from k3.rollout import Engine, EngineConfig, SamplingParams
from k3.rollout.graphs import DecodeGraphs, StaticView, page_bucket
from k3.rollout.pools import TieredPool

from _engine_helpers import SMALL, TINY_POOLS, rand_tokens, same, workload


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
    (parents, ancestor mask and conv-window columns in a static buffer; `trees=True`, not yet the engine's
    default), and the commit as one fold over every seat (`DecodeGraphs.commit`, idle seats on the spare state):
    bitwise plain decoding, turns and branches, prefix cache on with tiny pools."""
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
    """The trained drafter's chain steps as CUDA graphs draft exactly what the eager steps draft, for several
    group sizes and draft lengths (graphs made on first use, replayed after)."""
    from k3.config import K3Config
    from k3.model import K3ForCausalLM
    from k3.rollout.spec.drafter import DraftHead, TrainedDrafter
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).cuda().eval()
    d = model.config.hidden_size
    head = DraftHead(d).cuda()
    eager = TrainedDrafter(head, model, draft_vocab=list(range(3, 40)))
    graphed = TrainedDrafter(head, model, draft_vocab=list(range(3, 40)))
    graphed.capture_chains()
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.inference_mode():
        for rows, ks in ((1, [3]), (4, [3, 2, 3, 1]), (4, [3, 3, 3, 3]), (1, [3])):
            for _ in range(2):
                feats = torch.randn(rows, 3 * d, device="cuda", generator=g)
                last = torch.randint(3, 40, (rows,), generator=g, device="cuda").tolist()
                assert graphed.propose_chains(feats, last, ks) == eager.propose_chains(feats, last, ks)
    assert sorted(graphed.captured) == [(1, 3), (4, 3)]   # one graph per (rows, longest draft), reused


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
    # speculative decoding with captured chain verifies against the eager engine's plain decoding
    from test_spec_engine import GREEDY, _prompts, _spec_engine
    ref = eager.generate(_prompts(), GREEDY)
    for shape in ("ngram:3:batched", "ngram:2x3:batched"):
        spec = _spec_engine(model, [list(c.prompt) + c.token_ids for c in ref], spec=shape, **cfg)
        spec.graphs = DecodeGraphs(spec, trees=True)   # token-tree verifies captured too
        assert same(spec.generate(_prompts(), GREEDY), ref)
        assert any(k.verify for k in spec.graphs.shapes) and spec.graphs.commits
        assert any(k.tree for k in spec.graphs.shapes) == (shape == "ngram:2x3:batched")
        assert spec.stats["spec_accepted_tokens"] > 0
