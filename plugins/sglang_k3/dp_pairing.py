"""Bounded-wait DP prefill pairing inside SGLang's scheduler (`k3.rollout.dp_pairing.decide`).

SGLang's extension point for this decision is `PrefillDelayer` (`--enable-prefill-delayer`, DP attention): once per
forward pass every rank's `PrefillAdder` asks `PrefillDelayer._negotiate_should_allow_prefill_pure`, which
all-gathers six counts per rank over the TP group and returns one verdict. We wrap that method with an AROUND hook
(`sglang.srt.plugins.hook_registry`): with `SGLANG_K3_DP_PAIRING=1` the verdict comes from our rule, fed by the same
all-gather (SGLang's `_gather_info`, so every rank decides from identical counts) with the timeout field left 0
(no rank-local wall-clock timer enters the decision); the hard cap is SGLang's own `--prefill-delayer-max-delay-
passes` (N: at most N - 1 delayed passes, as SGLang's rule). Without the variable the hook calls SGLang's decision unchanged. No SGLang file is patched.

`delayer_policy` builds DP ranks' `PrefillDelayer`s (SGLang's class and decision code, hooked or not) for
`k3.rollout.dp_pairing.simulate`: the benchmark and the tests compare SGLang's settings and ours on one trace.
"""
from __future__ import annotations

import os
import time
from collections.abc import Sequence

from k3.rollout.dp_pairing import PairingConfig, PairingState, RankCounts, Reason, decide

TARGET = "sglang.srt.managers.prefill_delayer.PrefillDelayer._negotiate_should_allow_prefill_pure"
ENV = "SGLANG_K3_DP_PAIRING"
ENV_MIN_READY = "SGLANG_K3_DP_PAIRING_MIN_READY"   # optional: PairingConfig.min_ready_fraction (default 1.0)

_REASON = {Reason.NO_WORK: "", Reason.WAIT: "delay", Reason.CAP: "wait_timeout"}


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, negotiate_bounded, HookType.AROUND)


def wait_cap(max_delay_passes: int) -> int:
    """SGLang's `--prefill-delayer-max-delay-passes N` delays at most N - 1 passes in a row (its rule admits on the
    N-th); ours honours the same bound."""
    return max(0, int(max_delay_passes) - 1)


def pairing_config(delayer) -> PairingConfig | None:
    """Ours if `SGLANG_K3_DP_PAIRING=1` (read once per delayer), else None (SGLang's rule). A bad value is a
    ValueError naming the variable."""
    cached = getattr(delayer, "_k3_pairing", False)
    if cached is not False:
        return cached
    flag = os.environ.get(ENV, "0").strip()
    if flag not in ("0", "1", ""):
        raise ValueError(f"{ENV}: must be 0 or 1, got {flag!r}")
    cfg = None
    if flag == "1":
        raw = os.environ.get(ENV_MIN_READY, "1.0")
        try:
            frac = float(raw)
        except ValueError:
            raise ValueError(f"{ENV_MIN_READY}: must be a number in (0, 1], got {raw!r}") from None
        cfg = PairingConfig(max_wait_passes=wait_cap(delayer._max_delay_passes), min_ready_fraction=frac)
    delayer._k3_pairing = cfg
    return cfg


def negotiate_bounded(original, delayer, prev_state, local_prefillable: bool, token_usage: float,
                      running_batch: int = 0, max_prefill_bs: int = 0, max_running_requests: int = 0,
                      waiting_queue_len: int = 0):
    """AROUND hook on `PrefillDelayer._negotiate_should_allow_prefill_pure` (same signature after `original`)."""
    cfg = pairing_config(delayer)
    if cfg is None:
        return original(delayer, prev_state, local_prefillable, token_usage, running_batch=running_batch,
                        max_prefill_bs=max_prefill_bs, max_running_requests=max_running_requests,
                        waiting_queue_len=waiting_queue_len)
    from sglang.srt.managers.prefill_delayer import _NegotiateOutput, _State

    table = delayer._gather_info(local_prefillable=local_prefillable, local_token_watermark_force_allow=False,
                                 running_batch=running_batch, max_prefill_bs=max_prefill_bs,
                                 waiting_queue_len=waiting_queue_len, queue_timeout_expired=False)
    rows = table.tolist()
    counts = [RankCounts(waiting=max(1, int(r[4])) if int(r[0]) else 0, running=int(r[2])) for r in rows]
    waited = prev_state.delayed_count if prev_state is not None else 0
    d = decide(counts, PairingState(waited), cfg)
    estimation = "none" if d.ready == 0 else "all" if d.ready == len(rows) else "mixed"
    common = dict(input_estimation=estimation, num_prefillable=d.ready, num_token_watermark_force_allow=0)
    if not d.allow:
        start = prev_state.start_time if prev_state is not None else time.perf_counter()
        return _NegotiateOutput(next_state=_State(delayed_count=d.next_state.waited, start_time=start),
                                output_allow=False, output_reason="delay", **common)
    reason = _REASON.get(d.reason) or ("wait_success" if waited else "no_wait")
    wait = dict(wait_forward_passes=waited,
                wait_seconds=(time.perf_counter() - prev_state.start_time) if prev_state is not None else 0.0)
    return _NegotiateOutput(next_state=None, output_allow=True, output_reason=reason, **common, **wait)


# ---------------------------------------------------------------------- DP ranks for the simulator
def make_delayer(max_delay_passes: int, num_dp_ranks: int, token_usage_low_watermark: float | None = None):
    """A `PrefillDelayer` without its constructor: `__init__` reads the TP group and the scheduler's runtime
    context (a running server) only to set the attributes below and to allocate the all-gather buffer, which the
    simulator replaces (`_gather_info` returns the table it packs from every rank's counts). The decision code
    (`_negotiate_should_allow_prefill_pure`, hooked or not) is SGLang's, unchanged."""
    from sglang.srt.managers.prefill_delayer import PrefillDelayer

    d = object.__new__(PrefillDelayer)
    d._max_delay_passes = max_delay_passes
    d._token_usage_low_watermark = token_usage_low_watermark
    d._debug_log_enabled = False
    d._queue_min_ratio, d._max_delay_ms, d._queue_trigger_enabled = None, 5000.0, False
    d._prefill_max_requests = None
    d.num_dp_ranks, d.attn_dp_enabled = num_dp_ranks, True
    d._metrics_collector = None
    d._curr_state = None
    d.skip_first_delayer = True
    return d


def delayer_policy(max_delay_passes: int, max_running: int, ours: bool, min_ready_fraction: float = 1.0):
    """A `simulate` policy: one SGLang `PrefillDelayer` per rank, each deciding from the all-gathered table;
    `ours` routes the decision through `negotiate_bounded` (what the AROUND hook does in a server).
    Per-rank `max_prefill_bs` comes from SGLang's `RecentPrefillBatchSizeTracker`, fed as the scheduler does."""
    import torch
    from sglang.srt.managers.prefill_delayer import PrefillDelayer, RecentPrefillBatchSizeTracker

    pure = PrefillDelayer.__dict__["_negotiate_should_allow_prefill_pure"]
    original = getattr(pure, "__wrapped__", pure)          # SGLang's own, even if the hook is applied
    ranks: list = []
    trackers: list[RecentPrefillBatchSizeTracker] = []

    def policy(counts: Sequence[RankCounts], mid_chunk: Sequence[bool]) -> list[bool]:
        n = len(counts)
        while len(ranks) < n:
            d = make_delayer(max_delay_passes, n)
            if ours:
                d._k3_pairing = PairingConfig(wait_cap(max_delay_passes), min_ready_fraction)
            ranks.append(d)
            trackers.append(RecentPrefillBatchSizeTracker())
        # the six fields each rank all-gathers: prefillable, watermark force, running, max_prefill_bs, queue, timeout
        table = torch.tensor([[int(c.waiting > 0), 0, c.running, trackers[k].max_prefill_bs, c.waiting, 0]
                              for k, c in enumerate(counts)], dtype=torch.int64)
        out = []
        for k, (d, c) in enumerate(zip(ranks, counts)):
            d._gather_info = lambda **_: table
            args = (d._curr_state, c.waiting > 0, 0.5)
            kw = dict(running_batch=c.running, max_prefill_bs=trackers[k].max_prefill_bs,
                      max_running_requests=max_running, waiting_queue_len=c.waiting)
            res = negotiate_bounded(original, d, *args, **kw) if ours else original(d, *args, **kw)
            d._curr_state = res.next_state
            out.append(bool(res.output_allow))
            if c.waiting > 0:     # the scheduler's finalize: the batch size tried (admitted or not)
                trackers[k].observe_attempt(min(c.waiting, max(1, max_running - c.running)))
        return out
    return policy
