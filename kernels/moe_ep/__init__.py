"""Expert-parallel MoE (issue #29 item 1): the dispatch / local experts / combine pipeline over micro-batches, its
spec (naive.py: the single-device layer over all experts on the ranks' tokens in rank order) and its config."""
from .naive import naive_ep_layer, naive_local_experts, naive_local_experts_fp8
from .pipeline import ep_moe_experts, ep_moe_layer
from .plan import Compute, EPConfig, Step, micro_batch_bounds, schedule

__all__ = ["Compute", "EPConfig", "Step", "ep_moe_experts", "ep_moe_layer", "micro_batch_bounds", "naive_ep_layer",
           "naive_local_experts", "naive_local_experts_fp8", "schedule"]
