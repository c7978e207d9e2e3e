"""K3_REPLAY / K3_REPLAY_TREE through SGLang's speculative contract.

Real SGLang: the registry (`SpeculativeAlgorithm.from_string` / `create_worker` after `load_plugins()`), the
KDA kit's `KDAAttnBackend` + `HybridLinearAttnBackend` (pools, conv with intermediate windows, verify metadata,
`EagleVerifyInput`), and the commit path `commit_mamba_states_after_verify` ->
`update_mamba_state_after_mtp_verify` (hooked). Stand-ins, and why: the kit's runner is SGLang's own test
ModelRunner; the target worker is a namespace holding it (TpModelWorker builds a CUDA model), and the batch is a
namespace with the five fields the commit reads (ScheduleBatch needs a live scheduler).
"""
from types import SimpleNamespace

import pytest
import torch

from _sglang_helpers import ContextOverride, load_k3_plugins, rebind_triton_aliases, run_kda_verify

load_k3_plugins()

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from sglang.srt.speculative.spec_utils import commit_mamba_states_after_verify  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import kda_attention as kit  # noqa: E402

from k3_sglang import spec  # noqa: E402

rebind_triton_aliases()
D = 3  # draft tokens per request (position 0: the pending token)


def _scatter_on_cpu(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None):
    """SGLang's commit scatter kernels refuse CPU tensors; this is their documented semantics in torch:
    for each row i with step >= 0: dst[:, dst_indices[i]] = src[:, src_row[i], step[i]]."""
    rows = torch.arange(step_indices_raw.shape[0]) if src_indices_raw is None else src_indices_raw.long()
    for i in range(step_indices_raw.shape[0]):
        if int(step_indices_raw[i]) >= 0:
            dst[:, int(dst_indices_raw[i])] = src[:, int(rows[i]), int(step_indices_raw[i])]


@pytest.fixture(autouse=True)
def _cpu_scatter(monkeypatch):
    from sglang.kernels.ops.mamba import mamba_state_scatter_triton as scatter

    monkeypatch.setattr(scatter, "fused_mamba_state_scatter_with_mask", _scatter_on_cpu)
    monkeypatch.setattr(scatter, "fused_conv_window_scatter_with_mask", _scatter_on_cpu)
    monkeypatch.setattr(scatter, "_conv_multi_eligible", lambda pairs: False)


def _verified_fixture(monkeypatch, topk: int, algorithm: str | None):
    real = kit.get_context
    fields = dict(linear_attn_backend="k3", speculative_eagle_topk=topk)
    if algorithm:
        fields["speculative_algorithm"] = algorithm
    monkeypatch.setattr(kit, "get_context", lambda: ContextOverride(real(), **fields))
    case = kit.KDAAttentionCase(name=f"replay_topk{topk}", backend="torch_native",
                                forward_mode=ForwardMode.TARGET_VERIFY, num_k_heads=2, num_v_heads=2, page_size=1,
                                prefix_lens=(4, 7), extend_lens=(D, D))
    fixture, inputs, pool_before, out = run_kda_verify(case, topk)
    return fixture, case, inputs, pool_before, out


def _commit(fixture, case, accepted_node, topk):
    """SGLang's commit entry point for an accept: accept_index holds each row's accepted verify positions."""
    runner = fixture.runner
    runner.attn_backend = fixture.backend
    runner.model = fixture.actual_module  # the commit passes it along; the KDA layers never read it
    runner.model_config.linear_attn_registry_result = (None, SimpleNamespace())  # "a hybrid linear model"
    B = case.batch_size
    parents = kit._kda_verify_parent_indices(D, topk)
    accept_index = torch.full((B, D), -1, dtype=torch.int64)
    accept_lens = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        path, node = [], int(accepted_node[b])
        while node >= 0:
            path.append(node)
            node = parents[node]
        path = path[::-1]
        accept_index[b, : len(path)] = torch.tensor(path) + b * D
        accept_lens[b] = len(path)
    batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY,
                            req_pool_indices=fixture.forward_batch.req_pool_indices, mamba_track_indices=None,
                            seq_lens=fixture.forward_batch.seq_lens, tree_cache=None)
    commit_mamba_states_after_verify(SimpleNamespace(model_runner=runner), batch, accept_lens, accept_index, D)


def test_algorithms_register_and_sglang_builds_our_worker_class():
    from k3_sglang.spec_worker import K3ReplayWorker
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    for name in (spec.CHAIN, spec.TREE):
        algo = SpeculativeAlgorithm.from_string(name.lower())  # the CLI spelling is case-insensitive
        assert algo.name == name and algo.is_speculative() and not algo.is_eagle()
        assert algo.create_worker(SimpleNamespace(disable_overlap_schedule=True)) is K3ReplayWorker
    assert issubclass(K3ReplayWorker, BaseSpecWorker)


@pytest.mark.parametrize("topk,accepted", [(1, (2, 0)), (2, (2, 1))], ids=["chain", "tree"])
def test_replay_commit_equals_sglangs_per_draft_state_commit(monkeypatch, topk, accepted):
    """The same verify + accept, committed two ways: SGLang's (per-draft intermediate states, our kernel writing
    them) and ReplaySSM's (inputs only, folded at commit). Same outputs, same committed states."""
    accepted = torch.tensor(accepted)
    base, case, inputs, before, out_base = _verified_fixture(monkeypatch, topk, None)
    _commit(base, case, accepted, topk)
    want = kit._ssm_states(base).clone()
    assert not spec.pending_layers()
    algorithm = spec.CHAIN if topk == 1 else spec.TREE
    replay, _, _, before_replay, out_replay = _verified_fixture(monkeypatch, topk, algorithm)
    assert torch.equal(before_replay, before)  # identical seeds: the same prefix states
    torch.testing.assert_close(out_replay, out_base, atol=2e-5, rtol=2e-5)
    pending = spec.pending_layers()
    assert len(pending) == 1
    (stored,) = pending.values()
    state_bytes = case.batch_size * D * 2 * 32 * 32 * 4
    assert stored.nbytes * 10 < state_bytes  # inputs, not states: 2*32*3+2 floats per token vs 2*32*32
    assert torch.equal(kit._ssm_states(replay), before)  # verify commits nothing
    _commit(replay, case, accepted, topk)
    assert not spec.pending_layers()
    rows = kit._cache_indices(replay)
    torch.testing.assert_close(kit._ssm_states(replay)[rows], want[rows], atol=2e-5, rtol=2e-5)
    assert not torch.equal(kit._ssm_states(replay)[rows], before[rows])  # it did move


@pytest.mark.parametrize("fields,match", [
    (dict(linear_attn_backend="triton"), "--linear-attn-backend k3"),
    (dict(speculative_eagle_topk=2), "chain"),
    (dict(speculative_num_draft_tokens=40), "num-draft-tokens"),
    (dict(mamba_radix_cache_strategy="extra_buffer"), "no_buffer"),
])
def test_validator_refuses_what_the_chain_algorithm_cannot_serve(fields, match):
    good = dict(linear_attn_backend="k3", linear_attn_decode_backend=None, linear_attn_verify_backend=None,
                speculative_eagle_topk=1, speculative_num_draft_tokens=4, mamba_radix_cache_strategy="no_buffer")
    spec.validate_server_args(SimpleNamespace(**good), tree=False)
    with pytest.raises(ValueError, match=match):
        spec.validate_server_args(SimpleNamespace(**{**good, **fields}), tree=False)
    with pytest.raises(ValueError, match="topk >= 2"):
        spec.validate_server_args(SimpleNamespace(**good), tree=True)


# --- the worker, built as SGLang builds it ----------------------------------------------------------------------
from _sglang_helpers import server_args  # noqa: E402


def _worker(topk: int, draft_tokens: int):
    with server_args(speculative_num_draft_tokens=draft_tokens, speculative_eagle_topk=topk):
        cls = SpeculativeAlgorithm.from_string(spec.TREE if topk > 1 else spec.CHAIN).create_worker(
            SimpleNamespace(disable_overlap_schedule=True))
        # TpModelWorker needs a CUDA model runner; the worker only stores it at construction
        return cls(server_args=SimpleNamespace(), gpu_id=0, nccl_port=0, target_worker=SimpleNamespace())


def _logits_choosing(tokens_by_position, vocab=16):
    out = torch.full((len(tokens_by_position), vocab), -10.0)
    for i, t in enumerate(tokens_by_position):
        out[i, t] = 10.0
    return out


def test_chain_worker_drafts_from_history_and_accepts_the_matching_prefix():
    w = _worker(topk=1, draft_tokens=4)
    assert w.draft_worker is None and w.weight_update_runners() == []  # no draft weights to update
    ctx = [1, 2, 3, 4, 1, 2]  # "1 2" occurred before, followed by "3 4 1"
    (tree,) = w.draft_trees([ctx])
    assert tree.tokens == (3, 4, 1) and tree.is_chain()
    layout = w.verify_layout([ctx[-1]], [tree])
    assert layout.tokens.tolist() == [[2, 3, 4, 1]] and layout.parents.tolist() == [[-1, 0, 1, 2]]
    assert layout.retrieve_next_token.tolist() == [[1, 2, 3, -1]]
    # target: after 2 -> 3 (accept), after 3 -> 4 (accept), after 4 -> 9 (reject 1: correction 9)
    acc = w.accept(layout, _logits_choosing([3, 4, 9, 0]))
    assert acc.accept_lens.tolist() == [3] and acc.accept_index.tolist() == [[0, 1, 2, -1]]
    assert acc.emitted == [[3, 4, 9]]


def test_tree_worker_walks_into_the_branch_the_target_chose_and_ignores_padding():
    w = _worker(topk=2, draft_tokens=5)
    ctx = [7, 1, 5, 6, 7, 1, 8, 9, 7, 1]  # "7 1" was followed by "5 6" and by "8 9"
    (tree,) = w.draft_trees([ctx])
    assert not tree.is_chain() and set(tree.tokens) <= {5, 6, 8, 9} and len(tree) <= 4
    layout = w.verify_layout([ctx[-1]], [tree])
    assert layout.real.sum() == 1 + len(tree)
    eight = 1 + tree.tokens.index(8)  # verify position of node "8"
    nine = 1 + tree.tokens.index(9)
    choices = [0] * 5
    choices[0], choices[eight], choices[nine] = 8, 9, 3  # root -> 8 -> 9 -> (3: not drafted)
    acc = w.accept(layout, _logits_choosing(choices))
    assert acc.emitted == [[8, 9, 3]] and acc.accept_lens.tolist() == [3]
    assert acc.accept_index[0, :3].tolist() == [0, eight, nine]
    # SGLang's tree links are consistent with the parents: every child's first sibling chain returns to its parent
    for i in range(1, 5):
        p = int(layout.parents[0, i])
        first, seen = int(layout.retrieve_next_token[0, p]), []
        while first >= 0:
            seen.append(first)
            first = int(layout.retrieve_next_sibling[0, first])
        assert i in seen
