"""Host-side launch helpers shared by the kernels: plain-Python launch arithmetic, because it runs on every call
(triton's own `cdiv` / `next_power_of_2` are constexpr-function objects, ~2 us per call on the host in triton 3.6),
and `CachedLaunch`, which skips Triton's per-launch argument binding once a kernel is compiled."""
from __future__ import annotations

import functools

import torch
import triton
from triton import knobs


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 4 for the CPU interpreter (grids sized from it stay small there)."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def num_programs(n: int, device: torch.device, per_sm: int) -> int:
    """Persistent-grid size: at most `per_sm` programs per SM, at most n (4 under the CPU interpreter)."""
    return max(1, min(n, num_sms(device) * (per_sm if device.type == "cuda" else 1)))


def _spec(arg) -> object:
    """A launch argument's part of the compile key, at least as fine as Triton's own specialisation (dtype and
    16-byte alignment of tensors; == 1, divisibility by 16 and i32 / i64 / u64 range of ints; None is a constant)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, (-2**31 <= arg < 2**31) + (-2**63 <= arg < 2**63)
    return type(arg)


class CachedLaunch:
    """`kernel[grid](*args, **constexprs)` with Triton's per-call binding skipped after the first call.

    `JITFunction.run` binds and specialises every argument in Python on every launch (~20 us of host time per
    launch in triton 3.6, the whole cost of a small norm). This keeps the compiled kernel returned by the first
    launch under a key that refines Triton's specialisation (`_spec`) plus the constexprs and launch options, and
    later launches go straight to its compiled launcher. Runtime arguments are positional, constexprs and launch
    options keyword; the interpreter, launch hooks (profilers), first calls and torch.compile tracing (which
    captures `kernel[grid](...)` as a user-defined Triton kernel, not this cache) take Triton's own path."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict = {}
        self._direct = isinstance(kernel, triton.runtime.JITFunction)

    def __call__(self, grid: tuple, *args, **constexprs) -> None:
        if not self._direct or torch.compiler.is_compiling() or self.kernel.pre_run_hooks or launch_hooks_set():
            self.kernel[grid](*args, **constexprs)
            return
        device = _driver().get_current_device()
        key = (device, tuple(map(_spec, args)), tuple(constexprs.items()))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constexprs)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            names = self.kernel.arg_names[len(args):]
            self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata,
                                   tuple(constexprs[n] for n in names))
            return
        run, function, metadata, tail = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        run(grid[0], g1, g2, _driver().get_current_stream(device), function, metadata, None, None, None, *args,
            *tail)


def launch_hooks_set() -> bool:
    """A Triton launch-enter or launch-exit hook (a profiler) is installed: such launches must go through Triton."""
    return _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)


def _hooked(hook) -> bool:
    """A launch hook is set: None or an empty `HookChain` (triton >= 3.5 never leaves it None) means no hook."""
    return hook is not None and bool(getattr(hook, "calls", True))


@functools.lru_cache(maxsize=None)
def _driver():
    return triton.runtime.driver.active
