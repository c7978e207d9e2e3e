"""k3.lora: target selection, hooks without base copies, merge/unmerge, adapter files, multi-LoRA batches."""
import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.config import K3Config
from k3.lora import LoRAAdapter, LoRAConfig, LoRAError, LoRAManager, candidate_targets, resolve_targets
from k3.model import K3ForCausalLM

ALL = ("attn", "mlp", "experts")


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny")).eval()


def _ids(model, b=3, t=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (b, t), generator=g)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def _cfg(targets=ALL, scale=0.02, rank=8):
    return LoRAConfig(rank=rank, alpha=16.0, targets=targets, init_scale=scale)


def test_presets_and_scaling():
    assert LoRAConfig.preset("k3").rank == 64
    assert LoRAConfig.preset("tiny").rank == 8
    c = LoRAConfig(rank=8, alpha=32)
    assert c.scaling == 4.0
    assert LoRAConfig.from_dict(c.to_dict()) == c
    for bad in (dict(rank=0), dict(alpha=0.0), dict(targets=()), dict(init_scale=-1.0)):
        with pytest.raises(ValueError):
            LoRAConfig(**bad)
    with pytest.raises(ValueError, match="preset"):
        LoRAConfig.preset("huge")


def test_target_selection(tiny):
    cfg = tiny.config
    cands = candidate_targets(tiny)
    n_mla = sum(not cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    n_kda = cfg.num_hidden_layers - n_mla
    n_moe = len(cfg.moe_layer_ids)
    attn = resolve_targets(tiny, ("attn",))
    # MLA: q_a, q_b, kv_a, kv_b, g, o; KDA: q, k, v, f_a, f_b, b, g, o
    assert len(attn) == 6 * n_mla + 8 * n_kda
    assert "model.layers.3.self_attn.kv_b_proj" in attn and "model.layers.0.self_attn.f_b_proj" in attn
    mlp = resolve_targets(tiny, ("mlp",))
    assert len(mlp) == 3 * (cfg.num_hidden_layers - n_moe) + 3 * n_moe  # dense MLP + shared experts
    experts = resolve_targets(tiny, ("experts",))
    assert len(experts) == 3 * n_moe and all(t.kind == "experts" for t in experts.values())
    assert experts["model.layers.1.block_sparse_moe.experts.w2"].a_shape(4) == (cfg.num_experts, 4,
                                                                                  cfg.moe_intermediate_size)
    assert len(resolve_targets(tiny, ("self_attn.o_proj",))) == cfg.num_hidden_layers
    only3 = resolve_targets(tiny, (r"re:model\.layers\.3\.self_attn\..*",))
    assert set(only3) == {n for n in cands if n.startswith("model.layers.3.self_attn.")}
    assert not any("lm_head" in n or "embed" in n for n in cands)
    with pytest.raises(ValueError, match="'nope_proj'"):
        resolve_targets(tiny, ("attn", "nope_proj"))
    with pytest.raises(ValueError, match="invalid regex"):
        resolve_targets(tiny, ("re:(",))


def test_new_adapter_is_a_no_op_and_hooks_leave_the_base_alone(tiny):
    ids = _ids(tiny)
    base = _logits(tiny, ids)
    ptrs = {n: p.data_ptr() for n, p in tiny.named_parameters()}
    n_params = len(list(tiny.parameters()))
    mgr = LoRAManager(tiny)
    mgr.create("zero", LoRAConfig(rank=4, targets=ALL))  # B = 0
    assert torch.equal(_logits(tiny, ids), base)  # nothing selected
    with mgr.use("zero"):
        assert torch.equal(_logits(tiny, ids), base)
    # applying adapters copies nothing: same parameter storage, no new model parameters
    assert {n: p.data_ptr() for n, p in tiny.named_parameters()} == ptrs
    assert len(list(tiny.parameters())) == n_params
    mgr.close()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in tiny.modules())
    assert "forward" not in vars(tiny.model.layers[1].block_sparse_moe.experts)
    assert torch.equal(_logits(tiny, ids), base)


def test_adapter_changes_every_targeted_part(tiny):
    ids = _ids(tiny)
    base = _logits(tiny, ids)
    mgr = LoRAManager(tiny)
    for targets in (("self_attn.kv_b_proj",), ("self_attn.f_a_proj",), ("shared_experts.down_proj",),
                    ("mlp.up_proj",), ("experts.w2",)):
        name = targets[0]
        mgr.create(name, _cfg(targets, scale=0.1), seed=3)
        with mgr.use(name):
            assert (_logits(tiny, ids) - base).abs().max() > 1e-4, name


def test_merge_matches_unmerged_and_unmerge_restores_bitwise(tiny):
    ids = _ids(tiny)
    before = {k: v.clone() for k, v in tiny.state_dict().items()}
    mgr = LoRAManager(tiny)
    mgr.create("a", _cfg(), seed=1)
    mgr.create("b", _cfg(), seed=2)
    with mgr.use("a"):
        unmerged = _logits(tiny, ids)
    exported = mgr.merged_state_dict("a")
    assert all(torch.equal(tiny.state_dict()[k], v) for k, v in before.items())  # export changes nothing
    mgr.merge("a")
    assert mgr.merged == "a" and mgr.selection == "a"
    merged = _logits(tiny, ids)
    assert (merged - unmerged).abs().max() < 1e-4 * unmerged.abs().max()
    assert (merged - unmerged).abs().max() < 2e-5
    assert all(torch.equal(tiny.state_dict()[k], v) for k, v in exported.items())  # export == merge, bitwise
    with pytest.raises(LoRAError, match="merged"):
        mgr.activate("b")
    with pytest.raises(LoRAError, match="already merged"):
        mgr.merge("b")
    with pytest.raises(LoRAError, match="merged"):
        mgr.remove("a")
    mgr.unmerge()
    assert mgr.merged is None and mgr.selection is None
    after = tiny.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # bit for bit
    with pytest.raises(LoRAError, match="no adapter is merged"):
        mgr.unmerge()


def test_adapter_file_roundtrip(tiny, tmp_path):
    ids = _ids(tiny)
    mgr = LoRAManager(tiny)
    ad = mgr.create("a", _cfg(), seed=1)
    with mgr.use("a"):
        want = _logits(tiny, ids)
    path = tmp_path / "adapter.safetensors"
    ad.save(path)
    on_disk = load_file(str(path))
    assert set(on_disk) == set(ad.tensors()) and all(k.endswith((".lora_A", ".lora_B")) for k in on_disk)
    assert sum(v.numel() for v in on_disk.values()) == ad.num_parameters()  # adapter only, no base weights
    loaded = LoRAAdapter.load(path, tiny)
    assert loaded.config == ad.config
    mgr.add("loaded", loaded)
    with mgr.use("loaded"):
        assert torch.equal(_logits(tiny, ids), want)


def test_adapter_file_errors(tiny, tmp_path):
    ad = LoRAAdapter.for_model(tiny, _cfg(("attn",)), seed=1)
    good = tmp_path / "a.safetensors"
    ad.save(good)
    tensors = load_file(str(good))
    from safetensors import safe_open
    with safe_open(str(good), framework="pt") as f:
        meta = f.metadata()

    with pytest.raises(LoRAError, match="does not exist"):
        LoRAAdapter.load(tmp_path / "missing.safetensors", tiny)
    plain = tmp_path / "plain.safetensors"
    save_file(tensors, str(plain))
    with pytest.raises(LoRAError, match="not a K3 LoRA adapter"):
        LoRAAdapter.load(plain, tiny)
    half = tmp_path / "half.safetensors"
    k = "model.layers.0.self_attn.q_proj.lora_B"
    save_file({n: t for n, t in tensors.items() if n != k}, str(half), metadata=meta)
    with pytest.raises(LoRAError, match="lora_B' is missing"):
        LoRAAdapter.load(half, tiny)
    wrong_rank = tmp_path / "rank.safetensors"
    save_file(tensors, str(wrong_rank), metadata={**meta, "config": meta["config"].replace('"rank": 8', '"rank": 4')})
    with pytest.raises(LoRAError, match="at rank 4 needs"):
        LoRAAdapter.load(wrong_rank, tiny)
    unknown = tmp_path / "unknown.safetensors"
    save_file({**tensors, "model.layers.99.self_attn.q_proj.lora_A": torch.zeros(8, 128)}, str(unknown), metadata=meta)
    with pytest.raises(LoRAError, match="layers.99.*does not have"):
        LoRAAdapter.load(unknown, tiny)
    # an adapter made for a model with other dimensions: the first mis-shaped tensor is named
    torch.manual_seed(0)
    other = K3ForCausalLM(K3Config.preset("tiny").replace(hidden_size=96))
    with pytest.raises(LoRAError, match=r"tensor 'model\.layers\.\d+\..*' has shape"):
        LoRAAdapter.load(good, other)
    with pytest.raises(LoRAError, match="do not fit the model"):
        LoRAManager(other).add("x", ad)


def test_multi_lora_batch_matches_each_adapter_alone(tiny):
    ids = _ids(tiny, b=5, t=9)
    mgr = LoRAManager(tiny)
    mgr.create("a", _cfg(ALL), seed=1)
    mgr.create("b", _cfg(("attn",), rank=4), seed=2)
    mgr.create("c", _cfg(("experts", "mlp")), seed=3)
    rows = ["a", None, "b", "c", "a"]
    with mgr.use(rows):
        mixed = _logits(tiny, ids)
    alone = {}
    for name in ("a", "b", "c", None):
        with mgr.use(name):
            alone[name] = _logits(tiny, ids)
    for i, name in enumerate(rows):
        # bitwise: the model's linear (and so each adapter's low-rank path) is batch-invariant on CPU
        assert torch.equal(mixed[i], alone[name][i]), (i, name)
        others = [alone[n][i] for n in ("a", "b", "c", None) if n != name]
        assert all((mixed[i] - o).abs().max() > 1e-3 for o in others)  # the adapters really differ
    # per-token slots give the same as per-row names
    slots = torch.tensor([[-1 if n is None else mgr.slot(n)] * ids.shape[1] for n in rows])
    with mgr.use(slots):
        assert torch.equal(_logits(tiny, ids), mixed)


def test_multi_lora_decode_matches_full_forward(tiny):
    ids = _ids(tiny, b=2, t=12)
    mgr = LoRAManager(tiny)
    mgr.create("a", _cfg(ALL), seed=1)
    mgr.create("b", _cfg(ALL), seed=2)
    with torch.no_grad(), mgr.use(["a", "b"]):
        full = tiny(ids, use_cache=False).logits
        first, state = tiny.extend(ids[:, :8])
        rest = [first]
        for t in range(8, 12):
            step, state = tiny.extend(ids[:, t:t + 1], state)
            rest.append(step)
    assert (torch.cat(rest, 1) - full).abs().max() < 1e-4


def test_multi_lora_gradients_reach_only_the_rows_adapter(tiny):
    ids = _ids(tiny, b=2, t=6)
    mgr = LoRAManager(tiny)
    a = mgr.create("a", _cfg(ALL), seed=1)
    b = mgr.create("b", _cfg(ALL), seed=2)
    with mgr.use(["a", "b"]):
        out = tiny(ids, use_cache=False).logits
    out[0].logsumexp(-1).sum().backward()  # row 0 only: adapter a
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in a.lora_B.values() if p.dim() == 2)
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in b.parameters())


def test_selection_errors(tiny):
    mgr = LoRAManager(tiny)
    mgr.create("a", _cfg(("attn",)))
    ids = _ids(tiny, b=2, t=4)
    with pytest.raises(LoRAError, match="no adapter named 'zz'"):
        mgr.activate("zz")
    with pytest.raises(LoRAError, match="no adapter named 'zz'"):
        mgr.activate(["a", "zz"])
    with pytest.raises(LoRAError, match="3 entries but input_ids has 2 rows"):
        with mgr.use(["a", None, "a"]):
            tiny(ids, use_cache=False)
    with pytest.raises(LoRAError, match="slots"):
        mgr.activate(torch.full((2, 4), 7))
    with pytest.raises(LoRAError, match="shape"):
        with mgr.use(torch.zeros(2, 5, dtype=torch.long)):
            tiny(ids, use_cache=False)
    with pytest.raises(LoRAError, match="already added"):
        mgr.create("a", _cfg(("attn",)))
    mgr.activate("a")
    mgr.remove("a")
    assert mgr.selection is None
    b = mgr.create("b", _cfg(("attn",)))
    mgr.activate(torch.full((2, 4), mgr.slot("b")))
    mgr.remove("b")
    assert mgr.selection is None
    with pytest.raises(LoRAError, match="already has a LoRAManager"):
        LoRAManager(tiny)
    mgr.close()
    LoRAManager(tiny).add("b", b)


def test_captured_plan_refusals_and_signature(tiny):
    """The captured plan (k3.rollout.graphs' forwards) refuses what it cannot run without host reads, naming why;
    `signature` changes with every adapter added, removed or merged (the graphs' key)."""
    mgr = LoRAManager(tiny)
    assert mgr.signature() == () and mgr.capturable()
    mgr.create("a", _cfg(("attn", "mlp")))
    sig = mgr.signature()
    with pytest.raises(LoRAError, match="int64 \\[6\\]"):
        mgr.captured_plan(torch.zeros(4, dtype=torch.long), 2, 3)
    with pytest.raises(LoRAError, match="int64"):
        mgr.captured_plan(torch.zeros(6, dtype=torch.int32), 2, 3)
    plan = mgr.captured_plan(torch.full((6,), mgr.slot("a")), 2, 3)
    with torch.no_grad(), mgr.use("a"):
        want = tiny(_ids(tiny, b=2, t=3), use_cache=False).logits
    with torch.no_grad(), mgr.use_plan(plan):
        got = tiny(_ids(tiny, b=2, t=3), use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)   # one adapter: the single path vs the per-row one
    mgr.create("e", _cfg(("experts",)))
    assert not mgr.capturable() and mgr.signature() != sig
    with pytest.raises(LoRAError, match="routed experts"):
        mgr.captured_plan(torch.zeros(6, dtype=torch.long), 2, 3)
    mgr.remove("e")
    mgr.merge("a")
    assert mgr.signature() is None
    with pytest.raises(LoRAError, match="merged"):
        mgr.captured_plan(torch.zeros(6, dtype=torch.long), 2, 3)
    mgr.unmerge()
    mgr.close()


def test_k3_preset_default_adapter_on_meta():
    """The K3 preset's default adapter (rank 64 on attention + dense MLP + shared experts), shapes only."""
    cfg = K3Config.preset("k3")
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, init=False)
    ad = LoRAAdapter.for_model(model, LoRAConfig.preset("k3"))
    n_mla = sum(not cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    n_kda = cfg.num_hidden_layers - n_mla
    assert ad.config.rank == 64 and len(ad.targets) == 6 * n_mla + 8 * n_kda + 3 * cfg.num_hidden_layers
    assert ad.A("model.layers.3.self_attn.kv_b_proj").shape == (64, cfg.kv_lora_rank)
    assert ad.A("model.layers.3.self_attn.kv_b_proj").is_meta
    r = 64
    want = sum(r * (t.in_features + t.out_features) for t in ad.targets.values())
    assert ad.num_parameters() == want
    print(f"\nK3 default LoRA (rank 64, attn+mlp): {len(ad.targets)} targets, {want / 1e6:.1f} M parameters")


def test_mixed_adapters_inside_a_row_cannot_decode_over_the_mla_cache(tiny):
    mgr = LoRAManager(tiny)
    mgr.create("a", _cfg(("attn",)), seed=1)
    ids = _ids(tiny, b=2, t=4)
    mixed = torch.tensor([[0, 0, -1, -1], [-1, -1, -1, -1]])
    with torch.no_grad(), mgr.use(mixed):
        _, state = tiny.extend(ids)  # a prefill sees each token once: fine
    with torch.no_grad(), mgr.use(torch.tensor([[0], [-1]])):
        tiny.extend(ids[:, :1], state)  # one adapter per row: fine
    with torch.no_grad(), mgr.use(torch.tensor([[0, -1], [-1, -1]])):
        with pytest.raises(LoRAError, match="kv_b_proj reads 6 positions per row"):
            tiny.extend(ids[:, :2], state)
