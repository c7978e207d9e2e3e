"""Multi-LoRA (Punica-style shrink/expand): `naive_multi_lora` reference and `segments`; `sgmv_lora` and `bgmv_lora`
Triton kernels (imported lazily so that importing this package never needs a GPU or sets Triton's mode)."""
from .naive import naive_lora_expand, naive_lora_shrink, naive_multi_lora, segments

__all__ = ["naive_lora_expand", "naive_lora_shrink", "naive_multi_lora", "segments", "sgmv_lora", "bgmv_lora"]


def __getattr__(name: str):
    if name in ("sgmv_lora", "bgmv_lora"):
        from . import sgmv

        return getattr(sgmv, name)
    raise AttributeError(name)
