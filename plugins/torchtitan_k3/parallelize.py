"""`parallelize_k3`: the ModelSpec's parallelize_fn (TorchTitan calls it on the meta-device model before
`to_empty` and `init_weights`). Order, as TorchTitan's own models: validate -> context parallel -> expert
parallel -> activation checkpointing -> FSDP2 (one unit per decoder layer, explicit forward/backward prefetch;
routed experts on the expert-FSDP mesh when EP > 1)."""
from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.moe import LatentMoE

from .context_parallel import CPGatedMLA, CPKimiDeltaAttention
from .expert_parallel import EPRoutedExperts


class ParallelismError(ValueError):
    """A parallel setting K3 cannot run; the message names the offending config field."""


def validate_parallelism(model, *, parallel_dims, training, parallelism, compile_config) -> None:
    """Every unsupported or inconsistent combination, before anything is changed on the model."""
    cfg = model.config
    if parallel_dims.tp > 1:
        raise ParallelismError(f"parallelism.tensor_parallel_degree: {parallel_dims.tp} is not supported for K3 "
                               "(FSDP2 + EP + CP only); use 1")
    if parallel_dims.pp > 1:
        raise ParallelismError(f"parallelism.pipeline_parallel_degree: {parallel_dims.pp} is not supported for K3 "
                               "(the AttnRes block bank crosses stages); use 1")
    if compile_config.enable:
        raise ParallelismError("compile.enable: torch.compile of the K3 layers is not supported; use false")
    if parallelism.spmd_backend != "partial_dtensor":
        raise ParallelismError(f"parallelism.spmd_backend: {parallelism.spmd_backend!r} is not supported for K3; "
                               "use 'partial_dtensor'")
    if parallel_dims.cp > 1:
        cp, seq = parallel_dims.cp, training.seq_len
        if parallelism.context_parallel_load_balancer is not None:
            raise ParallelismError(
                f"parallelism.context_parallel_load_balancer: {parallelism.context_parallel_load_balancer!r}; K3's "
                "KDA layers pass their recurrent state from shard to shard, so shards must be contiguous: use None")
        if seq % (2 * cp):
            raise ParallelismError(f"training.seq_len: {seq} is not divisible by 2 x "
                                   f"parallelism.context_parallel_degree {cp} (MLA's load-balanced causal CP cuts "
                                   "the sequence into 2 x CP chunks)")
        if seq // cp < cfg.conv_kernel_size - 1:
            raise ParallelismError(f"training.seq_len: shards of {seq // cp} tokens are shorter than the short "
                                   f"convolution's history ({cfg.conv_kernel_size - 1}); lower "
                                   "parallelism.context_parallel_degree")
    if parallel_dims.ep > 1:
        ep = parallel_dims.ep
        if not cfg.moe_layer_ids:
            raise ParallelismError(f"parallelism.expert_parallel_degree: {ep} but the model has no MoE layers")
        if cfg.num_experts % ep:
            raise ParallelismError(f"parallelism.expert_parallel_degree: {ep} does not divide the model's "
                                   f"{cfg.num_experts} experts")


def parallelize_k3(model, *, parallel_dims, training, parallelism, compile_config, ac_config, dump_folder: str):
    validate_parallelism(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                         compile_config=compile_config)
    layers = model.model.layers
    if parallel_dims.cp > 1:
        group = parallel_dims.get_mesh("cp").get_group()
        model.cp_group = group
        for layer in layers:
            attn = layer.self_attn
            attn.__class__ = CPKimiDeltaAttention if isinstance(attn, KimiDeltaAttention) else CPGatedMLA
            attn.cp_group = group
    expert_params: set[nn.Parameter] = set()
    if parallel_dims.ep > 1:
        ep_mesh = parallel_dims.get_mesh("ep")
        for layer in layers:
            if isinstance(getattr(layer, "block_sparse_moe", None), LatentMoE):
                experts = layer.block_sparse_moe.experts
                experts.__class__ = EPRoutedExperts
                experts.ep_group = ep_mesh.get_group()
                for name in ("w1", "w2", "w3"):
                    p = getattr(experts, name)
                    sharded = nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)]), requires_grad=p.requires_grad)
                    experts.register_parameter(name, sharded)
                    expert_params.add(sharded)
    if ac_config is not None:
        policy = ac_config.build(dump_folder=dump_folder)
        for i, layer in enumerate(layers):
            layers[i] = policy._wrap_block(layer, base_fqn=f"model.layers.{i}")
        logger.info(f"K3: {type(policy).__name__} activation checkpointing on {len(layers)} decoder layers")
    if parallel_dims.fsdp_enabled or parallel_dims.cp > 1 or parallel_dims.ep > 1:
        apply_fsdp(model, parallel_dims, training, parallelism, expert_params)
    return model


def apply_fsdp(model, parallel_dims, training, parallelism, expert_params: set[nn.Parameter]) -> None:
    """FSDP2: the embedding and each decoder layer as units, the root holding the output head. SUM reductions with no division (the loss is already normalised by the global
    token count, and gloo has no PREMUL_SUM); explicit prefetch of the next layer's all-gather in forward and the
    previous one's in backward."""
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_mesh(names)
    mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                              reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce], cast_forward_inputs=False)
    kw = {"mesh": dp_mesh, "mp_policy": mp}
    reshard = parallelism.fsdp_reshard_after_forward != "never"
    inner = model.model
    fully_shard(inner.embed_tokens, **kw, reshard_after_forward=reshard)
    placement_fn = _expert_placement(parallel_dims, dp_mesh, expert_params) if expert_params else None
    units = []
    for layer in inner.layers:
        fully_shard(layer, **kw, reshard_after_forward=reshard, shard_placement_fn=placement_fn)
        units.append(layer)
    # the root unit holds the output head (final AttnRes mix, norm, lm_head): the mix reads those weights directly,
    # not through their modules' forward, so they must be gathered by the root's pre-forward
    fully_shard(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    for i, layer in enumerate(units):
        if i + 1 < len(units):
            layer.set_modules_to_forward_prefetch([units[i + 1]])
        if i > 0:
            layer.set_modules_to_backward_prefetch([units[i - 1]])


def _expert_placement(parallel_dims, dp_mesh, expert_params: set[nn.Parameter]):
    """Routed experts (already Shard(0) on "ep") shard over "efsdp"; every other parameter over the dense mesh
    (TorchTitan's own per-parameter mesh choice for MoE layers, distributed/fsdp.py)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    names = ["dp_replicate", "efsdp"] if parallel_dims.dp_replicate_enabled else ["efsdp"]
    edp_info = _get_mesh_info(parallel_dims.get_mesh(names), None)
    dp_info = _get_mesh_info(dp_mesh, None)

    def placement(param: nn.Parameter) -> ShardPlacementResult:
        if param in expert_params:
            return ShardPlacementResult(placement=Shard(0), mesh_info=edp_info)
        return ShardPlacementResult(placement=Shard(0), mesh_info=dp_info)

    return placement
