"""The latent-MoE layer's grouped GEMMs one by one (benchmarks/moe.py's `--sweep` and `--gluon-gemms`): each
kernel's tiles swept, and the Triton against the warp-specialised Gluon kernels (same bits? TFLOP/s) with the Gluon
kernels' settings swept, at one point (E experts, N tokens) of K3's expert widths."""
from __future__ import annotations

import contextlib
import dataclasses
import time
from unittest import mock

import torch

BETA, LINEAR_BETA = 4.0, 25.0   # SiTU's beta and linear beta (K3's config)


def measure(fn, reps_ms, grad_to_none):
    from triton.testing import do_bench
    return do_bench(fn, warmup=max(5, reps_ms // 4), rep=reps_ms, grad_to_none=grad_to_none, return_mode="median")


def timed_cpu(fn, n=2):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3

def sweep(E, N, L, I, k, device, reps_ms):
    """Per-kernel medians for each candidate tile (E experts, N tokens, random balanced-ish routing)."""
    from k3_kernels.moe import grouped_gemm as gg
    from k3_kernels.moe.permute import permute_rows, plan_routing
    from k3_kernels.moe.layer import fp8_weight

    torch.manual_seed(3)
    z = torch.randn(N, L, device=device, dtype=torch.bfloat16)
    ids = torch.rand(N, E, device=device).topk(k, dim=-1).indices
    w1 = (torch.randn(E, I, L, device=device) * 0.02).bfloat16()
    w3 = (torch.randn(E, I, L, device=device) * 0.02).bfloat16()
    w2 = (torch.randn(E, L, I, device=device) * 0.02).bfloat16()
    plan = plan_routing(ids, E)
    xp, xq, xs = permute_rows(z, plan, fp8=True)
    (w1q, w1s), (w3q, w3s), (w2q, w2s) = fp8_weight(w1), fp8_weight(w3), fp8_weight(w2)
    gu, h, hq, hs = gg.gate_up(xp, w1, w3, plan, BETA, LINEAR_BETA, save_gu=True, quant_h=True)
    dy = torch.randn(plan.rows, L, device=device, dtype=torch.bfloat16)
    dgu = torch.randn(plan.rows, 2 * I, device=device, dtype=torch.bfloat16)
    P = plan.rows
    flops = {"gate_up": 4 * P * L * I, "down": 2 * P * L * I, "down_dgrad_situ": 2 * P * L * I,
             "gate_up_dgrad": 4 * P * L * I, "wgrad_w2": 2 * P * L * I, "gate_up_fp8": 4 * P * L * I,
             "down_fp8": 2 * P * L * I}
    calls = {
        "gate_up": ("gate_up", lambda: gg.gate_up(xp, w1, w3, plan, BETA, LINEAR_BETA, save_gu=True)),
        "down": ("mm", lambda: gg.down(h, w2, plan, torch.bfloat16)),
        "down_dgrad_situ": ("mm", lambda: gg.down_dgrad_situ(dy, w2, gu, plan, BETA, LINEAR_BETA)),
        "gate_up_dgrad": ("mm", lambda: gg.gate_up_dgrad(dgu, w1, w3, plan)),
        "wgrad_w2": ("wgrad", lambda: gg.wgrad(dy, h, plan, torch.bfloat16)),
        "gate_up_fp8": ("gate_up_fp8", lambda: gg.gate_up(xp, w1, w3, plan, BETA, LINEAR_BETA, save_gu=False,
                                                         write_h=False, quant_h=True,
                                                         fp8=(xq, xs, w1q, w1s, w3q, w3s))),
        "down_fp8": ("mm_fp8", lambda: gg.down(hq, w2, plan, torch.bfloat16, fp8=(hq, hs, w2q, w2s))),
    }
    base = gg.configs
    out = {"experts": E, "tokens": N, "results": {}}
    for name, (key, fn) in calls.items():
        rows = []
        for tile in SWEEP[key]:
            cfg = gg.TileConfig(*tile)

            def patched(dev, dtype=torch.bfloat16, _key=key, _cfg=cfg):
                c = dict(base(dev, dtype))
                c[_key] = _cfg
                return c
            gg.configs = patched
            try:
                ms = measure(fn, reps_ms, None)
                rows.append({"tile": tile, "ms": ms, "tflops": flops[name] / ms / 1e9})
            except Exception as err:  # a tile that does not compile (shared memory, registers) is recorded
                rows.append({"tile": tile, "error": f"{type(err).__name__}: {str(err)[:120]}"})
            finally:
                gg.configs = base
        out["results"][name] = rows
        print(name, [(r["tile"], round(r.get("tflops", 0), 1)) for r in rows], flush=True)
    return out


# GluonTile fields changed from the default (the default first)
GLUON_FP8_TILES = [{}, {"mm_block_n": 128}, {"stages": 3}, {"stages": 4}, {"group_m": 4}, {"persistent": False},
                   {"fuse_situ": True}, {"prefetch_scales": True, "mm_block_n": 128}]
# (row-pass rows, warps, token-block columns, warps[, forward SiTU-quantiser rows, warps]): the defaults first
PASS_SETTINGS = [(8, 4, 64, 4), (16, 4, 64, 8), (16, 8, 128, 8), (32, 4, 64, 2), (64, 8, 128, 4)]
# the module attribute each field of a pass setting sets (a 4-field setting leaves the forward SiTU quantiser's own)
PASS_SETTING_FIELDS = (("fp8_grad", "ROW_PASS_ROWS"), ("fp8_grad", "ROW_PASS_WARPS"),
                       ("fp8_grad", "TOKEN_BLOCK_COLUMNS"), ("fp8_grad", "TOKEN_BLOCK_WARPS"),
                       ("grouped_gemm", "SITU_QUANT_ROWS"), ("grouped_gemm", "SITU_QUANT_WARPS"))
PASS_SETTING_NAMES = tuple(name for _, name in PASS_SETTING_FIELDS)
GLUON_BF16_TILES: list[tuple[int, int]] = []  # (block_n, stages); session 31 swept 4 (moe_gluon.json)


def parse_pass_settings(text: str) -> list[tuple[int, ...]]:
    """'16/4/64/8,32/8/64/4/8/4' -> [(16, 4, 64, 8), (32, 8, 64, 4, 8, 4)]: (row-pass rows, warps, token-block
    columns, warps[, forward SiTU-quantiser rows, warps])."""
    settings = []
    for item in filter(None, text.split(",")):
        fields = tuple(int(v) for v in item.split("/"))
        if len(fields) not in (4, 6):
            raise ValueError(f"pass setting {item!r}: expected rows/warps/columns/warps[/situ rows/situ warps]")
        settings.append(fields)
    return settings


def pass_setting_key(setting: tuple[int, ...]) -> str:
    """(8, 4, 64, 4) -> 'rows8x4w_cols64x4w'; a 6-field setting adds '_situ16x4w'."""
    key = "rows{}x{}w_cols{}x{}w".format(*setting[:4])
    return key + ("_situ{}x{}w".format(*setting[4:]) if len(setting) == 6 else "")


def _pass_setting_targets(setting: tuple[int, ...]) -> list[tuple[object, str, int]]:
    from k3_kernels.moe import fp8_grad
    from k3_kernels.moe import grouped_gemm
    modules = {"fp8_grad": fp8_grad, "grouped_gemm": grouped_gemm}
    return [(modules[module], name, value) for (module, name), value in zip(PASS_SETTING_FIELDS, setting)]


def apply_pass_setting(setting: tuple[int, ...]) -> dict[str, int]:
    """The quantisation passes' program sizes set to `setting` (PASS_SETTING_FIELDS, as many as it has fields) for
    the rest of the process; returns them by name (for the results)."""
    for module, name, value in _pass_setting_targets(setting):
        setattr(module, name, value)
    return dict(zip(PASS_SETTING_NAMES, setting))


@contextlib.contextmanager
def pass_setting(setting: tuple[int, ...]):
    """`apply_pass_setting` for the block only."""
    with contextlib.ExitStack() as stack:
        for module, name, value in _pass_setting_targets(setting):
            stack.enter_context(mock.patch.object(module, name, value))
        yield


def parse_tile_changes(text: str) -> list[dict[str, int | bool]]:
    """'mm_block_n=256+stages=3,persistent=false' -> [{"mm_block_n": 256, "stages": 3}, {"persistent": False}]
    (the default tile, {}, always first)."""
    changes: list[dict[str, int | bool]] = [{}]
    for item in filter(None, text.split(",")):
        change = {}
        for pair in item.split("+"):
            key, _, value = pair.partition("=")
            change[key] = {"true": True, "false": False}.get(value.lower(), None)
            if change[key] is None:
                change[key] = int(value)
        changes.append(change)
    return changes


def gluon_gemms(E, N, L, I, k, device, reps_ms, only: set[str] | None = None,
                fp8_tiles: list[dict[str, int | bool]] | None = None,
                pass_settings: list[tuple[int, int, int, int]] | None = None):
    """Each grouped GEMM of the layer, bf16 and FP8 (and the quantisation passes around the FP8 backward), Triton vs
    Gluon in one process at one point: medians, TFLOP/s, whether the two give the same bits; then the Gluon
    kernels' settings swept, each setting's outputs compared bit for bit with the default tile's. `only`: these
    GEMMs (names of `gemms` below; "passes" for the quantisation passes), None: all."""
    from k3_kernels.moe import fp8_grad, gluon_bf16, gluon_gemm
    from k3_kernels.moe import grouped_gemm as gg
    from k3_kernels.moe.layer import fp8_weight, fp8_weight_t, fp8_weight_t13
    from k3_kernels.moe.permute import permute_rows, plan_routing

    def timing(fn):  # (--smoke: CPU, the interpreter; its times are not figures)
        return measure(fn, reps_ms, None) if device.type == "cuda" else timed_cpu(fn, 1)

    torch.manual_seed(3)
    z = torch.randn(N, L, device=device, dtype=torch.bfloat16)
    ids = torch.rand(N, E, device=device).topk(k, dim=-1).indices
    w1, w3 = ((torch.randn(E, I, L, device=device) * 0.02).bfloat16() for _ in range(2))
    w2 = (torch.randn(E, L, I, device=device) * 0.02).bfloat16()
    plan = plan_routing(ids, E)
    xp, xq, xs = permute_rows(z, plan, fp8=True)
    P = plan.rows
    fwd8 = (xq, xs, *fp8_weight(w1), *fp8_weight(w3))
    gu, h, hq, hs = gg.gate_up(xp, w1, w3, plan, BETA, LINEAR_BETA, save_gu=True, quant_h=True)
    dy = torch.randn(P, L, device=device, dtype=torch.bfloat16)
    dgu = torch.randn(P, 2 * I, device=device, dtype=torch.bfloat16) * 0.1
    dyq, dguq = fp8_grad.quantize_rows(dy), fp8_grad.quantize_rows(dgu)
    tiles, offsets = fp8_grad.token_block_tiles(plan)
    tdy, th = fp8_grad.quantize_token_blocks(dy, tiles), fp8_grad.quantize_token_blocks(h, tiles)
    tdgu, tx = fp8_grad.quantize_token_blocks(dgu, tiles), fp8_grad.quantize_token_blocks(xp, tiles)
    w2t, w13t = fp8_weight_t(w2), fp8_weight_t13(w1, w3)
    gemms = {  # name: (FLOPs, call)
        "bf16_gate_up": (4 * P * L * I, lambda: gg.gate_up(xp, w1, w3, plan, BETA, LINEAR_BETA, save_gu=True)),
        "bf16_down": (2 * P * L * I, lambda: gg.down(h, w2, plan, torch.bfloat16)),
        "bf16_down_dgrad_situ": (2 * P * L * I, lambda: gg.down_dgrad_situ(dy, w2, gu, plan, BETA, LINEAR_BETA)),
        "bf16_gate_up_dgrad": (4 * P * L * I, lambda: gg.gate_up_dgrad(dgu, w1, w3, plan)),
        "bf16_wgrad_w2": (2 * P * L * I, lambda: gg.wgrad(dy, h, plan, torch.bfloat16)),
        "bf16_wgrad_w1": (2 * P * L * I, lambda: gg.wgrad(dgu[:, :I], xp, plan, torch.bfloat16)),
        "gate_up": (4 * P * L * I, lambda: gg.gate_up(xq, w1, w3, plan, BETA, LINEAR_BETA, act_dtype=torch.bfloat16,
                                                      save_gu=True, write_h=True, quant_h=True, fp8=fwd8)),
        "down": (2 * P * L * I, lambda: gg.down(hq, w2, plan, torch.bfloat16, fp8=(hq, hs, *fp8_weight(w2)))),
        "down_dgrad": (2 * P * L * I, lambda: gg.scaled_mm(dyq, w2t, plan, torch.bfloat16)),
        "gate_up_dgrad": (4 * P * L * I, lambda: gg.scaled_mm(dguq, w13t, plan, torch.bfloat16)),
        "wgrad_w2": (2 * P * L * I, lambda: fp8_grad.wgrad_fp8(tdy, th, offsets, E, torch.bfloat16)),
        "wgrad_w13": (4 * P * L * I, lambda: fp8_grad.wgrad_fp8(tdgu, tx, offsets, E, torch.bfloat16, split=I)),
    }
    dh = dy[:, :I].contiguous()
    passes = {"quantize_rows_dgu": lambda: fp8_grad.quantize_rows(dgu),
              "quantize_token_blocks_dgu": lambda: fp8_grad.quantize_token_blocks(dgu, tiles),
              "situ_backward": lambda: gg.situ_backward(dh, gu, BETA, LINEAR_BETA),
              "situ_backward_rows": lambda: fp8_grad.situ_backward_rows(dh, gu, BETA, LINEAR_BETA),
              "situ_quant": lambda: gg.situ_quant(gu, BETA, LINEAR_BETA, h, hq, hs)}
    out = {"experts": E, "tokens": N, "rows": P, "gemms": {}, "passes_ms": {}, "pass_sweep": {}, "gluon_sweep": {}}
    # the quantisation passes' program sizes (same bits whatever the size): rows x warps of the row passes,
    # columns x warps of the token-block pass, rows x warps of the forward's SiTU quantiser; the bytes each moves,
    # for GB/s
    pass_bytes = {"quantize_rows_dgu": dgu.numel() * 3 + dgu.numel() // 32,
                  "quantize_token_blocks_dgu": dgu.numel() * 3 + dgu.numel() // 32,
                  "situ_backward_rows": dh.numel() * 2 + gu.numel() * 2 + gu.numel() * 3 + gu.numel() // 32,
                  "situ_quant": gu.numel() * 2 + h.numel() * 3 + h.numel() // 32}
    wanted = (lambda name: only is None or name in only)  # noqa: E731
    for setting in (pass_settings or PASS_SETTINGS) if wanted("passes") else ():
        key = pass_setting_key(setting)
        try:
            with pass_setting(setting):
                times = {n: timing(passes[n]) for n in pass_bytes}
            out["pass_sweep"][key] = {n: {"ms": ms, "gbps": pass_bytes[n] / ms / 1e6} for n, ms in times.items()}
        except Exception as err:
            out["pass_sweep"][key] = {"error": f"{type(err).__name__}: {str(err)[:160]}"}
        print("passes", key, out["pass_sweep"][key], flush=True)
    flat = lambda r: [t for t in (r if isinstance(r, tuple) else (r,)) if t is not None]  # noqa: E731
    flat_bits = lambda r: [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t for t in flat(r)]  # noqa: E731
    default_bits = {}  # the Gluon default tile's outputs, what each swept setting must reproduce
    for name, (flops, fn) in gemms.items():
        if not wanted(name):
            continue
        row = {}
        results = {}
        for impl in (gg.GemmKernels.TRITON, gg.GemmKernels.GLUON):
            try:  # one GEMM that does not compile or launch is recorded; the others still run
                with gg.gemm_kernels(impl):
                    ms = timing(fn)
                    results[impl] = flat_bits(fn())
                row[impl.value] = {"ms": ms, "tflops": flops / ms / 1e9}
            except Exception as err:
                row[impl.value] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        if gg.GemmKernels.GLUON in results:
            default_bits[name] = results[gg.GemmKernels.GLUON]
        if len(results) == 2:
            row["same_bits"] = all(torch.equal(a, b) for a, b in zip(results[gg.GemmKernels.TRITON],
                                                                     results[gg.GemmKernels.GLUON]))
            row["max_abs_diff"] = max([(a.float() - b.float()).abs().max().item()
                                      for a, b in zip(results[gg.GemmKernels.TRITON], results[gg.GemmKernels.GLUON])
                                      if a.dtype != torch.uint8], default=0.0)
            row["gluon_speedup"] = row["triton"]["ms"] / row["gluon"]["ms"]
        out["gemms"][name] = row
        print(f"{name}: {row}", flush=True)
    for name, fn in passes.items() if wanted("passes") else ():
        out["passes_ms"][name] = timing(fn)
    sweeps = [(gluon_gemm, "fp8_" + ("_".join(f"{k}={v}" for k, v in change.items()) or "default"),
               dataclasses.replace(gluon_gemm.DEFAULT_TILE, **change),
               ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "wgrad_w2", "wgrad_w13"))
              for change in (GLUON_FP8_TILES if fp8_tiles is None else fp8_tiles)]
    sweeps += [(gluon_bf16, f"bf16_n{bn}_stages{st}", gluon_bf16.Bf16Tile(block_n=bn, stages=st),
                ("bf16_down", "bf16_gate_up_dgrad", "bf16_wgrad_w2")) for bn, st in GLUON_BF16_TILES]
    for module, key, tile, names in sweeps:
        names = [n for n in names if wanted(n)]
        if not names:
            continue
        base = module.DEFAULT_TILE
        module.DEFAULT_TILE = tile
        try:
            with gg.gemm_kernels(gg.GemmKernels.GLUON):
                out["gluon_sweep"][key] = {n: gemms[n][0] / timing(gemms[n][1]) / 1e9 for n in names}
                out["gluon_sweep"][key]["same_bits_as_default"] = {
                    n: all(torch.equal(a, b) for a, b in zip(flat_bits(gemms[n][1]()), default_bits[n]))
                    for n in names if n in default_bits}
        except Exception as err:  # a setting that does not compile or launch is recorded
            out["gluon_sweep"][key] = {"error": f"{type(err).__name__}: {str(err)[:160]}"}
        finally:
            module.DEFAULT_TILE = base
        print("gluon", key, out["gluon_sweep"][key], flush=True)
    return out
