"""ReplaySSM commit kernel (kernels/replay_ssm/replay.py): against the reference fold, and bitwise equal to the
state the decode kernel (fused_recurrent_kda, one token per call) reaches after each row's accepted prefix. On CPU
under TRITON_INTERPRET=1 at small shapes; on the GPU also at K3's head dims in bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3_kernels.kda import fused_recurrent_kda, l2norm
from k3_kernels.replay_ssm import naive_replay_commit, replay_commit

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _inputs(B, T, H, HV, K, V, dtype, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = l2norm(torch.randn(T, B, H, K, generator=g)).to(dtype)
    v = torch.randn(T, B, HV, V, generator=g).to(dtype)
    gate = F.logsigmoid(torch.randn(T, B, HV, K, generator=g)) * 0.5
    beta = torch.rand(T, B, HV, generator=g)
    S0 = torch.randn(B, HV, K, V, generator=g)
    return [x.to(device) for x in (S0, k, v, gate, beta)]


def _decode_states(S0, k, v, g, beta):
    """Plain decode with the Triton kernel: one token per call, the state after each step."""
    states, S = [S0], S0
    for t in range(k.shape[0]):
        q = torch.zeros_like(k[t]).unsqueeze(1)
        _, S = fused_recurrent_kda(q, k[t].unsqueeze(1), v[t].unsqueeze(1), g[t].unsqueeze(1),
                                   beta[t].unsqueeze(1), initial_state=S, output_final_state=True)
        states.append(S)
    return states


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_kernel_matches_reference_and_decode_kernel(dtype):
    S0, k, v, g, beta = _inputs(B=4, T=4, H=2, HV=2, K=16, V=16, dtype=dtype)
    n = torch.tensor([0, 1, 3, 4], device=DEV)
    out = replay_commit(S0, k, v, g, beta, n)
    ref = naive_replay_commit(S0.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), n.cpu())
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    states = _decode_states(S0, k, v, g, beta)
    for b in range(4):
        assert torch.equal(out[b], states[int(n[b])][b]), b
    assert torch.equal(S0, _inputs(B=4, T=4, H=2, HV=2, K=16, V=16, dtype=dtype)[0])   # input not modified


def test_replay_kernel_grouped_heads_and_bad_inputs():
    S0, k, v, g, beta = _inputs(B=2, T=3, H=1, HV=2, K=8, V=40, dtype=torch.float32)   # two V blocks, HV = 2 H
    n = torch.tensor([2, 3], device=DEV)
    out = replay_commit(S0, k, v, g, beta, n)
    states = _decode_states(S0, k.repeat_interleave(2, dim=2), v, g, beta)
    for b in range(2):
        assert torch.equal(out[b], states[int(n[b])][b])
    with pytest.raises(ValueError, match="n_accept"):
        replay_commit(S0, k, v, g, beta, torch.tensor([4, 0], device=DEV))
    with pytest.raises(ValueError, match="g:"):
        replay_commit(S0, k, v, g[:2], beta, n)


@pytest.mark.gpu
def test_gpu_k3_head_dims_bitwise_equal_to_decode_kernel():
    S0, k, v, g, beta = _inputs(B=8, T=8, H=96, HV=96, K=128, V=128, dtype=torch.bfloat16)
    n = torch.arange(8, device=DEV) % 9
    out = replay_commit(S0, k, v, g, beta, n)
    states = _decode_states(S0, k, v, g, beta)
    for b in range(8):
        assert torch.equal(out[b], states[int(n[b])][b]), b


def test_in_place_fold_is_the_gathered_fold():
    """The engine's commit folds the states where they live in the pool (`replay_commit_into`: one read and one
    write of each state, not a gather, a fold into a new tensor and a scatter): the same bits as `replay_commit`
    of the gathered states for rows in any order, rows that accept nothing left untouched even when they share
    one (spare) row, the other pool rows untouched; the reference (`naive_replay_commit_into`) agrees."""
    from k3_kernels.replay_ssm import naive_replay_commit_into, replay_commit_into
    S0, k, v, g, beta = _inputs(B=4, T=3, H=1, HV=2, K=8, V=40, dtype=torch.bfloat16)
    g_ = torch.Generator().manual_seed(3)
    pool = torch.randn(7, 2, 8, 40, generator=g_).to(DEV)
    rows = torch.tensor([5, 0, 6, 6], device=DEV)   # the last two share the spare row 6, accepting nothing
    n = torch.tensor([3, 1, 0, 0], device=DEV)
    want = pool.clone()
    want[rows[:2]] = replay_commit(pool[rows], k, v, g, beta, n)[:2]
    got = pool.clone()
    replay_commit_into(got, rows, k, v, g, beta, n)
    assert torch.equal(got, want)
    ref = pool.cpu().clone()
    naive_replay_commit_into(ref, rows.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), n.cpu())
    torch.testing.assert_close(ref, want.cpu(), rtol=1e-5, atol=1e-5)
    assert torch.equal(ref[[1, 2, 3, 4, 6]], pool.cpu()[[1, 2, 3, 4, 6]])


def test_in_place_fold_refuses_bad_rows_before_writing():
    from k3_kernels.replay_ssm import replay_commit_into
    _, k, v, g, beta = _inputs(B=2, T=3, H=1, HV=2, K=8, V=16, dtype=torch.float32)
    pool = torch.randn(4, 2, 8, 16).to(DEV)
    before = pool.clone()
    n = torch.tensor([2, 1], device=DEV)
    for rows, match in ((torch.tensor([1, 1], device=DEV), "appears twice"), (torch.tensor([0, 4], device=DEV), "rows"),
                        (torch.tensor([0.0, 1.0], device=DEV), "rows"), (torch.tensor([0], device=DEV), "rows")):
        with pytest.raises(ValueError, match=match):
            replay_commit_into(pool, rows, k, v, g, beta, n)
    with pytest.raises(ValueError, match="store"):
        replay_commit_into(pool.double(), torch.tensor([0, 1], device=DEV), k, v, g, beta, n)
    with pytest.raises(ValueError, match="n_accept"):
        replay_commit_into(pool, torch.tensor([0, 1], device=DEV), k, v, g, beta, torch.tensor([4, 0], device=DEV))
    assert torch.equal(pool, before)


@pytest.mark.gpu
def test_gpu_in_place_fold_bitwise_equal_to_decode_kernel():
    from k3_kernels.replay_ssm import replay_commit_into
    S0, k, v, g, beta = _inputs(B=8, T=4, H=96, HV=96, K=128, V=128, dtype=torch.bfloat16)
    n = torch.arange(8, device=DEV) % 5
    pool = torch.zeros(10, 96, 128, 128, device=DEV)
    rows = torch.tensor([9, 3, 5, 0, 1, 7, 2, 4], device=DEV)
    pool[rows] = S0
    replay_commit_into(pool, rows, k, v, g, beta, n)
    states = _decode_states(S0, k, v, g, beta)
    for b in range(8):
        assert torch.equal(pool[rows[b]], states[int(n[b])][b]), b
