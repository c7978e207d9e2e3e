"""The plain-torch references against fla-core's references (a check against code we did not write)."""
import pytest
import torch

from k3_kernels.attnres import naive_block_attnres
from k3_kernels.kda import l2norm, naive_chunk_kda, naive_kda_gate, naive_kda_lowerbound_gate, naive_recurrent_kda
from k3_kernels.norm import naive_gated_rms_norm, naive_rms_norm
from k3_kernels.situ import naive_situ_and_mul

fla_kda = pytest.importorskip("fla.ops.kda.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")
fla_attnres = pytest.importorskip("fla.ops.attnres.naive")


def _inputs(B=2, T=128, H=2, HV=4, K=16, V=24, dtype=torch.float32):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = l2norm(torch.randn(B, T, H, K, dtype=dtype))
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = naive_kda_lowerbound_gate(torch.randn(B, T, HV, K), torch.zeros(HV), None, -5.0).to(dtype)
    beta = torch.rand(B, T, HV, dtype=dtype)
    h0 = torch.randn(B, HV, K, V, dtype=dtype)
    return q, k, v, g, beta, h0


def test_recurrent_matches_fla():
    q, k, v, g, beta, h0 = _inputs()
    o, s = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = fla_kda.naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


def test_chunk_matches_fla_chunk_and_handles_ragged_lengths():
    q, k, v, g, beta, h0 = _inputs(T=128)
    o, s = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = fla_kda.naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=1e-4, rtol=1e-4)
    # T not a chunk multiple: compare with the recurrent reference in fp64
    q, k, v, g, beta, h0 = _inputs(T=93, dtype=torch.float64)
    o, s = naive_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s, s_ref, atol=1e-10, rtol=1e-10)


def test_chunk_long_span_with_strong_decay_is_finite():
    # lower bound -5 for 64 tokens: exp(+320) would overflow if decays were formed as exp(G_i)/exp(G_j)
    q, k, v, _, beta, _ = _inputs(T=128)
    g = torch.full((2, 128, 4, 16), -4.99)
    o, _ = naive_chunk_kda(q, k, v, g, beta)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)


def test_gates_match_fla():
    g = torch.randn(2, 5, 3, 8)
    A_log = torch.randn(3)
    dt = torch.randn(24)
    torch.testing.assert_close(naive_kda_gate(g, A_log, dt), fla_gate.naive_kda_gate(g, A_log, dt))
    torch.testing.assert_close(naive_kda_lowerbound_gate(g, A_log, dt, -5.0),
                               fla_gate.naive_kda_lowerbound_gate(g, A_log, dt, -5.0))


def test_block_attnres_matches_fla_naive_attnres():
    D = 32
    rows = [torch.randn(3, 7, D) for _ in range(4)]
    partial = torch.randn(3, 7, D)
    query, w = torch.randn(D), torch.rand(D) + 0.5
    ours = naive_block_attnres(rows, partial, query, w, eps=1e-6)
    ref = fla_attnres.naive_attnres(query, [*rows, partial], w, rms_eps=1e-6)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    ow = torch.rand(D) + 0.5
    ours = naive_block_attnres(rows, partial, query, w, eps=1e-6, output_norm_weight=ow)
    ref = fla_attnres.naive_attnres(query, [*rows, partial], w, output_rms_weight=ow, rms_eps=1e-6)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_norms_and_situ_math():
    x, gate, w = torch.randn(4, 16), torch.randn(4, 16), torch.rand(16)
    torch.testing.assert_close(naive_rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (16,), w, 1e-6))
    torch.testing.assert_close(naive_gated_rms_norm(x, gate, w, 1e-6),
                               torch.nn.functional.rms_norm(x, (16,), w, 1e-6) * torch.sigmoid(gate))
    g, u = torch.randn(1000) * 10, torch.randn(1000) * 100
    y = naive_situ_and_mul(g, u)
    assert y.abs().max() <= 4 * 25  # soft cap: |out| <= b1 * b2 (reached in fp32 at saturation)
    big = torch.tensor([1e4]); assert torch.isclose(naive_situ_and_mul(big, big), torch.tensor(100.0))
    # b -> inf recovers SwiGLU
    torch.testing.assert_close(naive_situ_and_mul(g[:10] / 10, u[:10] / 100, 1e6, 1e6),
                               torch.nn.functional.silu(g[:10] / 10) * u[:10] / 100, atol=1e-5, rtol=1e-4)
