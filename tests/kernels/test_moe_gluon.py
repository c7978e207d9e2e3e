"""The warp-specialised Gluon grouped GEMMs (k3_kernels.moe.gluon_gemm: FP8, gluon_bf16: bf16) and what runs
around them.

Why these tests: the Gluon kernel exists only for speed, so it must give the Triton FP8 kernels' bits (which the
interpreter tests check against the spec in test_moe.py) -- the `gpu` tests compare them at K3 shapes. Gluon has no
interpreter; on CPU its sm_90a build is checked for what the design rests on: warp specialisation (setmaxnreg),
FP8 wgmma chains, no spills, and no ptxas serialisation of the MMAs (the failure mode of the first design, which
kept two partials in flight in one warpgroup). The SiTU + H-quantisation pass that follows the Gluon gate/up runs
under the interpreter against the fused Triton epilogue it replaces, bit for bit."""
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # (tests/conftest.py sets it too, before anything imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _moe_interp import experts_case, rel_rms  # noqa: E402  (+ the FP8 conversions in the interpreter)
from k3_kernels.moe import grouped_gemm as gg  # noqa: E402
from k3_kernels.moe.layer import Precision, fp8_weight, moe_experts  # noqa: E402
from k3_kernels.moe.permute import permute_rows, plan_routing  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(N, L, I, E, k, seed):
    return experts_case(N, L, I, E, k, dtype=torch.bfloat16, seed=seed)


def test_situ_quant_pass_matches_the_fused_epilogue():
    """G | U written by a GEMM, then H and its FP8 rows in a pass of their own: the fused gate/up kernel's bits
    (what the Gluon gate/up path relies on to stay bitwise with the Triton one)."""
    z, ids, w, w1, w3, w2 = _case(11, 128, 256, 3, 2, seed=3)
    plan = plan_routing(ids, 3)
    _, xq, xs = permute_rows(z, plan, bf16=False, fp8=True)
    (w1q, w1s), (w3q, w3s) = fp8_weight(w1), fp8_weight(w3)
    with gg.gemm_kernels(gg.GemmKernels.TRITON):
        gu, h, hq, hs = gg.gate_up(xq, w1, w3, plan, 4.0, 25.0, act_dtype=torch.bfloat16, save_gu=True,
                                   write_h=True, quant_h=True, fp8=(xq, xs, w1q, w1s, w3q, w3s))
    h2, hq2, hs2 = torch.empty_like(h), torch.empty_like(hq), torch.empty_like(hs)
    gg.situ_quant(gu, 4.0, 25.0, h2, hq2, hs2)
    assert torch.equal(h2, h) and torch.equal(hs2, hs)
    assert torch.equal(hq2.view(torch.uint8), hq.view(torch.uint8))
    hq3, hs3 = torch.empty_like(hq), torch.empty_like(hs)
    gg.situ_quant(gu, 4.0, 25.0, None, hq3, hs3)  # inference: no bf16 H
    assert torch.equal(hq3.view(torch.uint8), hq.view(torch.uint8)) and torch.equal(hs3, hs)


def test_the_gluon_path_is_chosen_only_where_it_runs():
    assert gg.gemm_kernels_for(torch.device("cpu"), 3584, 3072) is gg.GemmKernels.TRITON
    with gg.gemm_kernels(gg.GemmKernels.GLUON):
        assert gg.gemm_kernels_for(torch.device("cpu"), 3584, 3072) is gg.GemmKernels.TRITON
    for dtype in (torch.bfloat16, torch.float32):  # FP8 GEMMs have tiles whatever the activations' dtype
        assert {"gate_up_fp8", "mm_fp8"} <= set(gg.configs(torch.device("cuda"), dtype))
    with pytest.raises(ValueError, match="impl"):
        with gg.gemm_kernels("gluon"):
            pass
    from k3_kernels.moe import gluon_gemm
    assert gluon_gemm.usable(3584, 6144) and gluon_gemm.usable(3072, 7168) and not gluon_gemm.usable(3584, 100)
    with pytest.raises(ValueError, match="stages"):
        gluon_gemm.GluonTile(stages=1).validate()
    with pytest.raises(ValueError, match="consumer_regs"):
        gluon_gemm.GluonTile(consumer_regs=240).validate()
    with pytest.raises(ValueError, match="mm_block_n"):
        gluon_gemm.GluonTile(mm_block_n=192).validate()


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP8_FULL])
def test_the_backward_runs_on_the_forwards_kernels(monkeypatch, precision):
    """A `gemm_kernels` block around the forward alone decides the backward's GEMMs too (autograd runs the backward
    later, outside the block): every backward GEMM call sees the forward's choice."""
    from k3_kernels.moe import fp8_grad
    seen = []
    for module, name in ((gg, "down_dgrad_situ"), (gg, "gate_up_dgrad"), (gg, "wgrad"), (gg, "scaled_mm"),
                         (fp8_grad, "wgrad_fp8")):
        def spy(*args, _orig=getattr(module, name), **kwargs):
            seen.append(gg.gemm_kernels_override())
            return _orig(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    case = [t.clone().requires_grad_(t.is_floating_point()) for t in _case(9, 128, 128, 3, 2, seed=5)]
    with gg.gemm_kernels(gg.GemmKernels.GLUON):
        y = moe_experts(*case, precision=precision)
    y.float().sum().backward()
    assert len(seen) >= 3 and set(seen) == {gg.GemmKernels.GLUON}, seen


_BUILD = r"""
import collections, json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from k3_kernels.moe import gluon_bf16 as B, gluon_gate_up as GU, gluon_gemm as G
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
OPS = (r"\b(QGMMA\.64x128x32\.F32\.E4M3\.E4M3|QGMMA\.64x64x32\.F32\.E4M3\.E4M3|HGMMA\.64x256x16\.F32\.BF16|"
       r"USETMAXREG|WARPGROUP\.DEPBAR\.LE gsb0, 0x1)")


def desc(dtype, shape):
    lay = gl.NVMMASharedLayout.get_default_for(shape, gl.float8e4nv if dtype == "fp8e4nv" else gl.bfloat16)
    return f"tensordesc<{dtype}[{shape[0]}, {shape[1]}],{lay!r}>"


def build(fn, types, consts):
    consts = {n: v for n, v in consts.items() if n in fn.arg_names}
    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in consts
             and n not in ("n_tiles_m", "n_tiles")}
    src = GluonASTSource(fn, sig, {(i,): consts[n] for i, n in enumerate(fn.arg_names) if n in consts}, attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=G._MAXNREG))
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        open(ptx, "w").write(k.asm["ptx"])
        info = subprocess.run([os.path.join(BIN, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o",
                               os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout
    # spills in the MMA loops: the stretches between consecutive MMAs, leaving out those through a tile's epilogue
    # (a consumer's last chain, its SiTU (MUFU.EX2) or bf16 conversion (F2FP) and store, the next code)
    lines = sass.splitlines()
    mma = [i for i, line in enumerate(lines) if re.search(r"\b[QH]GMMA\.", line)]
    gaps = [lines[a:b] for a, b in zip(mma, mma[1:])
            if not any("MUFU.EX2" in line or "F2FP" in line for line in lines[a:b])]
    return {"info": info, "ops": collections.Counter(re.findall(OPS, sass)),
            # wgmma with A from registers (`QGMMA ... Rd, Ra, gdesc[...]`) rather than a shared-memory descriptor
            "register_a_mmas": len(re.findall(r"[QH]GMMA\.\S+ R\d+, R\d+, gdesc", sass)),
            "mma_spills": sum(bool(re.search(r"\b(STL|LDL)\b", line)) for gap in gaps for line in gap),
            "spill": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
            "tensormap_acquires": k.asm["ptx"].count("fence.proxy.tensormap::generic.acquire")}


t, bt = G.DEFAULT_TILE, B.DEFAULT_TILE
ptrs = dict(as_ptr="*fp32", bs_ptr="*fp32", bs2_ptr="*fp32", c_ptr="*bf16", out_ptr="*bf16", out2_ptr="*bf16",
            tiles_ptr="*i32", tile_off_ptr="*i64", offsets_ptr="*i64", d_ptr="*bf16", x_ptr="*bf16")
ints = {n: "i32" for n in ("n_tiles_m", "N", "N_B", "K", "K_B", "c_stride", "M", "M_SPLIT", "d_stride", "x_stride",
                          "n_tiles", "I")}
fp8 = dict(ptrs, **ints, a_desc=desc("fp8e4nv", [t.block_m // 2, 128]), b_desc=desc("fp8e4nv", [128, 128]),
           b2_desc=desc("fp8e4nv", [128, 128]), out_desc=desc("bf16", [t.block_m // 2, 128]),
           out2_desc=desc("bf16", [t.block_m // 2, 128]))
fp8_consts = dict(BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m, STAGES=t.stages,
                  CONSUMER_REGS=t.consumer_regs, PREFETCH_SCALES=False, TMA_STORE=False, A_IN_REGS=False,
                  num_warps=4)
bf16_consts = dict(BLOCK_M=bt.block_m, BLOCK_N=bt.block_n, BLOCK_K=bt.block_k, GROUP_M=bt.group_m, STAGES=bt.stages,
                   CONSUMER_REGS=bt.consumer_regs, num_warps=4)
out = {"_scaled_mm_kernel": build(G._scaled_mm_kernel, fp8, fp8_consts),
       "_scaled_wgrad_kernel": build(G._scaled_wgrad_kernel, fp8, fp8_consts),
       "_scaled_mm_kernel_wide": build(G._scaled_mm_kernel, dict(fp8, b_desc=desc("fp8e4nv", [256, 128]),
                                                                b2_desc=desc("fp8e4nv", [256, 128])),
                                       dict(fp8_consts, BLOCK_N=256)),
       "_scaled_gate_up_kernel": build(GU._scaled_gate_up_kernel,
                                       dict(fp8, gu_ptr="*bf16", h_ptr="*bf16", hq_ptr="*fp8e4nv", hs_ptr="*fp32",
                                            beta="fp32", linear_beta="fp32"),
                                       dict(fp8_consts, ACT_DTYPE=gl.bfloat16, SAVE_GU=True, WRITE_H=True,
                                            QUANT_H=True)),
       "_scaled_mm_kernel_prefetch": build(G._scaled_mm_kernel, fp8, dict(fp8_consts, PREFETCH_SCALES=True)),
       "_scaled_wgrad_kernel_prefetch": build(G._scaled_wgrad_kernel, fp8, dict(fp8_consts, PREFETCH_SCALES=True)),
       "_scaled_wgrad_kernel_tma_store": build(G._scaled_wgrad_kernel, fp8, dict(fp8_consts, TMA_STORE=True)),
       "_scaled_wgrad_kernel_tall": build(G._scaled_wgrad_kernel,
                                          dict(fp8, a_desc=desc("fp8e4nv", [128, 128]),
                                               out_desc=desc("bf16", [128, 128]), out2_desc=desc("bf16", [128, 128])),
                                          dict(fp8_consts, BLOCK_M=t.wgrad_block_m, STAGES=t.wgrad_stages,
                                               TMA_STORE=True)),
       "_scaled_wgrad_kernel_tall_rs": build(G._scaled_wgrad_kernel,
                                             dict(fp8, a_desc=desc("fp8e4nv", [128, 128]),
                                                  out_desc=desc("bf16", [128, 128]),
                                                  out2_desc=desc("bf16", [128, 128])),
                                             dict(fp8_consts, BLOCK_M=t.wgrad_block_m, STAGES=t.wgrad_stages,
                                                  TMA_STORE=True, A_IN_REGS=True)),
       "bf16_wgrad": build(B._bf16_wgrad_kernel, dict(ptrs, **ints), bf16_consts)}
for k_major in (True, False):
    box = [bt.block_n, bt.block_k] if k_major else [bt.block_k, bt.block_n]
    tys = dict(ptrs, **ints, a_desc=desc("bf16", [bt.block_m // 2, bt.block_k]), b_desc=desc("bf16", box),
               b2_desc=desc("bf16", box))
    out[f"bf16_k_major_{k_major}"] = build(B._bf16_mm_kernel, tys, dict(bf16_consts, B_K_MAJOR=k_major))
print(json.dumps(out))
"""


def test_gluon_gemm_builds_for_the_h200():
    """The kernels' sm_90a builds (no GPU needed): the FP8 forward / dgrad GEMM (128 and 256 columns a tile) and
    wgrad (wgmma chains of 64 x 128 x 32; with and without the scales' prefetch; 256-row tiles of 64 x 64
    chains, with A from shared memory or from registers), the gate/up with SiTU fused,
    the bf16 GEMM with K- and N-contiguous B and the bf16 wgrad (64 x 256 x 16 chains kept in flight);
    setmaxnreg (the partitions), no spills (the fused gate/up: none in its MMA loops) and no "wgmma serialized"
    from ptxas."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    builds = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(builds) == {"_scaled_mm_kernel", "_scaled_mm_kernel_wide", "_scaled_gate_up_kernel",
                           "_scaled_wgrad_kernel", "_scaled_mm_kernel_prefetch",
                           "_scaled_wgrad_kernel_prefetch", "_scaled_wgrad_kernel_tma_store",
                           "_scaled_wgrad_kernel_tall", "_scaled_wgrad_kernel_tall_rs", "bf16_k_major_True",
                           "bf16_k_major_False", "bf16_wgrad"}
    assert builds["bf16_wgrad"]["tensormap_acquires"] >= 2  # its per-expert descriptors, made on the device
    for name, out in builds.items():
        assert "serialized" not in out["info"], (name, out["info"])
        assert out["mma_spills"] == 0, (name, out["info"])  # nothing spilled in the MMA loops
        if name != "_scaled_gate_up_kernel":  # (its SiTU epilogue spills: 64 values a thread through tanh)
            # (the tall wgrad: the thread's index, stored once and reloaded once a tile in the epilogue)
            assert out["spill"] <= (4 if "tall" in name else 0), (name, out["info"])
        assert out["ops"].get("USETMAXREG", 0) > 0, (name, out["ops"])
        if name.startswith("bf16"):  # chains of 64 x 256 x 16, the previous one still in flight at each wait
            assert out["ops"].get("HGMMA.64x256x16.F32.BF16", 0) >= 8, (name, out["ops"])
            assert out["ops"].get("WARPGROUP.DEPBAR.LE gsb0, 0x1", 0) >= 2, (name, out["ops"])
        else:
            # 2 consumers x 4 (x 2 column halves in a wide tile: G and U in the fused gate/up; x 4 quarters of 64
            # x 64 in a tall wgrad tile)
            chains = 16 if name.endswith("wide") or "gate_up" in name else 8
            shape, chains = ("64x64x32", 32) if "tall" in name else ("64x128x32", chains)
            assert out["ops"].get(f"QGMMA.{shape}.F32.E4M3.E4M3", 0) >= chains, (name, out["ops"])
            # the A-from-registers tall wgrad: every chain's A from registers, none elsewhere
            assert out["register_a_mmas"] == (out["ops"][f"QGMMA.{shape}.F32.E4M3.E4M3"] if name.endswith("_rs")
                                              else 0), (name, out["register_a_mmas"])


# ------------------------------------------------------------------------------------------------- GPU (sm_90)
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="Gluon's kernel needs an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("change", [{"persistent": False}, {}, {"mm_block_n": 128}, {"fuse_situ": True}])
def test_gpu_gluon_gemms_give_the_triton_bits(monkeypatch, change):
    """K3 widths (latent 3584, intermediate 3072), 112 experts, uneven expert loads: the gate/up (G | U in one
    launch, then the SiTU + quantisation pass) and the down GEMM give the Triton FP8 kernels' bits, with one
    program a tile, with the default persistent grid (programs walking several tiles through one ring) of tiles
    of two weight-scale blocks, with one-block tiles and with SiTU in the gate/up's epilogue (also without G | U
    and H: inference)."""
    from k3_kernels.moe import gluon_gemm
    monkeypatch.setattr(gluon_gemm, "DEFAULT_TILE", dataclasses.replace(gluon_gemm.DEFAULT_TILE, **change))
    z, ids, w, w1, w3, w2 = _case(2048, 3584, 3072, 112, 16, seed=11)
    plan = plan_routing(ids, 112)
    _, xq, xs = permute_rows(z, plan, bf16=False, fp8=True)
    fp8 = (xq, xs, *fp8_weight(w1), *fp8_weight(w3))
    outs = {}
    for impl in (gg.GemmKernels.TRITON, gg.GemmKernels.GLUON):
        with gg.gemm_kernels(impl):
            gu, h, hq, hs = gg.gate_up(xq, w1, w3, plan, 4.0, 25.0, act_dtype=torch.bfloat16, save_gu=True,
                                       write_h=True, quant_h=True, fp8=fp8)
            y = gg.down(hq, w2, plan, torch.bfloat16, fp8=(hq, hs, *fp8_weight(w2)))
        torch.cuda.synchronize()
        outs[impl] = (gu, h, hq.view(torch.uint8), hs, y)
    for name, a, b in zip(("gu", "h", "hq", "hs", "y"), outs[gg.GemmKernels.TRITON], outs[gg.GemmKernels.GLUON]):
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max().item())
    with gg.gemm_kernels(gg.GemmKernels.GLUON):  # inference: H's FP8 rows alone
        gu, h, hq, hs = gg.gate_up(xq, w1, w3, plan, 4.0, 25.0, act_dtype=torch.bfloat16, save_gu=False,
                                   write_h=False, quant_h=True, fp8=fp8)
    assert gu is None and h is None
    _, _, hq_t, hs_t, _ = outs[gg.GemmKernels.TRITON]
    assert torch.equal(hq.view(torch.uint8), hq_t) and torch.equal(hs, hs_t)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="Gluon's kernel needs an sm_90 GPU (H100/H200)")
def test_gpu_bf16_layer_same_bits_either_gemm():
    """bf16 experts at K3 widths, 112 experts: output and every gradient (forward GEMMs, dgrads and wgrads on the
    Gluon kernels) the same bits with either kernels, and a token subset's rows unchanged."""
    case = [t.clone().requires_grad_(t.is_floating_point()) for t in _case(1024, 3584, 3072, 112, 16, seed=14)]
    gy = torch.randn(1024, 3584, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    outs = {}
    for impl in (gg.GemmKernels.TRITON, gg.GemmKernels.GLUON):
        for t in case:
            t.grad = None
        with gg.gemm_kernels(impl):
            y = moe_experts(*case)
        y.backward(gy)
        outs[impl] = [y.detach()] + [t.grad for t in case if t.is_floating_point()]
    for name, a, b in zip(("y", "dz", "dw", "dw1", "dw3", "dw2"), outs[gg.GemmKernels.TRITON],
                          outs[gg.GemmKernels.GLUON]):
        assert torch.equal(a, b), (name, rel_rms(a, b))
    with torch.no_grad(), gg.gemm_kernels(gg.GemmKernels.GLUON):
        sub = torch.arange(5, 1024, 9, device=DEV)
        z, ids, w, w1, w3, w2 = case
        assert torch.equal(moe_experts(z[sub], ids[sub], w[sub], w1, w3, w2), outs[gg.GemmKernels.GLUON][0][sub])


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="Gluon's kernel needs an sm_90 GPU (H100/H200)")
def test_gpu_bf16_wgrad_experts_of_any_size():
    """The bf16 wgrad's per-expert descriptors: experts of 0, 1, 63, 64, 65 and 1000 rows (rows of the next expert
    in a last partial block must read as zeros) and a strided column slice of dG | dU: Triton's bits."""
    counts = [0, 1, 63, 64, 65, 1000]
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    plan = plan_routing(ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(2))][:, None].to(DEV),
                        len(counts))
    g = torch.Generator().manual_seed(4)
    dgu = torch.randn(plan.rows, 2 * 3072, generator=g).to(DEV, torch.bfloat16)
    x = torch.randn(plan.rows, 3584, generator=g).to(DEV, torch.bfloat16)
    outs = {}
    for impl in (gg.GemmKernels.TRITON, gg.GemmKernels.GLUON):
        with gg.gemm_kernels(impl):
            outs[impl] = [gg.wgrad(dgu[:, :3072], x, plan, torch.bfloat16), gg.wgrad(dgu[:, 3072:], x, plan,
                                                                                      torch.bfloat16)]
    for a, b in zip(outs[gg.GemmKernels.TRITON], outs[gg.GemmKernels.GLUON]):
        assert torch.equal(a, b), rel_rms(a, b)
    assert torch.count_nonzero(outs[gg.GemmKernels.GLUON][0][0]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="Gluon's kernel needs an sm_90 GPU (H100/H200)")
def test_gpu_fp8_layer_same_bits_either_gemm_and_across_batches():
    """The FP8 experts layer: the same bits with either GEMM, on a rerun, and for a subset of the tokens."""
    z, ids, w, w1, w3, w2 = _case(1024, 3584, 3072, 112, 16, seed=12)
    with torch.no_grad():
        with gg.gemm_kernels(gg.GemmKernels.TRITON):
            y_t = moe_experts(z, ids, w, w1, w3, w2, precision=Precision.FP8)
        with gg.gemm_kernels(gg.GemmKernels.GLUON):
            y_g = moe_experts(z, ids, w, w1, w3, w2, precision=Precision.FP8)
            assert torch.equal(y_g, y_t)
            assert torch.equal(moe_experts(z, ids, w, w1, w3, w2, precision=Precision.FP8), y_g)
            sub = torch.arange(3, 1024, 7, device=DEV)
            assert torch.equal(moe_experts(z[sub], ids[sub], w[sub], w1, w3, w2, precision=Precision.FP8), y_g[sub])
