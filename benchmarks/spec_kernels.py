"""The speculative commit's and tree verify's kernels against their torch references at K3's dims (96 heads x 128),
on the GPU: the rows of benchmarks/spec_decode.py's GPU section that time kernels rather than decoding."""
from __future__ import annotations

import torch


def replay_kernel_rows(B: int = 8, H: int = 96, K: int = 128, device: str = "cuda") -> dict:
    """Medians (`triton.testing.do_bench`) of: the Triton replay commit vs the torch fold (B rows, 4 verify positions,
    3 accepted); the engine's commit of 3 KDA layers' pool rows gathered, folded and scattered back vs folded in
    place; the Triton tree verify of a 2x3 token tree (pending token + 14 nodes) vs its reference."""
    import triton.testing
    from k3.rollout.spec.tree import build_tree
    from k3_kernels.replay_ssm import (naive_replay_commit, naive_tree_verify, replay_commit, replay_commit_into,
                                       tree_verify)
    T, dev = 4, device

    def median_ms(fn):
        return triton.testing.do_bench(fn, return_mode="median")

    args = (torch.randn(B, H, K, K, device=dev), torch.randn(T, B, H, K, device=dev).bfloat16(),
            torch.randn(T, B, H, K, device=dev).bfloat16(), -torch.rand(T, B, H, K, device=dev),
            torch.rand(T, B, H, device=dev), torch.full((B,), 3, device=dev))
    tri = median_ms(lambda: replay_commit(*args))
    ref = median_ms(lambda: naive_replay_commit(*args))
    layers = 3
    pool = torch.randn(4 * B * layers, H, K, K, device=dev)
    rows = torch.arange(0, 4 * B * layers, 4, device=dev)[:B * layers]
    fold_args = tuple(x.repeat_interleave(layers, dim=1) for x in args[1:5]) + (args[5].repeat_interleave(layers),)

    def gathered():
        pool[rows] = replay_commit(pool[rows], *fold_args)
    gathered_ms = median_ms(gathered)
    in_place_ms = median_ms(lambda: replay_commit_into(pool, rows, *fold_args, checked=True))
    tree = build_tree([[1, 2, 3], [1, 2, 4], [1, 5, 6], [1, 5, 7], [8, 9, 10], [8, 9, 11], [8, 12, 13],
                       [8, 12, 14]], branching=2, depth=3, max_nodes=14)
    N = len(tree) + 1   # the pending token and 14 nodes
    parents = torch.tensor([tree.verify_parents()] * B, device=dev)
    targs = (torch.randn(B, H, K, K, device=dev), torch.randn(N, B, H, K, device=dev).bfloat16(),
             torch.randn(N, B, H, K, device=dev).bfloat16(), torch.randn(N, B, H, K, device=dev).bfloat16(),
             -torch.rand(N, B, H, K, device=dev), torch.rand(N, B, H, device=dev), parents)
    tri_tree = median_ms(lambda: tree_verify(*targs))
    ref_tree = median_ms(lambda: naive_tree_verify(*targs))
    return {"replay_commit": {"shape": f"B={B} T={T} H={H} K=V={K}, 3 accepted, bf16 k/v", "triton_ms_median": tri,
                              "torch_fold_ms_median": ref, "speedup": ref / tri,
                              "pool_3_layers": {"gather_fold_scatter_ms_median": gathered_ms,
                                                "in_place_ms_median": in_place_ms,
                                                "speedup": gathered_ms / in_place_ms}},
            "tree_verify": {"shape": f"B={B}, 2x3 tree (pending + 14 nodes), H={H} K=V={K}, bf16 q/k/v",
                            "triton_ms_median": tri_tree, "torch_reference_ms_median": ref_tree,
                            "speedup": ref_tree / tri_tree}}
