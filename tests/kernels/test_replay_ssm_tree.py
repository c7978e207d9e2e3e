"""Token-tree verify for KDA (kernels/replay_ssm/tree.py, reference naive.naive_tree_verify): every node's output is
the decode step from its parent's state -- bitwise what the decode kernel (fused_recurrent_kda, one token per call)
outputs along the node's path -- and the accepted node's state is the ReplaySSM commit of its path (bitwise the
chain fold `replay_commit` of the path's inputs); the reference is bitwise plain torch decoding along each path.
CPU: TRITON_INTERPRET=1 at small shapes; GPU: K3's head dims in bf16 with a 2x3 tree."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from k3_kernels.kda import fused_recurrent_kda, l2norm, naive_recurrent_kda
from k3_kernels.replay_ssm import naive_tree_verify, path_inputs, replay_commit, tree_paths, tree_verify

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"

# per row: a 2x2 tree (6 nodes), a chain, a star and a mixed shape, all N = 6 nodes
PARENTS = [[-1, -1, 0, 0, 1, 1], [-1, 0, 1, 2, 3, 4], [-1, -1, -1, -1, -1, -1], [-1, 0, 0, 2, -1, 4]]


def _inputs(B, N, H, HV, K, V, dtype, device=DEV, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(N, B, H, K, generator=g)).to(dtype)
    k = l2norm(torch.randn(N, B, H, K, generator=g)).to(dtype)
    v = torch.randn(N, B, HV, V, generator=g).to(dtype)
    gate = F.logsigmoid(torch.randn(N, B, HV, K, generator=g)) * 0.5
    beta = torch.rand(N, B, HV, generator=g)
    S0 = torch.randn(B, HV, K, V, generator=g)
    return [x.to(device) for x in (S0, q, k, v, gate, beta)]


def _decode_along_path(fn, S0, q, k, v, g, beta, parents, b, n):
    """Plain decoding of row b along node n's path (one token per call): (output at n, state after n)."""
    path, m = [], n
    while m >= 0:
        path.append(m)
        m = parents[b][m]
    S = S0[b:b + 1]
    for m in reversed(path):
        o, S = fn(q[m, b:b + 1, None], k[m, b:b + 1, None], v[m, b:b + 1, None], g[m, b:b + 1, None],
                  beta[m, b:b + 1, None], initial_state=S, output_final_state=True)
    return o[0, 0], S[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_kernel_matches_reference_and_decode_kernel(dtype):
    B, N = len(PARENTS), len(PARENTS[0])
    S0, q, k, v, g, beta = _inputs(B, N, H=2, HV=2, K=16, V=16, dtype=dtype)
    parents = torch.tensor(PARENTS, device=DEV)
    accept = torch.tensor([3, 5, -1, 5], device=DEV)
    o, S = tree_verify(S0, q, k, v, g, beta, parents, accept)
    o_ref, S_ref = naive_tree_verify(*(x.cpu() for x in (S0, q, k, v, g, beta, parents, accept)))
    torch.testing.assert_close(o.cpu().float(), o_ref.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(S.cpu(), S_ref, rtol=1e-5, atol=1e-5)
    for b in range(B):   # bitwise the decode kernel along every node's path
        for n in range(N):
            o_dec, S_dec = _decode_along_path(fused_recurrent_kda, S0, q, k, v, g, beta, PARENTS, b, n)
            assert torch.equal(o[n, b], o_dec), (b, n)
            if int(accept[b]) == n:
                assert torch.equal(S[b], S_dec), b
        if int(accept[b]) < 0:
            assert torch.equal(S[b], S0[b])
    # the commit of the accepted path is the chain fold of its inputs
    chain = [path_inputs(x, parents, accept) for x in (k, v, g, beta)]
    folded = replay_commit(S0, *(c[0] for c in chain), chain[0][1])
    assert torch.equal(folded, S)


def test_precomputed_paths_are_the_kernel_paths():
    """A captured graph cannot run host work: the engine packs `tree_paths(parents, width=N)` with the tree's other
    indices and passes them in. Padded to a wider fixed width they give the same bits as the paths computed inside."""
    B, N = len(PARENTS), len(PARENTS[0])
    S0, q, k, v, g, beta = _inputs(B, N, H=2, HV=2, K=16, V=16, dtype=torch.float32)
    parents = torch.tensor(PARENTS, device=DEV)
    accept = torch.tensor([3, 5, -1, 5], device=DEV)
    o, S = tree_verify(S0, q, k, v, g, beta, parents, accept)
    paths = tuple(x.to(DEV).long() for x in tree_paths(parents, width=N + 2))
    assert paths[0].shape == (B, N, N + 2) and tree_paths(parents)[0].shape == (B, N, N)   # deepest: row 1's chain
    o2, S2 = tree_verify(S0, q, k, v, g, beta, parents, accept, paths=paths)
    assert torch.equal(o, o2) and torch.equal(S, S2)
    with pytest.raises(ValueError, match="paths: expected"):
        tree_verify(S0, q, k, v, g, beta, parents, accept, paths=(paths[0][:, :2], paths[1]))
    with pytest.raises(ValueError, match="width: 5 cannot hold"):
        tree_paths(parents, width=5)


def test_reference_is_plain_decoding_along_each_path():
    B, N = len(PARENTS), len(PARENTS[0])
    S0, q, k, v, g, beta = _inputs(B, N, H=1, HV=2, K=8, V=8, dtype=torch.float32, device="cpu")   # HV = 2 H
    parents = torch.tensor(PARENTS)
    o, S = naive_tree_verify(S0, q, k, v, g, beta, parents, torch.tensor([2, 0, 4, 3]))
    for b in range(B):
        for n in range(N):
            o_dec, _ = _decode_along_path(naive_recurrent_kda, S0, q, k, v, g, beta, PARENTS, b, n)
            assert torch.equal(o[n, b], o_dec), (b, n)
    assert naive_tree_verify(S0, q, k, v, g, beta, parents)[1] is None


def test_bad_trees_are_named():
    S0, q, k, v, g, beta = _inputs(2, 3, H=1, HV=1, K=8, V=8, dtype=torch.float32)
    good = torch.tensor([[-1, 0, 0], [-1, -1, 1]], device=DEV)
    for fn in (naive_tree_verify, tree_verify):
        with pytest.raises(ValueError, match="parents: node n's parent"):
            fn(S0, q, k, v, g, beta, torch.tensor([[-1, 2, 0], [-1, -1, 1]], device=DEV))
        with pytest.raises(ValueError, match="parents: expected int"):
            fn(S0, q, k, v, g, beta, good[:, :2])
        with pytest.raises(ValueError, match="accept_node"):
            fn(S0, q, k, v, g, beta, good, torch.tensor([0, 3], device=DEV))
        with pytest.raises(ValueError, match="q:"):
            fn(S0, q[:2], k, v, g, beta, good)


@pytest.mark.gpu
def test_gpu_k3_head_dims_2x3_tree_bitwise_equal_to_decode_kernel():
    from k3.rollout.spec.tree import build_tree
    t = build_tree([[1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 5, 7], [8, 9, 10], [8, 9, 11], [8, 12, 13], [8, 12, 14]],
                   branching=2, depth=3, max_nodes=14)
    assert len(t) == 14
    parents = [list(t.parents)] * 8
    S0, q, k, v, g, beta = _inputs(B=8, N=14, H=96, HV=96, K=128, V=128, dtype=torch.bfloat16)
    accept = torch.tensor([-1, 0, 1, 2, 6, 9, 13, 10], device=DEV)
    o, S = tree_verify(S0, q, k, v, g, beta, torch.tensor(parents, device=DEV), accept)
    for b in range(8):
        for n in range(14):
            o_dec, S_dec = _decode_along_path(fused_recurrent_kda, S0, q, k, v, g, beta, parents, b, n)
            assert torch.equal(o[n, b], o_dec), (b, n)
            if int(accept[b]) == n:
                assert torch.equal(S[b], S_dec), b
