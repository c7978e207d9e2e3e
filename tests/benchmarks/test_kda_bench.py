"""benchmarks/kda.py's `safe_gate` row: its inputs must be K3's safe gate with a sharp decay (no GPU needed)."""
import torch

from benchmarks.kda import D, H, sharp_safe_gate


def test_safe_gate_row_spans_more_than_80_in_every_chunk():
    f, A_log, dt_bias = sharp_safe_gate(256, device="cpu")
    assert f.shape == (1, 256, H, D) and A_log.shape == (H,) and dt_bias.shape == (H * D,)
    assert all(x.requires_grad and x.dtype == torch.float32 for x in (f, A_log, dt_bias))
    g = -5 * torch.sigmoid(A_log.exp()[:, None] * (f + dt_bias.view(H, D)))  # K3's safe gate, lower bound -5
    assert -5 < g.min() and g.max() < 0 and -2.6 < g.mean() < -2.4
    span = -g.detach().view(4, 64, H, D).sum(1)  # log-decay each chunk spans, per channel
    assert bool((span.amax((1, 2)) > 80).all())  # every chunk takes our 16-row-block path (80: `_whole_chunk`)
    assert all(torch.equal(a, b) for a, b in zip(sharp_safe_gate(256, device="cpu"), (f, A_log, dt_bias)))


def test_rows_cover_every_gate_length_and_head_count():
    from benchmarks.kda import ROWS
    assert len(ROWS) == 24 and len(set(ROWS)) == 24
    for n in ("16K", "64K", "128K", "varlen"):
        for gate in ("precomputed", "k3init", "sharp"):
            assert {f"{n}_{gate}_H16", f"{n}_{gate}_H96"} <= set(ROWS)


def test_k3_init_gate_is_k3s_init():
    """A_log = log U(1, 16), dt_bias = softplus^-1(dt) with dt in [1e-3, 1e-1] per channel (full rank), f ~ N(0, 1):
    a x = exp(A_log) (f + dt_bias) is mostly very negative, so the log-decay per token is mostly near 0 (mean above
    -0.5) and the chunks take the whole-chunk paths."""
    from benchmarks.kda import k3_init_gate
    f, A_log, dt_bias = k3_init_gate(256, device="cpu", heads=4)
    assert f.shape == (1, 256, 4, D) and A_log.shape == (4,) and dt_bias.shape == (4 * D,)
    assert bool((A_log.exp() >= 1).all() and (A_log.exp() <= 16).all())
    dt = torch.nn.functional.softplus(dt_bias.detach())
    assert bool((dt > 0.99e-3).all() and (dt < 1.01e-1).all()) and dt.unique().numel() == 4 * D
    g = -5 * torch.sigmoid(A_log.detach().exp()[:, None] * (f.detach() + dt_bias.detach().view(4, D)))
    assert -5 <= g.min() and g.max() <= 0 and g.mean() > -0.5


def test_breakdown_rows_are_checked_before_any_gpu_work():
    """`--breakdown` with no value keeps the 16K K3-init H16 row; named rows must be fixed-length gated rows (the
    breakdown passes the safe gate's keywords and no cu_seqlens), refused with the offending names otherwise."""
    import pytest
    from benchmarks.kda import breakdown_rows
    assert breakdown_rows(["kda.py", "--decode"]) == []
    assert breakdown_rows(["kda.py", "--breakdown"]) == ["16K_k3init_H16"]
    assert breakdown_rows(["kda.py", "--breakdown", "--decode"]) == ["16K_k3init_H16"]
    assert breakdown_rows(["kda.py", "--breakdown", "16K_k3init_H96,16K_sharp_H16"]) == ["16K_k3init_H96",
                                                                                         "16K_sharp_H16"]
    for bad in ("16K_precomputed_H16", "varlen_k3init_H16", "16K_k3init_H32"):
        with pytest.raises(SystemExit, match=bad):
            breakdown_rows(["kda.py", "--breakdown", f"16K_k3init_H16,{bad}"])
