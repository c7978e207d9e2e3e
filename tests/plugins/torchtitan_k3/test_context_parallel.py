"""MLA's load-balanced causal context parallelism (k3_torchtitan.context_parallel.CPGatedMLA): exact against the
unsharded layer (forward, input and parameter gradients) on spawned gloo ranks, with the same attention work on
every rank, where contiguous shards give the last rank CP times the first's. (KDA's exact CP and both layers inside
the trainer are checked end to end by test_trainer.py's CP parity runs.)"""
from __future__ import annotations

import pytest

from k3_torchtitan.context_parallel import _ChunkExchange, balanced_query_chunks, mla_score_elements
from k3_torchtitan.cp_check import check_mla

REL_TOL = 1e-6  # ops.mla_attention computes in fp32: the sums are reordered, not approximated


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_chunk_exchange_sends_every_query_chunk_once_to_its_balanced_rank(cp):
    plans = [_ChunkExchange.plan(cp, r) for r in range(cp)]
    for r, plan in enumerate(plans):
        assert sorted(plan.sent) == [2 * r, 2 * r + 1] and sum(plan.sent_splits) == 2
        assert sorted(plan.received) == sorted(balanced_query_chunks(cp, r)) and sum(plan.received_splits) == 2
        for h, other in enumerate(plans):  # what h sends to r is what r expects from h, in the same order
            start = sum(other.sent_splits[:r])
            got = other.sent[start:start + other.sent_splits[r]]
            mine = sum(plan.received_splits[:h])
            assert got == plan.received[mine:mine + plan.received_splits[h]]
    assert sorted(c for r in range(cp) for c in balanced_query_chunks(cp, r)) == list(range(2 * cp))


def test_score_elements_balanced_equal_contiguous_grow_with_rank():
    seq = 4096
    for cp in (2, 4, 8):
        balanced, contiguous = mla_score_elements(seq, cp, balanced=True), mla_score_elements(seq, cp, balanced=False)
        assert len(set(balanced)) == 1 and contiguous == sorted(contiguous) and contiguous[-1] == cp * contiguous[0]
        assert balanced[0] == (2 * cp + 1) * (seq // (2 * cp)) ** 2 and max(balanced) < max(contiguous)


def test_balanced_mla_cp4_is_exact_and_balances_the_measured_work():
    got = check_mla(cp=4, seq_len=32, variant="balanced")
    assert got.max_abs_out <= REL_TOL * got.ref_abs_out, got
    assert got.max_abs_grad_x <= REL_TOL * got.ref_abs_grad_x, got
    assert got.max_abs_grad_params <= REL_TOL * got.ref_abs_grad_params, got
    assert got.score_elements == mla_score_elements(32, 4, balanced=True) == [144] * 4  # counted in the ranks
