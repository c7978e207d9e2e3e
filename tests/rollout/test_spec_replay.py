"""ReplaySSM reference (kernels/replay_ssm/naive.py): folding the accepted prefix's stored step inputs from the
committed state gives bitwise the state token-by-token decoding reaches, per row, at any accept length; the conv
roll equals decode's windows; bad inputs are named; the scratch memory table at K3's dims."""
import pytest
import torch

from k3.config import K3Config
from k3.rollout.spec.scratch import (ReplayScratch, scratch_bytes_per_sequence_layer, scratch_layout,
                                     snapshot_bytes_per_draft)
from k3_kernels.kda import l2norm, naive_kda_lowerbound_gate, naive_recurrent_kda
from k3_kernels.replay_ssm import naive_conv_roll, naive_replay_commit


def _inputs(B=4, T=5, H=2, K=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = l2norm(torch.randn(T, B, H, K, generator=g)).to(dtype)
    v = torch.randn(T, B, H, K, generator=g).to(dtype)
    gate = naive_kda_lowerbound_gate(torch.randn(T, B, H, K, generator=g), torch.zeros(H), None, -5.0)
    beta = torch.sigmoid(torch.randn(T, B, H, generator=g))
    S0 = torch.randn(B, H, K, K, generator=g)
    return S0, k, v, gate, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_equals_decode_steps_bitwise(dtype):
    S0, k, v, g, beta = _inputs(dtype=dtype)
    T, B = k.shape[:2]
    # decode: one token per call, all B rows, state after every step
    states, S = [S0], S0
    for t in range(T):
        q = torch.randn(B, 1, *k.shape[2:]).to(dtype)
        _, S = naive_recurrent_kda(q, k[t].unsqueeze(1), v[t].unsqueeze(1), g[t].unsqueeze(1),
                                   beta[t].unsqueeze(1), initial_state=S, output_final_state=True)
        states.append(S)
    n = torch.tensor([0, 1, 3, T])
    out = naive_replay_commit(S0, k, v, g, beta, n)
    for b in range(B):
        assert torch.equal(out[b], states[int(n[b])][b]), b
    assert torch.equal(naive_replay_commit(S0, k, v, g, beta, torch.zeros(B, dtype=torch.long)), S0)


def test_conv_roll_equals_decode_windows():
    B, C, W1, T = 3, 8, 3, 4
    window = torch.randn(B, 3, C, W1)
    inputs = torch.randn(T, B, 3, C)
    n = torch.tensor([0, 2, 4])
    out = naive_conv_roll(window, inputs, n)
    for b in range(B):
        w = window[b]
        for t in range(int(n[b])):   # decode: append the token's input, keep the last W-1
            w = torch.cat([w, inputs[t, b, :, :, None]], dim=-1)[..., 1:]
        assert torch.equal(out[b], w)


def test_bad_inputs_are_named():
    S0, k, v, g, beta = _inputs()
    with pytest.raises(ValueError, match="n_accept"):
        naive_replay_commit(S0, k, v, g, beta, torch.tensor([0, 1, 2, 9]))
    with pytest.raises(ValueError, match="beta"):
        naive_replay_commit(S0, k, v, g, beta[:, :2], torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="state"):
        naive_replay_commit(S0.double(), k, v, g, beta, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="window"):
        naive_conv_roll(torch.zeros(2, 3, 8, 3), torch.zeros(4, 3, 3, 8), torch.zeros(3, dtype=torch.long))


def test_memory_table_at_k3_dims():
    """Spec scratch per sequence per KDA layer (96 heads x 128 x 128) vs one fp32 state snapshot per draft token:
    chain 3 and chain 7 verify k+1 positions (the pending token and the draft), a 16-node tree (the pending token
    and 15 draft nodes) 16; the target is <= 1/32 of the snapshots. What is stored per position: the projections
    (pre-conv q/k/v, the gate's f, beta's logit) in bf16, 98,496 B, vs 6,291,456 B per snapshot."""
    from benchmarks.spec_decode import memory_table
    mc = K3Config.preset("k3")
    assert (mc.kda_num_heads, mc.kda_head_dim) == (96, 128)
    snap = snapshot_bytes_per_draft(mc)
    assert snap == 96 * 128 * 128 * 4
    assert scratch_bytes_per_sequence_layer(mc, torch.bfloat16, 1) == (3 * 96 * 128 + 96 * 128 + 96) * 2
    for drafts, positions in ((3, 4), (7, 8), (15, 16)):
        ours = scratch_bytes_per_sequence_layer(mc, torch.bfloat16, positions)
        assert ours * 32 <= drafts * snap, (drafts, ours, drafts * snap)
    rows = memory_table()
    assert [r["verify_positions"] for r in rows] == [4, 8, 16]
    assert all(r["ratio_vs_per_draft"] <= 1 / 32 for r in rows), rows
    # the figure is what the allocation holds
    sc = ReplayScratch.allocate(mc, 1, torch.bfloat16, rows=1, positions=4, device=torch.device("meta"))
    assert sum(t.numel() * t.element_size() for t in sc.bufs[0].values()) == \
        scratch_bytes_per_sequence_layer(mc, torch.bfloat16, 4)
    assert "state" not in "".join(scratch_layout(mc, torch.bfloat16, 4))


def test_scratch_refuses_a_cast():
    """The stored projections are kept in the dtype they were computed in: a cast would change the replay."""
    mc = K3Config.preset("tiny")
    sc = ReplayScratch.allocate(mc, 1, torch.bfloat16, rows=1, positions=2, device=torch.device("cpu"))
    C, H = mc.kda_num_heads * mc.kda_head_dim, mc.kda_num_heads
    with pytest.raises(ValueError, match="conv_in is torch.float32"):
        sc.store(0, [0], 0, torch.zeros(1, 1, 3, C), torch.zeros(1, 1, C, dtype=torch.bfloat16),
                 torch.zeros(1, 1, H, dtype=torch.bfloat16))
