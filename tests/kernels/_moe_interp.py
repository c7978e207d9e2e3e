"""Interpreter fix for the FP8 MoE tests (imported by tests/kernels/test_moe*.py on CPU only): triton 3.6's
interpreter converts fp32 -> float8e4nv with its own bit arithmetic, which gets the exponent wrong for some values
(127.66 became 64 where the GPU and torch give 128), and reads e4m3 dot operands through the same path. Here both
directions go through torch's float8_e4m3fn conversion (round to nearest even, as the GPU's cvt does)."""
import numpy as np
import torch

if not torch.cuda.is_available():
    import triton.language as tl
    from triton.runtime import interpreter as _interp

    _Builder = _interp.InterpreterBuilder
    if not getattr(_Builder, "k3_fp8_fix", False):
        _fp_to_fp, _create_dot = _Builder.create_fp_to_fp, _Builder.create_dot

        def _e4m3_to_f32(data: np.ndarray) -> np.ndarray:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8)).view(torch.float8_e4m3fn)
            return t.float().numpy()

        def create_fp_to_fp(self, src, dst_type, rounding_mode, _orig=_fp_to_fp):
            s, d = src.dtype.scalar, dst_type.scalar
            if s == tl.float32 and d == tl.float8e4nv:
                t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.float8_e4m3fn)
                return _interp.TensorHandle(t.view(torch.uint8).numpy(), tl.float8e4nv)
            if s == tl.float8e4nv and d == tl.float32:
                return _interp.TensorHandle(_e4m3_to_f32(src.data), tl.float32)
            return _orig(self, src, dst_type, rounding_mode)

        def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc, _orig=_create_dot):
            if a.dtype.scalar == tl.float8e4nv:
                a = _interp.TensorHandle(_e4m3_to_f32(a.data), tl.float32)
            if b.dtype.scalar == tl.float8e4nv:
                b = _interp.TensorHandle(_e4m3_to_f32(b.data), tl.float32)
            return _orig(self, a, b, d, input_precision, max_num_imprecise_acc)

        _Builder.create_fp_to_fp, _Builder.create_dot, _Builder.k3_fp8_fix = create_fp_to_fp, create_dot, True
