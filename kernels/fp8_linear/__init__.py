"""Weight-only FP8 linear for skinny inputs (the trained draft head's steps: a few rows against K3-width matrices,
bound by the bytes of the weights): e4m3 weights with one fp32 scale per output row, activations in bf16 / fp32.
`naive.py` is the spec; `gemv.py` the Triton kernel (imported lazily so that importing this package never needs a
GPU or sets Triton's mode)."""
from .naive import naive_fp8_weight_linear, quantize_weight_rows

__all__ = ["naive_fp8_weight_linear", "quantize_weight_rows", "fp8_weight_linear"]


def __getattr__(name: str):
    if name == "fp8_weight_linear":
        from . import gemv

        return gemv.fp8_weight_linear
    raise AttributeError(name)
