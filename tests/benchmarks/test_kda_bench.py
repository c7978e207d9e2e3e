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
