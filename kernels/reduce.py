"""Fixed-order column sum of per-program partials: the deterministic reduction behind the weight gradients of
the norms and AttnRes (each program of a persistent backward writes one fp32 row of partials; no atomics)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import CachedLaunch, cdiv


@triton.jit
def _colsum_kernel(part_ptr, out_ptr, P, D, BLOCK_P: tl.constexpr, BLOCK: tl.constexpr):
    """out[d] = sum_p part[p, d]: BLOCK_P-row chunks (fixed tree) summed in chunk order, stored in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    rows = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        m = ((p0 + rows) < P)[:, None] & mask[None, :]
        acc += tl.sum(tl.load(part_ptr + (p0 + rows)[:, None].to(tl.int64) * D + offs[None, :], mask=m, other=0.0),
                      axis=0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_launch_colsum = CachedLaunch(_colsum_kernel)


def colsum(part: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Column sum of a contiguous [P, D] fp32 partials buffer -> [D] in `dtype` (one launch, rounding once)."""
    P, D = part.shape
    out = torch.empty(D, device=part.device, dtype=dtype)
    BLOCK = 256
    _launch_colsum((cdiv(D, BLOCK),), part, out, P, D, BLOCK_P=32, BLOCK=BLOCK, num_warps=4)
    return out
