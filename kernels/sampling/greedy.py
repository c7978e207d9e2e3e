"""Greedy pick (spec: naive.py) in one Triton kernel: program r reads row r in BLOCK_V steps from the first column,
twice -- the running maximum and its first index, then sum exp(x - max) -- in fp32, so a row's token and log-prob
depend only on the row: the same bits whether the call holds it alone (a decode step of one sequence), among a
batch's rows, or among a speculative verify's positions. Only the token and one float per row leave the device (the
engine's sampler copied whole [vocab] rows to the host and ran argmax and log-softmax there, ~1 ms a row at a
163,840-token vocabulary)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit(do_not_specialize=["R"])
def _greedy_pick(x_ptr, tok_ptr, lp_ptr, R, V: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    idx = tl.full([], 0, tl.int32)
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        x = tl.load(x_ptr + r * V + c, mask=c < V, other=float("-inf")).to(tl.float32)
        bm = tl.max(x, 0)
        bi = tl.argmax(x, 0, tie_break_left=True)
        idx = tl.where(bm > m, c0 + bi, idx)   # strictly greater: an earlier block's equal maximum stays first
        m = tl.maximum(m, bm)
    s = tl.zeros([], tl.float32)
    for c0 in range(0, V, BLOCK):
        c = c0 + cols
        x = tl.load(x_ptr + r * V + c, mask=c < V, other=float("-inf")).to(tl.float32)
        s += tl.sum(tl.exp(x - m), 0)
    tl.store(tok_ptr + r, idx.to(tl.int64))
    tl.store(lp_ptr + r, -tl.log(s))


def greedy_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] (fp32 / bf16 / fp16, any device Triton runs on) -> (tok [R] int64, logprob [R] fp32), on the
    logits' device."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits: expected [R, V] with V >= 1, got {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits: dtype {logits.dtype} is not fp32 / bf16 / fp16")
    R, V = logits.shape
    x = logits.detach().contiguous()
    if x.data_ptr() % 16:   # a view at an odd offset would change the loads' vectorisation, hence the sums' order
        x = x.clone()
    tok = torch.empty(R, dtype=torch.int64, device=x.device)
    lp = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        _greedy_pick[(R,)](x, tok, lp, R, V=V, BLOCK=BLOCK_V)
    return tok, lp
