"""K3's latent-MoE routed experts: the plain-torch spec (naive.py) and the Triton kernels (router, permutation,
grouped GEMMs with SiTU, FP8 quantisation, MXFP4 dequantisation) behind one autograd Function (layer.py). The
Triton modules are imported lazily so that importing this package never needs a GPU or sets Triton's mode."""
from .naive import (naive_combine, naive_dequant_mxfp4, naive_experts, naive_experts_fp8, naive_moe_layer,
                    naive_permutation, naive_permute, naive_quant_rows, naive_quant_weight, naive_router)

__all__ = ["naive_combine", "naive_dequant_mxfp4", "naive_experts", "naive_experts_fp8", "naive_moe_layer",
           "naive_permutation", "naive_permute", "naive_quant_rows", "naive_quant_weight", "naive_router",
           "Precision", "moe_experts", "fused_router", "dequantize_mxfp4", "quantize_weight_fp8", "plan_routing",
           "permute_rows", "combine"]

_LAZY = {"Precision": "layer", "moe_experts": "layer", "fused_router": "router", "dequantize_mxfp4": "quant",
         "quantize_weight_fp8": "quant", "plan_routing": "permute", "permute_rows": "permute", "combine": "permute"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)
