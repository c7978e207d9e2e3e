"""Host-side launch arithmetic shared by the kernels: plain Python, because it runs on every call (triton's own
`cdiv` / `next_power_of_2` are constexpr-function objects, ~2 us per call on the host in triton 3.6)."""
from __future__ import annotations

import functools

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for positive b."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_programs(n: int, device: torch.device, per_sm: int) -> int:
    """Persistent-grid size: at most `per_sm` programs per SM, at most n (4 under the CPU interpreter)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n, _num_sms(index) * per_sm))
    return max(1, min(n, 4))
