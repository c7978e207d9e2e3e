"""KDA's per-token inputs in one Triton launch: short conv + SiLU (+ L2 norm for q, k) of the three projections, the
gate, beta's sigmoid and the rolled conv windows (`naive.naive_kda_step_inputs` is the spec).

Inference runs this once per KDA layer and call (decode, prefill, a speculative verify, the speculative commit's
rebuild of k, v, g, beta from stored projections), where the plain-torch composition takes ~50 small launches. One
program computes one token of one head from that token's own W conv taps, so a token's bits depend neither on how
many tokens share the call nor on the rows beside it: a decode step, the same token among a verify's k+1 positions
and the commit's rebuild agree bit for bit (tests/kernels/test_kda_step_inputs.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3_kernels.launch import CachedLaunch, next_pow2

from .gate import gate_activation, gate_mode


@triton.jit
def _full_at(x, sx_b, sx_t, win, sw_b, sw_c, sw_j, bi, p, c, cm, W1: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Channels c of row bi at position p of [window | x] (the window's W-1 columns, then the call's tokens), in
    x's dtype (zeros for the window without HAS_WINDOW)."""
    from_x = p >= W1
    val = tl.load(x + bi * sx_b + (p - W1) * sx_t + c, mask=cm & from_x, other=0.)
    if HAS_WINDOW:
        old = tl.load(win + bi * sw_b + c * sw_c + p * sw_j, mask=cm & (p < W1), other=0.)
        val = tl.where(from_x, val, old.to(x.dtype.element_ty))
    return val


@triton.jit
def _conv_silu(x, sx_b, sx_t, win, sw_b, sw_c, sw_j, taps, bi, t, c, cm, W: tl.constexpr, BK: tl.constexpr,
               HAS_WINDOW: tl.constexpr):
    """SiLU(ShortConv) of token t's channels c (fp32, rounded through x's dtype as the spec's two ops are):
    [window | x] position t + j times tap j, taps in order."""
    acc = tl.zeros([BK], dtype=tl.float32)
    for j in tl.static_range(W):
        val = _full_at(x, sx_b, sx_t, win, sw_b, sw_c, sw_j, bi, t + j, c, cm, W - 1, HAS_WINDOW).to(tl.float32)
        acc += val * tl.load(taps + c * W + j, mask=cm, other=0.).to(tl.float32)
    y = acc.to(x.dtype.element_ty).to(tl.float32)
    return (y / (1. + tl.exp(-y))).to(x.dtype.element_ty)


@triton.jit
def _l2norm(y, cm, eps):
    yf = tl.where(cm, y.to(tl.float32), 0.)
    return (yf * (1. / tl.sqrt(tl.sum(yf * yf, 0) + eps))).to(y.dtype)


@triton.jit
def _roll_window(x, sx_b, sx_t, win, sw_b, sw_c, sw_j, out, so_b, so_c, bi, n, c, cm, W: tl.constexpr,
                 HAS_WINDOW: tl.constexpr):
    """The window after the row's first n tokens: positions n .. n+W-2 of [window | x], in x's dtype."""
    for j in tl.static_range(W - 1):
        val = _full_at(x, sx_b, sx_t, win, sw_b, sw_c, sw_j, bi, n + j, c, cm, W - 1, HAS_WINDOW)
        tl.store(out + bi * so_b + c * so_c + j, val, mask=cm)


@triton.jit
def _step_inputs_kernel(xq, xk, xv, sx_b, sx_t, f, sf_b, sf_t, b, sb_b, sb_t, win, sw_b, sw_s, sw_c, sw_j,
                        taps_q, taps_k, taps_v, A_log, dt_bias, q_out, k_out, v_out, g_out, beta_out, win_out,
                        roll, T, H, K, lower_bound, eps, W: tl.constexpr, BK: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, WITH_Q: tl.constexpr, GATE: tl.constexpr,
                        HAS_ROLL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)   # token b * T + t
    h = tl.program_id(1).to(tl.int64)
    bi = row // T
    t = row % T
    ok = tl.arange(0, BK)
    cm = ok < K
    c = h * K + ok
    C = H * K
    out = row * C + c   # [B, T, H, K] contiguous
    if WITH_Q:
        q = _conv_silu(xq, sx_b, sx_t, win, sw_b, sw_c, sw_j, taps_q, bi, t, c, cm, W, BK, HAS_WINDOW)
        tl.store(q_out + out, _l2norm(q, cm, eps), mask=cm)
    k = _conv_silu(xk, sx_b, sx_t, win + sw_s, sw_b, sw_c, sw_j, taps_k, bi, t, c, cm, W, BK, HAS_WINDOW)
    tl.store(k_out + out, _l2norm(k, cm, eps), mask=cm)
    v = _conv_silu(xv, sx_b, sx_t, win + 2 * sw_s, sw_b, sw_c, sw_j, taps_v, bi, t, c, cm, W, BK, HAS_WINDOW)
    tl.store(v_out + out, v, mask=cm)
    x = (tl.load(f + bi * sf_b + t * sf_t + c, mask=cm, other=0.).to(tl.float32)
         + tl.load(dt_bias + c, mask=cm, other=0.).to(tl.float32))
    g = gate_activation(x, tl.exp(tl.load(A_log + h).to(tl.float32)), lower_bound, GATE, True)
    tl.store(g_out + out, g, mask=cm)
    beta = tl.load(b + bi * sb_b + t * sb_t + h).to(tl.float32)
    tl.store(beta_out + row * H + h, tl.sigmoid(beta))
    if t == T - 1:   # the token that ends its row writes the row's rolled windows for this head's channels
        W1: tl.constexpr = W - 1
        so_b = 3 * C * W1
        n = T
        if HAS_ROLL:   # a speculative commit: the row keeps its first roll[b] tokens (clamped to [0, T]: a bad
            n = tl.minimum(tl.maximum(tl.load(roll + bi).to(tl.int64), 0), T)   # value cannot read outside the row)
        _roll_window(xq, sx_b, sx_t, win, sw_b, sw_c, sw_j, win_out, so_b, W1, bi, n, c, cm, W, HAS_WINDOW)
        _roll_window(xk, sx_b, sx_t, win + sw_s, sw_b, sw_c, sw_j, win_out + C * W1, so_b, W1, bi, n, c, cm, W,
                     HAS_WINDOW)
        _roll_window(xv, sx_b, sx_t, win + 2 * sw_s, sw_b, sw_c, sw_j, win_out + 2 * C * W1, so_b, W1, bi, n, c,
                     cm, W, HAS_WINDOW)


_launch = CachedLaunch(_step_inputs_kernel)


def fused_kda_step_inputs(xq: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, f: torch.Tensor, b: torch.Tensor,
                          windows: torch.Tensor | None, conv_weights: tuple[torch.Tensor, ...], A_log: torch.Tensor,
                          dt_bias: torch.Tensor, lower_bound: float | None, eps: float = 1e-6,
                          with_q: bool = True, roll: torch.Tensor | None = None):
    """`naive_kda_step_inputs` in one launch (same arguments and outputs; inference only, no autograd). xq, xk, xv
    share one layout (any batch / token strides, channels contiguous), as do f and b. `roll` [B] (integers in
    [0, T], not read back: a CUDA graph may capture the call) rolls each row's windows by its own count."""
    B, T, C = xk.shape
    H = b.shape[-1]
    K = C // H
    W = conv_weights[0].shape[-1]
    if H * K != C or xq.shape != xk.shape or xv.shape != xk.shape or f.shape != xk.shape or b.shape[:2] != (B, T):
        raise ValueError(f"KDA step inputs: xq {tuple(xq.shape)}, xk {tuple(xk.shape)}, xv {tuple(xv.shape)}, "
                         f"f {tuple(f.shape)} must be [B, T, H*K] and b {tuple(b.shape)} [B, T, H]")
    if windows is not None and tuple(windows.shape) != (B, 3, C, W - 1):
        raise ValueError(f"KDA step inputs: windows {tuple(windows.shape)} must be {(B, 3, C, W - 1)}")
    if W < 2:
        raise ValueError(f"KDA step inputs: conv kernel size {W} must be >= 2")
    for name, w in zip(("q", "k", "v"), conv_weights):   # the kernel reads taps c * W + j of each
        if w.numel() != C * W or w.shape[0] != C:
            raise ValueError(f"KDA step inputs: conv_weights[{name}] {tuple(w.shape)} must be [{C}, 1, {W}]")
    if A_log.numel() != H or dt_bias.numel() != C:
        raise ValueError(f"KDA step inputs: A_log ({A_log.numel()} elements) must have H={H} and dt_bias "
                         f"({dt_bias.numel()}) H*K={C}")
    tensors = dict(xq=xq, xk=xk, xv=xv, f=f, b=b, A_log=A_log, dt_bias=dt_bias, **dict(zip(
        ("conv_weights[q]", "conv_weights[k]", "conv_weights[v]"), conv_weights)),
        **({"windows": windows} if windows is not None else {}))
    off = [name for name, x in tensors.items() if x.device != xk.device]
    if off:
        raise ValueError(f"KDA step inputs: {off} not on xk's device {xk.device}")
    if roll is not None and (tuple(roll.shape) != (B,) or roll.dtype not in (torch.int32, torch.int64)
                             or roll.device != xk.device):
        raise ValueError(f"KDA step inputs: roll must be integer [B={B}] on {xk.device}, got {roll.dtype} "
                         f"{tuple(roll.shape)} on {roll.device}")
    xq, xk, xv = _same_layout(xq, xk, xv)
    f, = _same_layout(f)
    b, = _same_layout(b)
    taps = [w.contiguous() for w in conv_weights]
    dev, dt = xk.device, xk.dtype
    q = torch.empty(B, T, H, K, device=dev, dtype=dt) if with_q else None
    k = torch.empty(B, T, H, K, device=dev, dtype=dt)
    v = torch.empty(B, T, H, K, device=dev, dtype=dt)
    g = torch.empty(B, T, H, K, device=dev, dtype=torch.float32)
    beta = torch.empty(B, T, H, device=dev, dtype=torch.float32)
    new_windows = torch.empty(B, 3, C, W - 1, device=dev, dtype=dt)
    if B * T == 0:   # nothing to compute: the windows stay as they were
        new_windows.copy_(windows if windows is not None else new_windows.zero_())
        return q, k, v, g, beta, new_windows
    win = windows if windows is not None else new_windows   # not read without HAS_WINDOW
    sw = win.stride()
    _launch((B * T, H), xq, xk, xv, xq.stride(0), xq.stride(1), f, f.stride(0), f.stride(1), b, b.stride(0),
            b.stride(1), win, sw[0], sw[1], sw[2], sw[3], taps[0], taps[1], taps[2], A_log, dt_bias,
            q if with_q else k, k, v, g, beta, new_windows, roll if roll is not None else beta, T, H, K,
            float(lower_bound) if lower_bound is not None else 0., float(eps),
            W=W, BK=next_pow2(K), HAS_WINDOW=windows is not None, WITH_Q=with_q,
            GATE=gate_mode(True, lower_bound), HAS_ROLL=roll is not None, num_warps=1)
    return q, k, v, g, beta, new_windows


def _same_layout(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """xs with contiguous channels and the first one's batch / token strides (copies where they differ)."""
    if all(x.stride(-1) == 1 and x.stride()[:2] == xs[0].stride()[:2] for x in xs):
        return xs
    return tuple(x.contiguous() for x in xs)
