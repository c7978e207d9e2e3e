"""KDA's fused per-token inputs (kernels/kda/step_inputs.py: short conv + SiLU + L2 norm, gate, beta, rolled
windows in one launch) against the plain-torch spec (`naive_kda_step_inputs`), and the property that lets decode,
a speculative verify and the commit's rebuild share bits: a token's outputs do not depend on how many tokens or
rows share the call. On CPU under TRITON_INTERPRET=1 (with the bounds guard), on the GPU at K3's head width."""
from __future__ import annotations

import pytest
import torch

from k3_kernels.kda import naive_kda_step_inputs
from k3_kernels.kda.step_inputs import fused_kda_step_inputs
from test_kda import DEV, assert_close

W = 4   # K3's conv kernel size
NAMES = ("q", "k", "v", "g", "beta", "windows")


def _case(B: int, T: int, H: int, K: int, dtype: torch.dtype, window: bool, device: str = DEV) -> dict:
    """Projections as the model makes them (xq, xk, xv strided views of one [B, T, 3, C] block, as the speculative
    commit passes its stored projections), conv weights, gate parameters at K3's init, windows in the state pool's
    fp32 (cast to x's dtype by the op) or None."""
    C = H * K
    x = torch.randn(B, T, 3, C, device=device).to(dtype)
    dt = torch.exp(torch.empty(C, device=device).uniform_(-6.9, -2.3))
    return dict(xq=x[:, :, 0], xk=x[:, :, 1], xv=x[:, :, 2], f=torch.randn(B, T, C, device=device).to(dtype),
                b=torch.randn(B, T, H, device=device).to(dtype),
                windows=torch.randn(B, 3, C, W - 1, device=device) if window else None,
                conv_weights=tuple((torch.randn(C, 1, W, device=device) / W).to(dtype) for _ in range(3)),
                A_log=torch.empty(H, device=device).uniform_(1, 16).log(),
                dt_bias=dt + torch.log(-torch.expm1(-dt)))


def _both(case: dict, lower_bound: float | None, with_q: bool = True):
    ref = naive_kda_step_inputs(**case, lower_bound=lower_bound, with_q=with_q)
    got = fused_kda_step_inputs(**case, lower_bound=lower_bound, with_q=with_q)
    return ref, got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["safe_gate", "default_gate"])
@pytest.mark.parametrize("T,K,window,with_q", [(5, 32, True, True), (2, 32, True, False), (3, 24, False, True),
                                               (1, 32, True, True)],
                         ids=["T5", "T2_no_q", "K24_no_window", "T1"])
def test_fused_step_inputs_match_the_spec(bounds_guard, dtype, lower_bound, T, K, window, with_q):
    """Every output against the spec: T above and below the window (W-1 = 3), a head dim that is not a power of
    two (masked channels), no window (zeros), q skipped (its window still rolls). Windows are copies: equal."""
    case = _case(2, T, 3, K, dtype, window)
    ref, got = _both(case, lower_bound, with_q)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, r, x in zip(NAMES, ref, got):
        if r is None:
            assert x is None, name
            continue
        assert x.shape == r.shape and x.dtype == r.dtype, (name, x.shape, r.shape, x.dtype, r.dtype)
        if name == "windows":
            assert torch.equal(x, r), name
        else:
            assert_close(name, r, x, tol)
    assert bounds_guard is None or bounds_guard.checked > 0


def test_token_bits_do_not_depend_on_the_call(bounds_guard):
    """One call over 6 tokens equals 6 one-token calls chained through their windows (decode), and a row of a
    3-row call equals it alone: bit for bit, every output."""
    case = _case(3, 6, 2, 32, torch.bfloat16, True)
    whole = fused_kda_step_inputs(**case, lower_bound=-5.0)
    windows = case["windows"]
    for t in range(6):
        one = {n: (x[:, t:t + 1] if n in ("xq", "xk", "xv", "f", "b") else x) for n, x in case.items()}
        one["windows"] = windows
        step = fused_kda_step_inputs(**one, lower_bound=-5.0)
        for name, w, s in zip(NAMES[:5], whole, step):
            assert torch.equal(w[:, t:t + 1], s), (name, t)
        windows = step[5]
    assert torch.equal(windows, whole[5])
    alone = {n: (x[1:2] if n in ("xq", "xk", "xv", "f", "b", "windows") else x) for n, x in case.items()}
    for name, w, a in zip(NAMES, whole, fused_kda_step_inputs(**alone, lower_bound=-5.0)):
        assert torch.equal(w[1:2], a), name
    assert bounds_guard is None or bounds_guard.checked > 0


def test_bad_shapes_raise_before_any_launch():
    case = _case(1, 2, 2, 16, torch.float32, True)
    with pytest.raises(ValueError, match="windows"):
        fused_kda_step_inputs(**{**case, "windows": case["windows"][..., :2]}, lower_bound=-5.0)
    with pytest.raises(ValueError, match="f "):
        fused_kda_step_inputs(**{**case, "f": case["f"][..., :8]}, lower_bound=-5.0)
    # parameters the kernel indexes by channel or head: a short one would be read past its end
    with pytest.raises(ValueError, match=r"conv_weights\[k\]"):
        fused_kda_step_inputs(**{**case, "conv_weights": (case["conv_weights"][0], case["conv_weights"][1][:16],
                                                          case["conv_weights"][2])}, lower_bound=-5.0)
    with pytest.raises(ValueError, match="A_log"):
        fused_kda_step_inputs(**{**case, "A_log": case["A_log"][:1]}, lower_bound=-5.0)
    with pytest.raises(ValueError, match="dt_bias"):
        fused_kda_step_inputs(**{**case, "dt_bias": case["dt_bias"][:16]}, lower_bound=-5.0)
    with pytest.raises(ValueError, match=r"\['A_log'\] not on"):   # a tensor on another device is named
        fused_kda_step_inputs(**{**case, "A_log": case["A_log"].to("meta")}, lower_bound=-5.0)


def test_out_of_range_roll_stays_inside_the_row(bounds_guard):
    """`roll` is not read back on the host (a CUDA graph may capture the call): values outside [0, T] are clamped
    in the kernel, so they act as 0 or T and read nothing outside the row (the bounds guard checks)."""
    case = _case(3, 3, 2, 16, torch.float32, True)
    got = fused_kda_step_inputs(**case, lower_bound=-5.0, with_q=False, roll=torch.tensor([-7, 9, 2], device=DEV))
    want = fused_kda_step_inputs(**case, lower_bound=-5.0, with_q=False, roll=torch.tensor([0, 3, 2], device=DEV))
    assert torch.equal(got[5], want[5])
    assert bounds_guard is None or bounds_guard.checked > 0


def test_no_tokens_keeps_the_windows():
    case = _case(2, 0, 2, 16, torch.float32, True)
    *_, windows = fused_kda_step_inputs(**case, lower_bound=-5.0)
    assert torch.equal(windows, case["windows"])


@pytest.mark.gpu
def test_gpu_k3_width_matches_the_spec_and_is_call_invariant():
    """K3's head width (K = 128, 16 heads here), bf16, both gates: within bf16 rounding of the spec; a decode
    token's bits equal the same token in a 4-position verify call and alone in its batch."""
    for lower_bound in (-5.0, None):
        case = _case(8, 4, 16, 128, torch.bfloat16, True, device="cuda")
        ref, got = _both(case, lower_bound)
        for name, r, x in zip(NAMES, ref, got):
            if name == "windows":
                assert torch.equal(x, r), name
            else:
                assert_close(name, r, x, 1e-2)
        last = {n: (x[:, 3:] if n in ("xq", "xk", "xv", "f", "b") else x) for n, x in case.items()}
        last["windows"] = fused_kda_step_inputs(**{n: (x[:, :3] if n in ("xq", "xk", "xv", "f", "b") else x)
                                                   for n, x in case.items()}, lower_bound=lower_bound)[5]
        for name, w, s in zip(NAMES[:5], got, fused_kda_step_inputs(**last, lower_bound=lower_bound)):
            assert torch.equal(w[:, 3:], s), name
        alone = {n: (x[5:6] if n in ("xq", "xk", "xv", "f", "b", "windows") else x) for n, x in case.items()}
        for name, w, a in zip(NAMES, got, fused_kda_step_inputs(**alone, lower_bound=lower_bound)):
            assert torch.equal(w[5:6], a), name


_BUILD = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3_kernels.kda.gate import GATE_DEFAULT, GATE_SAFE
from k3_kernels.kda.step_inputs import _step_inputs_kernel as fn
TYPES = dict(win="*fp32", A_log="*fp32", g_out="*fp32", beta_out="*fp32", roll="*i64", T="i32", H="i32", K="i32",
             lower_bound="fp32", eps="fp32")
out = {}
for safe in (True, False):
    for with_q in (True, False):
        consts = dict(W=4, BK=128, HAS_WINDOW=True, WITH_Q=with_q, GATE=GATE_SAFE if safe else GATE_DEFAULT,
                      HAS_ROLL=not with_q)
        sig = {n: "constexpr" if n in consts else TYPES.get(n, "i64" if n.startswith("s") else "*bf16")
               for n in fn.arg_names}
        src = ASTSource(fn, sig, {(i,): consts[n] for i, n in enumerate(fn.arg_names) if n in consts})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
        out[f"safe={safe},q={with_q}"] = {"cubin": len(k.asm["cubin"]), "local": k.asm["ptx"].count("ld.local")}
print(json.dumps(out))
"""


def test_builds_for_the_h200():
    """The sm_90 build of every variant (no GPU needed: the interpreter does not compile, so this is what catches
    a construct the GPU compiler rejects before a device run), without local-memory spills."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    builds = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(builds) == 4 and all(b["cubin"] > 0 and b["local"] == 0 for b in builds.values()), builds


def test_roll_keeps_each_rows_accepted_tokens(bounds_guard):
    """`roll` (the speculative commit): each row's windows after its own first roll[b] tokens (0 = unchanged, T =
    all), as the replay spec's conv roll gives them; the other outputs as without it."""
    from k3_kernels.replay_ssm.naive import naive_conv_roll
    case = _case(4, 3, 2, 16, torch.bfloat16, True)
    roll = torch.tensor([0, 1, 3, 2], device=DEV)
    ref = naive_kda_step_inputs(**case, lower_bound=-5.0, with_q=False, roll=roll)
    got = fused_kda_step_inputs(**case, lower_bound=-5.0, with_q=False, roll=roll)
    inputs = torch.stack([case["xq"], case["xk"], case["xv"]], 2).transpose(0, 1)   # [T, B, 3, C]
    conv = naive_conv_roll(case["windows"].to(torch.bfloat16), inputs, roll)
    assert torch.equal(ref[5], conv) and torch.equal(got[5], conv)
    assert torch.equal(got[5][0], case["windows"][0].to(torch.bfloat16))
    plain = fused_kda_step_inputs(**case, lower_bound=-5.0, with_q=False)
    assert all(torch.equal(a, b) for a, b in zip(got[1:5], plain[1:5]))
    with pytest.raises(ValueError, match="roll"):
        fused_kda_step_inputs(**case, lower_bound=-5.0, roll=roll[:2])
    assert bounds_guard is None or bounds_guard.checked > 0
