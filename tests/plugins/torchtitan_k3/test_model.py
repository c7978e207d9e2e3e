"""The TorchTitan model, registry, adapter, validation and data pieces, in process (no spawned ranks)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.protocols.model_spec import ModelSpec

import k3_torchtitan
from k3.config import K3Config
from k3.model import K3ForCausalLM, count_parameters
from k3.model.adapter import CheckpointError
from k3_torchtitan import K3StateDictAdapter, K3TitanModel, ParallelismError, model_registry
from k3_torchtitan.data import ArithmeticDataLoader, ByteTokenizer, recorded_routing
from k3_torchtitan.parallelize import validate_parallelism

K3_TOTAL = 2_779_484_476_000


def _tiny_pair(seed: int = 0):
    """A k3.model tiny model with non-trivial AttnRes / router-bias values, and its config."""
    torch.manual_seed(seed)
    ref = K3ForCausalLM(K3Config.preset("tiny"))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("_res_proj.weight") or name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.5)
    return ref


def _titan_from(ref: K3ForCausalLM, tmp_path) -> K3TitanModel:
    """The TorchTitan model loaded from `ref`'s safetensors checkpoint through the state-dict adapter."""
    ref.save_pretrained(tmp_path)
    cfg = K3TitanModel.Config(k3=ref.config)
    hf = load_file(str(tmp_path / "model.safetensors"))
    model = cfg.build()
    model.load_state_dict(K3StateDictAdapter(cfg, None).from_hf(hf), strict=True)
    return model


@pytest.mark.parametrize("flavor", sorted(k3_torchtitan.FLAVORS))
def test_registry_builds_a_model_spec_per_flavor(flavor):
    spec = model_registry(flavor)
    assert isinstance(spec, ModelSpec) and spec.name == "k3" and spec.flavor == flavor
    assert spec.parallelize_fn is k3_torchtitan.parallelize_k3 and spec.state_dict_adapter is K3StateDictAdapter
    assert spec.model.k3 == K3Config.preset(k3_torchtitan.FLAVORS[flavor])


def test_unknown_flavor_is_named():
    with pytest.raises(ValueError, match="flavor: unknown 'k3_huge'"):
        model_registry("k3_huge")


@pytest.mark.parametrize("flavor", sorted(k3_torchtitan.FLAVORS))
def test_nparams_agree_with_k3_model_count_parameters(flavor):
    cfg = model_registry(flavor).model
    with torch.device("meta"):
        model = cfg.build()
    n, flops = cfg.get_nparams_and_flops(model, 4096)
    assert n == count_parameters(cfg.k3)["total"] == sum(p.numel() for p in model.parameters())
    if flavor == "k3":
        assert n == K3_TOTAL
    assert flops > 6 * (count_parameters(cfg.k3)["active"] - cfg.k3.vocab_size * cfg.k3.hidden_size)
    assert cfg.get_nparams_and_flops(model, 8192)[1] > flops  # attention grows with the sequence


def test_k3_checkpoint_loads_with_identical_logits_and_back(tmp_path):
    ref = _tiny_pair()
    titan = _titan_from(ref, tmp_path / "ckpt")
    ids = torch.randint(0, ref.config.vocab_size, (2, 40))
    with torch.no_grad():
        assert torch.equal(titan(ids), ref(ids, use_cache=False).logits)
    # back: the TorchTitan state dict in the published names is the checkpoint, bit for bit
    hf = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    back = K3StateDictAdapter(K3TitanModel.Config(k3=ref.config), None).to_hf(titan.state_dict())
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert any(".block_sparse_moe.experts.7.w2.weight" in k for k in back)
    again = K3ForCausalLM(ref.config, init=False)
    again.load_state_dict(titan.state_dict())
    with torch.no_grad():
        assert torch.equal(again(ids, use_cache=False).logits, ref(ids, use_cache=False).logits)


def test_adapter_names_missing_and_misshapen_tensors(tmp_path):
    ref = _tiny_pair()
    ref.save_pretrained(tmp_path)
    hf = load_file(str(tmp_path / "model.safetensors"))
    adapter = K3StateDictAdapter(K3TitanModel.Config(k3=ref.config), None)
    broken = dict(hf)
    broken.pop("model.layers.3.self_attn.kv_b_proj.weight")
    broken["model.norm.weight"] = torch.ones(7)
    with pytest.raises(CheckpointError) as e:
        adapter.from_hf(broken)
    assert "missing: model.layers.3.self_attn.kv_b_proj.weight" in str(e.value)
    assert "shape mismatch: model.norm.weight" in str(e.value)


def test_meta_build_then_init_states_gives_k3_model_init():
    cfg = model_registry("k3_tiny").model
    with torch.device("meta"):
        model = cfg.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    model.init_weights()
    state = model.state_dict()
    assert all(torch.isfinite(t).all() for t in state.values())
    for name, t in state.items():
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        if name.endswith(("_res_proj.weight", "e_score_correction_bias", "A_log")):  # tiny uses the safe gate
            assert torch.equal(t, torch.zeros_like(t)), name
    dt = state["model.layers.0.self_attn.dt_bias"]
    assert 1e-4 < float(torch.nn.functional.softplus(dt).min()) and float(torch.nn.functional.softplus(dt).max()) < 0.11
    w = state["model.layers.2.block_sparse_moe.experts.w1"]
    assert abs(float(w.std()) - 0.02) < 0.002
    logits = model(torch.randint(0, 512, (1, 24)))
    assert logits.shape == (1, 24, 512) and torch.isfinite(logits).all()


def test_verify_module_protocol_names_foreign_modules():
    model = model_registry("k3_tiny").model.build()
    model.model.layers[1].extra = torch.nn.GELU()
    with pytest.raises(RuntimeError, match=r"'model.layers.1.extra' \(torch.nn.modules.activation.GELU\)"):
        model.verify_module_protocol()


def test_router_replay_replays_routing_and_recomputes_gate_weights():
    torch.manual_seed(0)
    model = model_registry("k3_tiny").model.build()
    model.init_weights()
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    own = K3ForCausalLM.forward(model, ids, use_cache=False, return_routed_experts=True).routed_experts
    with torch.no_grad():
        free = model(ids)
        assert torch.equal(model(ids, routed_experts=own), free)  # replaying its own routing changes nothing
    other = recorded_routing(ids, len(cfg.moe_layer_ids), cfg.num_experts_per_token, cfg.num_experts)
    assert not torch.equal(other, own)
    dense_out = []
    hook = model.model.layers[0].register_forward_hook(lambda m, i, o: dense_out.append(o[0].detach()))
    logits = model(ids, routed_experts=other)
    with torch.no_grad():
        model(ids)
    hook.remove()
    assert torch.equal(dense_out[0], dense_out[1])             # before the first MoE layer nothing changes
    replayed = K3ForCausalLM.forward(model, ids, use_cache=False, routed_experts=other,
                                     return_routed_experts=True).routed_experts
    assert torch.equal(replayed, other)                       # the trainer routes exactly as recorded
    assert not torch.allclose(logits, free)
    logits.float().logsumexp(-1).mean().backward()
    for i in cfg.moe_layer_ids:  # gate weights come from the live router: it still learns under replay
        assert model.model.layers[i].block_sparse_moe.gate.weight.grad.abs().sum() > 0
    partly = other.clone()
    partly[:, :5] = -1                                         # unrecorded tokens route freely
    with torch.no_grad():
        mixed = K3ForCausalLM.forward(model, ids, use_cache=False, routed_experts=partly,
                                      return_routed_experts=True).routed_experts
    assert torch.equal(mixed[:, 5:], other[:, 5:])
    with pytest.raises(ValueError, match="routed_experts: expected shape"):
        model(ids, routed_experts=other[:, :, :1])


def _dims(**kw):
    base = dict(tp=1, pp=1, cp=1, ep=1)
    return SimpleNamespace(**(base | kw))


@pytest.mark.parametrize("dims, parallelism, training, compile_enable, field", [
    (dict(tp=2), {}, {}, False, "parallelism.tensor_parallel_degree"),
    (dict(pp=2), {}, {}, False, "parallelism.pipeline_parallel_degree"),
    ({}, {}, {}, True, "compile.enable"),
    ({}, dict(spmd_backend="spmd_types"), {}, False, "parallelism.spmd_backend"),
    (dict(cp=2), dict(context_parallel_load_balancer="headtail"), {}, False,
     "parallelism.context_parallel_load_balancer"),
    (dict(cp=3), {}, dict(seq_len=32), False, "training.seq_len: 32 is not divisible"),
    (dict(cp=2), {}, dict(seq_len=34), False, "training.seq_len: 34 is not divisible by 2 x"),
    (dict(cp=16), {}, dict(seq_len=32), False, "training.seq_len: shards of 2 tokens"),
    (dict(ep=3), {}, {}, False, "parallelism.expert_parallel_degree: 3 does not divide the model's 8 experts"),
])
def test_bad_parallel_settings_name_the_field(dims, parallelism, training, compile_enable, field):
    model = SimpleNamespace(config=K3Config.preset("tiny"))
    par = ParallelismConfig(**({"spmd_backend": "partial_dtensor", "context_parallel_load_balancer": None}
                               | parallelism))
    with pytest.raises(ParallelismError, match=field.replace("(", r"\(").replace(")", r"\)")):
        validate_parallelism(model, parallel_dims=_dims(**dims), training=TrainingConfig(**({"seq_len": 32} | training)),
                             parallelism=par, compile_config=CompileConfig(enable=compile_enable))


def test_full_k3_expert_parallel_must_divide_896():
    model = SimpleNamespace(config=K3Config.preset("k3"))
    par = ParallelismConfig(spmd_backend="partial_dtensor", context_parallel_load_balancer=None)
    ok = dict(training=TrainingConfig(seq_len=8192), parallelism=par, compile_config=CompileConfig())
    validate_parallelism(model, parallel_dims=_dims(ep=64, cp=8), **ok)
    with pytest.raises(ParallelismError, match="expert_parallel_degree: 48 does not divide the model's 896"):
        validate_parallelism(model, parallel_dims=_dims(ep=48), **ok)


def test_byte_tokenizer_and_dataloader_resume_and_sharding():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("12+7=19\n")) == "12+7=19\n" and max(tok.encode("\xff")) < tok.get_vocab_size()
    cfg = ArithmeticDataLoader.Config(corpus_lines=256)

    def loader(rank, world):
        return cfg.build(dp_world_size=world, dp_rank=rank, tokenizer=tok, seq_len=16, local_batch_size=2)

    one = loader(0, 1)
    it = iter(one)
    (first, labels), (second, _) = next(it), next(it)
    assert torch.equal(first["input"][:, 1:], labels[:, :-1]) and first["positions"].shape == (2, 16)
    state = one.state_dict()
    resumed = loader(0, 1)
    resumed.load_state_dict(state)
    assert torch.equal(next(iter(resumed))[0]["input"], next(it)[0]["input"])
    r0, r1 = next(iter(loader(0, 2)))[0]["input"], next(iter(loader(1, 2)))[0]["input"]
    whole = torch.cat([first["input"], second["input"]])
    assert torch.equal(torch.stack([r0[0], r1[0], r0[1], r1[1]]), whole)  # ranks split one rank's windows
    with pytest.raises(ValueError, match="dataloader.routing_top_k"):
        ArithmeticDataLoader.Config(routing_layers=7, routing_top_k=3, routing_experts=2).build(
            dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=16, local_batch_size=2)


def test_use_cpu_rebinds_torchtitan_device_globals():
    import importlib

    from k3_torchtitan.cpu import _COPIES, use_cpu

    use_cpu()
    for name in _COPIES:
        assert getattr(importlib.import_module(name), "device_type", "cpu") == "cpu", name
    assert callable(torch.distributed.set_timeout)


def test_every_registered_config_is_a_trainer_config_k3_can_run():
    from torchtitan.trainer import Trainer

    import k3_torchtitan.config_registry as registry

    names = [n for n in dir(registry) if n.startswith("k3") and callable(getattr(registry, n))]
    assert {"k3_tiny", "k3_small", "k3", "k3_tiny_cpu", "k3_tiny_lora_cpu", "k3_tiny_r3_cpu"} <= set(names)
    for name in names:
        config = getattr(registry, name)()
        assert isinstance(config, Trainer.Config), name
        assert config.model_spec.name == "k3" and config.training.disable_cuda_graphs, name
        assert config.parallelism.spmd_backend == "partial_dtensor", name
        assert config.parallelism.context_parallel_load_balancer is None, name


@pytest.mark.parametrize("stored", ["published_128", "kimi_linear_4d"])
def test_hf_storage_reader_loads_a_log_layouts_of_published_checkpoints(tmp_path, stored):
    """TorchTitan's initial_load_in_hf steps in process (to_hf -> DCP load with the adapter's reader -> from_hf ->
    load_state_dict) on a 96-KDA-head model whose file stores A_log as the published K3 checkpoint does (F32[128],
    the first 96 the heads') or as Kimi Linear does ([1, 1, 96, 1]): the model gets the file's values."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    cfg = K3Config.preset("tiny")
    cfg = cfg.replace(linear_attn_config={**cfg.linear_attn_config, "num_heads": 96, "head_dim": 4})
    torch.manual_seed(1)
    ref = K3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith(".A_log"):
                p.uniform_(-1, 1)
    ref.save_pretrained(tmp_path)
    hf = load_file(str(tmp_path / "model.safetensors"))
    for k in [k for k in hf if k.endswith(".A_log")]:
        hf[k] = (torch.cat([hf[k], torch.full((32,), 7.0)]) if stored == "published_128"
                 else hf[k].view(1, 1, 96, 1).contiguous())
    save_file(hf, str(tmp_path / "model.safetensors"))
    tcfg = K3TitanModel.Config(k3=cfg)
    model = tcfg.build()
    adapter = K3StateDictAdapter(tcfg, None)
    target = adapter.to_hf(model.state_dict())
    dcp.load(target, storage_reader=adapter.get_hf_storage_reader(str(tmp_path)), no_dist=True)
    model.load_state_dict(adapter.from_hf(target))
    ids = torch.randint(0, cfg.vocab_size, (1, 20))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids, use_cache=False).logits)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.state_dict().items())
