"""Triton-interpreter fixes for the CPU runs of the kernel tests (tests/conftest.py has set TRITON_INTERPRET=1 where
there is no CUDA). Triton 3.6's interpreter keeps bfloat16 as raw uint16 bits and documents bf16 arithmetic as
unsupported (triton-lang/triton#11584): `tl.dot` multiplies the bit patterns, and fp32 -> bf16 casts truncate where
the GPU rounds to nearest even. With the two fixes below, the bf16 paths of the kernels (bf16 intermediates, bf16
dots in the state passes) run on CPU with the GPU's rounding."""
import numpy as np
import torch

if not torch.cuda.is_available():
    import triton.language as tl
    from triton.runtime import interpreter as _interp

    _Builder = _interp.InterpreterBuilder
    if not getattr(_Builder, "k3_bf16_fix", False):
        _create_dot, _cast_impl = _Builder.create_dot, _Builder.cast_impl

        def _bf16_as_fp32(h: _interp.TensorHandle) -> _interp.TensorHandle:
            if h.dtype.scalar != tl.bfloat16:
                return h
            bf16 = torch.from_numpy(np.ascontiguousarray(h.data).view(np.int16)).view(torch.bfloat16)
            return _interp.TensorHandle(bf16.float().numpy(), tl.float32)

        def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc, _orig=_create_dot):
            return _orig(self, _bf16_as_fp32(a), _bf16_as_fp32(b), d, input_precision, max_num_imprecise_acc)

        def _cast_impl(self, src, dst_type, _orig=_cast_impl):
            if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
                return _orig(self, src, dst_type)
            bf16 = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)  # RTNE
            return _interp.TensorHandle(bf16.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

        _Builder.create_dot, _Builder.cast_impl, _Builder.k3_bf16_fix = _create_dot, _cast_impl, True

    if not getattr(_interp._patch_lang_tensor, "k3_index_fix", False):
        # triton 3.6's interpreter turns a scalar tensor into an index with int() of a size-1 array, which
        # numpy >= 2.3 refuses (loop bounds such as a sequence's chunk count); later triton squeezes first.
        _orig_patch = _interp._patch_lang_tensor

        def _patch_lang_tensor(tensor, scope):
            _orig_patch(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
        _patch_lang_tensor.k3_index_fix = True
        _interp._patch_lang_tensor = _patch_lang_tensor
