"""The trained drafter (EAGLE3-style head over the target's low/mid/high features): training lowers its loss
against the target's distributions, it round-trips through its cache directory, bad paths are named, and the
engine drafting with it stays bitwise plain decoding while accepting drafts on the rollouts it was trained on."""
import pytest
import torch

from k3.rollout import Engine, SamplingParams
from k3.rollout.spec import DrafterDtype, SpecConfig
from k3.rollout.spec.drafter import load_drafter, save_drafter
from k3.rollout.spec.ngram import NgramDrafter, SuffixIndex
from k3.rollout.spec.train_drafter import DrafterTrainConfig, target_features, train_head

from _engine_helpers import SMALL, rand_tokens, same


@pytest.fixture(scope="module")
def trained(model, tmp_path_factory):
    prompts = [rand_tokens(10 + i, 80 + i) for i in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=20)
    ref = Engine(model, prefix_cache=False, **SMALL).generate(prompts, sp)
    seqs = [p + c.token_ids for p, c in zip(prompts, ref)]   # the target's own rollouts
    feats = target_features(model, seqs)
    tcfg = DrafterTrainConfig(steps=150, batch=64, lr=1e-2)
    head, figures = train_head(model, [(s, f, lp) for s, (f, lp) in zip(seqs, feats)], tcfg)
    path = tmp_path_factory.mktemp("drafter") / "drafter-test"
    save_drafter(head, path, {"figures": figures})
    return prompts, sp, ref, path, figures


def test_training_fits_the_targets_distributions(trained):
    *_, figures = trained
    assert figures["kl_last"] < 0.5 * figures["kl_first"], figures


@pytest.mark.parametrize("verify", ["exact", "batched"])
@pytest.mark.parametrize("branching", [1, 2])
def test_engine_with_the_drafter_is_bitwise_plain_decoding(model, trained, branching, verify):
    """Chains (draft length 3) and 2x3 token trees (the head's top-2 at every depth: 14 nodes, 15 verify
    positions), verified position by position or in one forward."""
    prompts, sp, ref, path, _ = trained
    cfg = SpecConfig(method="drafter", drafter_path=str(path), branching=branching, verify=verify)
    eng = Engine(model, prefix_cache=True, speculative=cfg, **SMALL)
    eng.check_each_step = True
    assert same(eng.generate(prompts, sp), ref)
    st = eng.stats
    # a tree drafts up to 14 nodes, of which at most 3 per verify can be accepted
    assert st["spec_accepted_tokens"] > (0.3 if branching == 1 else 0.08) * st["spec_draft_tokens"], st


def test_bfloat16_head_is_bitwise_plain_decoding(model, trained):
    """`drafter_dtype="bfloat16"` (half the bytes a draft step reads on the GPU): other drafts, the same output --
    bitwise plain decoding -- and still accepted on the rollouts the head was trained on."""
    prompts, sp, ref, path, _ = trained
    cfg = SpecConfig(method="drafter", drafter_path=str(path), verify="batched", drafter_dtype="bfloat16", lookup=0)
    eng = Engine(model, prefix_cache=True, speculative=cfg, **SMALL)
    assert eng.spec.drafter.dtype == torch.bfloat16 and eng.spec.drafter.head.fuse.weight.dtype == torch.bfloat16
    assert same(eng.generate(prompts, sp), ref)
    st = eng.stats
    assert st["spec_accepted_tokens"] > 0.3 * st["spec_draft_tokens"], st
    with pytest.raises(ValueError, match="speculative.drafter_dtype"):
        SpecConfig(method="drafter", drafter_dtype="fp8")
    # the default ("auto") drafts in the target's dtype off CUDA (this fp32 target: fp32), in e4m3 on CUDA
    default = Engine(model, speculative=SpecConfig(method="drafter", drafter_path=str(path)), **SMALL)
    assert SpecConfig().drafter_dtype.value == "auto" and default.spec.drafter.dtype == next(model.parameters()).dtype
    assert SpecConfig().drafter_dtype.resolved("cuda") is DrafterDtype.FLOAT8
    assert SpecConfig().drafter_dtype.resolved("cpu") is DrafterDtype.TARGET
    assert SpecConfig(drafter_dtype="bfloat16").drafter_dtype.resolved("cuda") is DrafterDtype.BFLOAT16
    with pytest.raises(ValueError, match="drafter_dtype"):
        DrafterDtype.AUTO.torch_dtype(torch.float32)


def test_static_verify_with_features_is_bitwise_plain_decoding(model, trained):
    """The batched chain verify as a fixed-shape forward (k3.rollout.graphs, run eagerly here: on the GPU it is
    captured) returns the drafter's features of every position from inside the forward: same tokens, same
    acceptance as the eager verify."""
    from k3.rollout.graphs import DecodeGraphs
    prompts, sp, ref, path, _ = trained
    cfg = SpecConfig(method="drafter", drafter_path=str(path), verify="batched")
    eager = Engine(model, prefix_cache=True, speculative=cfg, **SMALL)
    assert same(eager.generate(prompts, sp), ref)
    eng = Engine(model, prefix_cache=True, speculative=cfg, **SMALL)
    eng.graphs = DecodeGraphs(eng, capture=False)
    eng.spec.drafter.capture_graphs(capture=False)   # the draft steps through CapturedCall
    assert same(eng.generate(prompts, sp), ref)
    assert any(k.verify and k.features for k in eng.graphs.shapes) and eng.graphs.commits
    assert eng.spec.drafter.captured
    assert eng.stats["spec_accepted_tokens"] == eager.stats["spec_accepted_tokens"] > 0


def test_tree_proposals_fit_the_shape(model, trained):
    prompts, _, ref, path, _ = trained
    drafter = load_drafter(path, model)
    feat = torch.randn(3 * model.config.hidden_size)
    tree = drafter.propose_tree(feat, 5, 2, 3, 14)
    assert len(tree) == 14 and tree.fits(2, 3) and tree.depth == 3
    assert [tree.tokens[i] for i in tree.path(0)] == drafter.propose_tokens(feat, 5, 1)   # first child: the argmax
    # the batched form: the full tree of every row at fixed shapes, each row keeping its breadth-first prefix
    feats = torch.randn(4, 3 * model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    for graphs in (False, True):
        if graphs:
            drafter.capture_graphs(capture=False)   # the levels through CapturedCall
        for branching, depths, nodes in ((2, [3, 2, 1, 0], 14), (2, [3, 3, 1, 2], 5), (3, [2, 1, 2, 2], 15)):
            trees = drafter.propose_trees(feats, [5, 6, 7, 8], branching, depths, nodes)
            for r, t in enumerate(trees):
                one = drafter.propose_tree(feats[r], 5 + r, branching, depths[r], nodes)
                assert t.parents == one.parents and t.tokens == one.tokens, (branching, depths, r)
    assert {k[0] for k in drafter.captured} == {"tree"}
    ngram = NgramDrafter(4, 1)
    ctx = [1, 2, 3, 1, 2, 4, 1, 2, 5, 6, 1, 2]
    t = ngram.propose_tree(ctx, 2, 3, 14)
    # the continuations of "1 2" (most recent first: 5 6 1, 4 1 2, 3 1 2), two children per node
    assert t.fits(2, 3) and [t.tokens[c] for c in t.children(-1)] == [5, 4]
    assert ngram.propose_tree(ctx, 1, 3, 14).tokens == tuple(ngram.propose(ctx, 3))


@pytest.mark.parametrize("ngram_max, ngram_min", [(4, 1), (3, 2), (1, 1)])
def test_suffix_index_is_the_scan(ngram_max, ngram_min):
    """The engine keeps each row's n-gram index and extends it by the step's new tokens (prompt lookup and the
    n-gram drafter: O(new tokens) a step, not a scan of the whole context): after every extension, whatever its
    size, its match and tree paths are NgramDrafter's scans of the same sequence (the spec)."""
    g = torch.Generator().manual_seed(0)
    scan = NgramDrafter(ngram_max, ngram_min)
    for vocab in (3, 8):   # small vocabularies: many repeats, ties between suffix lengths
        seq = torch.randint(0, vocab, (300,), generator=g).tolist()
        index, L = SuffixIndex(ngram_max, ngram_min), 0
        while L < len(seq):
            L = min(len(seq), L + int(torch.randint(1, 6, (1,), generator=g)))
            index.extend(seq[len(index.tokens):L])
            assert index.tokens == seq[:L]
            for k in (0, 1, 3):
                assert index.match(k) == scan.match(seq[:L], k), (L, k)
            assert index.paths(3) == scan.paths(seq[:L], 3), L
    with pytest.raises(ValueError, match="ngram_min"):
        SuffixIndex(2, 3)


def test_drafter_path_errors_are_named(model, tmp_path):
    with pytest.raises(ValueError, match="drafter_path"):
        Engine(model, speculative=SpecConfig(method="drafter"))
    with pytest.raises(ValueError, match="drafter_path: no trained drafter"):
        load_drafter(tmp_path, model)
    with pytest.raises(ValueError, match="drafter.steps"):
        DrafterTrainConfig(steps=0).validate()


def test_first_decode_step_drafts_from_the_prompt_features(model, trained):
    """The first decode step of a turn drafts from the prompt's last-position features (captured by the prefill,
    kept with a whole-prompt cache entry): with max_tokens 3 the only speculative step is that one (draft limit 1),
    so every row drafts exactly one token, on a fresh prefill and again on a hit on the whole prompt, and the
    output stays bitwise plain decoding. Before, that step drafted nothing (the features came from verifies only)."""
    prompts, *_, path, _ = trained
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    ref = Engine(model, prefix_cache=False, **SMALL).generate(prompts, sp)
    eng = Engine(model, prefix_cache=True, speculative=SpecConfig(method="drafter", drafter_path=str(path)),
                 **SMALL)
    for run in range(2):   # run 1: every prompt is a whole-prompt hit (sampled from the cached logits)
        before = dict(eng.stats)
        assert same(eng.generate(prompts, sp), ref)
        assert eng.stats["spec_draft_tokens"] - before.get("spec_draft_tokens", 0) == len(prompts), run
        hits = eng.stats["hit_tokens"] - before.get("hit_tokens", 0)
        assert hits == (sum(map(len, prompts)) if run else 0), run


def test_training_positions_are_where_the_engine_drafts(model):
    """With the generated-token mask, the head trains only on positions t whose next token was generated (a draft
    continues a sampled token): the shared prompt is not what it learns."""
    seqs = [rand_tokens(40, 300 + i) for i in range(2)]
    feats = target_features(model, seqs)
    masks = [[t >= 30 for t in range(40)] for _ in seqs]   # the last 10 tokens generated
    tcfg = DrafterTrainConfig(steps=2, batch=8, unroll=3)
    _, all_pos = train_head(model, [(s, f, lp) for s, (f, lp) in zip(seqs, feats)], tcfg)
    _, gen_pos = train_head(model, [(s, f, lp, m) for s, (f, lp), m in zip(seqs, feats, masks)], tcfg)
    assert all_pos["positions"] == 2 * (40 - 3 - 1)
    assert gen_pos["positions"] == 2 * len(range(29, 40 - 3 - 1))   # t + 1 >= 30 and t + 3 < 39


def test_group_proposals_are_the_rows_own(model, trained):
    """The engine drafts for a whole decode group in one pass per draft step (`propose_chains`, `propose_trees`);
    each row gets the chain / tree it would get alone (rows of different draft limits, one with none)."""
    path = trained[3]
    drafter = load_drafter(path, model)
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(4, 3 * model.config.hidden_size, generator=g)
    last, limits = [5, 9, 11, 2], [3, 1, 2, 0]
    chains = drafter.propose_chains(feats, last, limits)
    assert chains == [drafter.propose_tokens(f, t, k) if k else [] for f, t, k in zip(feats, last, limits)]
    trees = drafter.propose_trees(feats, last, 2, limits, 14)
    for f, t, k, tree in zip(feats, last, limits, trees):
        alone = drafter.propose_tree(f, t, 2, k, 14) if k else None
        assert (tree.tokens, tree.parents) == ((alone.tokens, alone.parents) if k else ((), ()))


def test_draft_vocabulary_restricts_what_is_drafted(model, trained, tmp_path):
    """A drafter saved with a draft vocabulary (EAGLE-3's reduced vocabulary: the rollouts' most frequent tokens)
    drafts only those tokens, and the same chains as the full head wherever the full head's choice is in it; the
    engine with it stays bitwise plain decoding. A vocabulary that is not distinct in-range ids is named."""
    import json
    import shutil
    from k3.rollout.spec.train_drafter import draft_vocabulary
    prompts, sp, ref, path, _ = trained
    assert draft_vocabulary([[3, 1, 3, 2], [2, 3]], 2) == [3, 2]   # by frequency, ties by id, cut at the limit
    full = load_drafter(path, model)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(6, 3 * model.config.hidden_size, generator=g)
    want = full.propose_chains(feats, [1, 2, 3, 4, 5, 6], [3] * 6)
    vocab = sorted({t for c in want for t in c} | {7, 8})
    small = tmp_path / "small"
    shutil.copytree(path, small)
    meta = json.loads((small / "drafter.json").read_text())
    (small / "drafter.json").write_text(json.dumps({**meta, "draft_vocab": vocab}))
    restricted = load_drafter(small, model)
    assert restricted.propose_chains(feats, [1, 2, 3, 4, 5, 6], [3] * 6) == want
    tiny_vocab = tmp_path / "tiny"
    shutil.copytree(path, tiny_vocab)
    (tiny_vocab / "drafter.json").write_text(json.dumps({**meta, "draft_vocab": [7, 8]}))
    two = load_drafter(tiny_vocab, model)
    assert {t for c in two.propose_chains(feats, [1, 2, 3, 4, 5, 6], [3] * 6) for t in c} <= {7, 8}
    assert all(set(t.tokens) <= {7, 8} for t in two.propose_trees(feats, [1, 2, 3, 4, 5, 6], 2, [3] * 6, 14))
    out = Engine(model, prefix_cache=False, speculative=SpecConfig(method="drafter", drafter_path=str(tiny_vocab)),
                 **SMALL).generate(prompts, sp)
    assert same(out, ref)
    (tiny_vocab / "drafter.json").write_text(json.dumps({**meta, "draft_vocab": [7, 7]}))
    with pytest.raises(ValueError, match="draft_vocab"):
        load_drafter(tiny_vocab, model)


def test_features_and_training_over_a_draft_vocabulary(model):
    """The GPU benchmark keeps only each rollout's tail and the draft vocabulary's log-prob columns (a thousand
    prompts' full log-probs at K3's vocabulary would not fit on the device) and trains the head on the target's
    distribution renormalised over that vocabulary: the kept slices are the full ones', and training lowers the KL."""
    from k3.rollout.spec.train_drafter import draft_vocabulary
    seqs = [rand_tokens(30, 400 + i) for i in range(2)]
    starts = [5, 7]
    full = target_features(model, seqs)
    vocab = draft_vocabulary(seqs, 1000)
    cut = target_features(model, seqs, starts, vocab)
    for (f, lp), (cf, clp), a in zip(full, cut, starts):
        assert torch.equal(cf, f[a:])
        assert clp.shape == (30 - a, len(vocab)) and torch.allclose(clp, lp[a:, vocab])
    tcfg = DrafterTrainConfig(steps=60, batch=32, lr=1e-2)
    _, fig = train_head(model, [(s[a:], f, lp) for s, a, (f, lp) in zip(seqs, starts, cut)], tcfg, vocab)
    assert fig["kl_last"] < 0.5 * fig["kl_first"]


def test_prompt_lookup_beside_the_head(model, trained):
    """`SpecConfig.lookup`: a suffix found earlier in the row drafts its continuation (copies the head cannot
    make): trusted from `lookup` tokens, from one token only when it agrees with the head's first choice; trees
    merge both sources' paths. The engine stays bitwise plain decoding with it."""
    from k3.rollout.spec.tree import DraftTree
    from k3.rollout.types import make_key

    class Row:   # a running row's keys (the decoder indexes each row's sequence, keyed weakly by the row)
        def __init__(self, tokens):
            self.key = [make_key(t, 1, 2) for t in tokens]

    def with_lookup(spec, row, head):   # as _propose_group calls it: with the row index's match
        return spec._with_lookup(row, head, 3, spec._context(row).match(3))

    prompts, sp, ref, path, _ = trained
    eng = Engine(model, prefix_cache=False, speculative=SpecConfig(method="drafter", drafter_path=str(path)),
                 **SMALL)
    spec = eng.spec
    row = Row([5, 6, 7, 8, 9, 5, 6])   # "5 6" occurred: "7 8 9"
    head = DraftTree.chain([11, 12, 13])
    assert with_lookup(spec, row, head).tokens == (7, 8, 9)                       # a 2-token suffix: trusted
    grows = Row([5, 6, 7, 8, 9, 5, 6])
    assert with_lookup(spec, grows, head).tokens == (7, 8, 9)
    grows.key += [make_key(t, 1, 2) for t in (7, 8)]   # the row's index grows with it: "5 6 7 8" -> "9 5 6"
    assert with_lookup(spec, grows, head).tokens == (9, 5, 6)
    one = Row([5, 6, 7, 8, 9, 4, 6])  # only "6" occurred
    assert with_lookup(spec, one, head).tokens == (11, 12, 13)                    # disagrees: the head's
    assert with_lookup(spec, one, DraftTree.chain([7, 12, 13])).tokens == (7, 8, 9)   # agrees: the copy
    assert with_lookup(spec, Row([1, 2, 3]), head) is head
    tree_eng = Engine(model, prefix_cache=False, **SMALL, speculative=SpecConfig(
        method="drafter", drafter_path=str(path), branching=2))
    head_tree = DraftTree((11, 14, 12, 13), (-1, -1, 0, 2))                  # paths 11 12 13 and 14
    merged = with_lookup(tree_eng.spec, row, head_tree)
    assert merged.fits(2, 3) and [merged.tokens[i] for i in merged.path(2)] == [7, 8, 9]   # the copy first
    assert [merged.tokens[c] for c in merged.children(-1)] == [7, 11]         # then the head's best path
    for branching in (1, 2):   # exactness with lookup on prompts that repeat themselves
        cfg = SpecConfig(method="drafter", drafter_path=str(path), branching=branching, verify="batched")
        looped = [p * 2 for p in prompts]
        want = Engine(model, prefix_cache=False, **SMALL).generate(looped, sp)
        got = Engine(model, prefix_cache=True, speculative=cfg, **SMALL)
        got.check_each_step = True
        head_rows, chains = [], got.spec.drafter.launch_chains

        def counted(feats, last, steps):   # chains: rows that copy a >= 2-token suffix skip the head
            head_rows.append(len(last))
            return chains(feats, last, steps)
        got.spec.drafter.launch_chains = counted
        assert same(got.generate(looped, sp), want)
        if branching == 1:
            assert 0 < sum(head_rows) < got.stats["spec_verifies"], (head_rows, got.stats["spec_verifies"])
    with pytest.raises(ValueError, match="lookup"):
        SpecConfig(method="drafter", lookup=9).validate()



@pytest.mark.parametrize("lookup", [0, 2])
def test_predrafting_drafts_what_the_next_step_would(model, trained, lookup):
    """`SpecDecoder.overlap_drafting`: each continuing row's next chain is drafted at the end of its step, before
    the commit (on CUDA beside it, on a side stream). The next step takes those drafts instead of running the head:
    the same drafts (same features, same last token), hence the same accept counts, and the output stays bitwise
    plain decoding; rows whose position moved on (or that copy a suffix) are drafted as before. (The CUDA run with
    the side stream: test_graphs.py's gpu test.)"""
    prompts, sp, ref, path, _ = trained
    runs, engines = [], []
    for overlap in (False, True):
        cfg = SpecConfig(method="drafter", drafter_path=str(path), verify="batched", lookup=lookup)
        eng = Engine(model, prefix_cache=True, speculative=cfg, **SMALL)
        eng.spec.overlap_drafting = overlap
        drafted = []
        propose = eng.spec._propose_group

        def recorded(group, speculating, meanwhile=None, propose=propose, drafted=drafted):
            trees = propose(group, speculating, meanwhile)
            drafted.append([t.tokens for t in trees])
            return trees
        eng.spec._propose_group = recorded
        eng.check_each_step = True
        assert same(eng.generate(prompts, sp), ref)
        runs.append(drafted)
        engines.append(eng)
    assert runs[0] == runs[1]
    assert engines[0].stats["spec_predrafted"] == 0
    assert engines[1].stats["spec_predrafted"] > 0.5 * engines[1].stats["spec_verifies"], engines[1].stats


@pytest.mark.parametrize("kernel", [False, True])
def test_float8_head_is_bitwise_plain_decoding(model, trained, kernel, monkeypatch):
    """`drafter_dtype="float8"`: the head's matrices in e4m3 with a scale per output row (a quarter of the fp32
    bytes a draft step reads; the Triton kernel on the GPU: here its spec, and the kernel in Triton's interpreter):
    other drafts, the same output -- bitwise plain decoding -- and still accepted on the rollouts the head was
    trained on."""
    from k3.model import ops
    from k3.rollout.spec.drafter import Fp8Linear
    monkeypatch.setattr(ops, "FP8_LINEAR_KERNEL_ON_CPU", kernel)
    prompts, sp, ref, path, _ = trained
    cfg = SpecConfig(method="drafter", drafter_path=str(path), verify="batched", drafter_dtype="float8", lookup=0)
    eng = Engine(model, prefix_cache=True, speculative=cfg, **SMALL)
    head = eng.spec.drafter.head
    assert all(isinstance(getattr(head, n), Fp8Linear) for n in ("fuse", "mix", "up", "down"))
    assert head.mix.q.dtype == torch.float8_e4m3fn and eng.spec.drafter.dtype == next(model.parameters()).dtype
    assert same(eng.generate(prompts, sp), ref)
    st = eng.stats
    assert st["spec_accepted_tokens"] > 0.3 * st["spec_draft_tokens"], st
