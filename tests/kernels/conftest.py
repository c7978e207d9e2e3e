"""Triton-interpreter fixes for the CPU runs of the kernel tests (tests/conftest.py has set TRITON_INTERPRET=1 where
there is no CUDA). Triton 3.6's interpreter keeps bfloat16 as raw uint16 bits and documents bf16 arithmetic as
unsupported (triton-lang/triton#11584): `tl.dot` multiplies the bit patterns, and fp32 -> bf16 casts truncate where
the GPU rounds to nearest even. With the two fixes below, the bf16 paths of the kernels (bf16 intermediates, bf16
dots in the state passes) run on CPU with the GPU's rounding."""
import numpy as np
import pytest
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


class _BoundsGuard:
    """Interpreter-only check that no kernel touches memory outside the tensors it was launched with: every launch
    records the byte extent of each tensor argument (the view's own elements, not its whole storage), and every
    load and store asserts that each address its mask enables lies inside one of them. (On the GPU such an access
    is the "illegal memory access" that leaves the CUDA context unusable, or silent corruption.)"""

    def __init__(self):
        self.kernel, self.lo, self.hi, self.checked = None, np.zeros(0, np.uint64), np.zeros(0, np.uint64), 0

    def launch(self, kernel: str, tensors: list) -> None:
        spans = []
        for t in tensors:
            if t.numel() == 0:
                continue
            last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
            spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()))
        spans.sort()
        self.kernel = kernel
        self.lo = np.array([a for a, _ in spans], dtype=np.uint64)
        self.hi = np.array([b for _, b in spans], dtype=np.uint64)

    def check(self, what: str, ptrs, mask, itemsize: int) -> None:
        addr = np.asarray(ptrs).astype(np.uint64)[np.asarray(mask, dtype=bool)]
        if addr.size == 0:
            return
        self.checked += int(addr.size)
        i = np.searchsorted(self.lo, addr, side="right") - 1
        ok = (i >= 0) & (addr + np.uint64(itemsize) <= self.hi[np.maximum(i, 0)])
        if not ok.all():
            raise AssertionError(f"{self.kernel}: out-of-bounds {what} at {int((~ok).sum())} of {addr.size} "
                                 f"addresses")


def _tensors_of(args) -> list:
    out = []
    for a in args:
        if isinstance(a, tuple):
            out += _tensors_of(a)
        elif isinstance(a, torch.Tensor):
            out.append(a)
    return out


@pytest.fixture
def bounds_guard(monkeypatch):
    """Enable `_BoundsGuard` for one test (CPU interpreter only; yields the guard: `.checked` counts the addresses
    it saw, so a test can assert that kernels ran under it)."""
    if torch.cuda.is_available():
        yield None
        return
    from triton.runtime import interpreter as interp
    guard = _BoundsGuard()
    init = interp.GridExecutor._init_args_hst

    def _init_args_hst(self, args_dev, kwargs):
        args_hst, kwargs_hst = init(self, args_dev, kwargs)
        guard.launch(self.fn.__name__, _tensors_of(list(args_hst) + list(kwargs_hst.values())))
        return args_hst, kwargs_hst

    load, store = interp.InterpreterBuilder.create_masked_load, interp.InterpreterBuilder.create_masked_store

    def create_masked_load(self, ptrs, mask, other, *rest):
        guard.check("load", ptrs.data, mask.data, np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return load(self, ptrs, mask, other, *rest)

    def create_masked_store(self, ptrs, value, mask, *rest):
        guard.check("store", ptrs.data, mask.data, np.dtype(interp._get_np_dtype(ptrs.get_element_ty())).itemsize)
        return store(self, ptrs, value, mask, *rest)
    monkeypatch.setattr(interp.GridExecutor, "_init_args_hst", _init_args_hst)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_load", create_masked_load)
    monkeypatch.setattr(interp.InterpreterBuilder, "create_masked_store", create_masked_store)
    yield guard
