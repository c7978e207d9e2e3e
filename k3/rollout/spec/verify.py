"""The verify pass of a chain draft: the target scores the pending token and the draft of every row of one decode
group, writing the MLA latents of all verify positions into the rows' pages and, for KDA, only the step inputs
(ReplayScratch) -- the state pool is never written here. `commit.py` keeps the accepted prefix.

EXACT mode runs each verify position with decode's shapes ([decode_batch, 1]); the KDA layers continue from a
working state that lives only in this pass (one per seat, overwritten position by position, as decode's own
activations are). BATCHED mode runs one [decode_batch, T] forward from the committed states.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from k3.rollout.spec.config import VerifyMode
from k3.rollout.spec.scratch import ReplayScratch
from k3.rollout.view import PoolView

if TYPE_CHECKING:
    from k3.rollout.engine import Engine, _Seq


class SpecView(PoolView):
    """PoolView for verify positions [t0, t0+T): MLA as usual (the rows' `pos` is set to pos0 + t0 by the caller);
    KDA reads the committed state (t0 == 0) or this pass's working state, records the step inputs into the
    scratch and never writes the pool."""

    def __init__(self, eng: "Engine", rows: list["_Seq | None"], T: int, t0: int, scratch: ReplayScratch,
                 row_of_seat: list[int | None], working: dict[int, tuple[torch.Tensor, torch.Tensor]]):
        super().__init__(eng, rows, T)
        self.t0, self.scratch, self.working = t0, scratch, working
        self.rec_seats = [b for b, r in enumerate(rows) if r is not None]
        self.rec_rows = [row_of_seat[b] for b in self.rec_seats]

    def kda(self, layer):
        if self.t0 == 0:
            return super().kda(layer)
        rec, conv = self.working[layer]
        empty = [b for b, r in enumerate(self.rows) if r is None]
        if empty:   # seats without a row this position start fresh, as decode's dummy seats do
            rec, conv = rec.clone(), conv.clone()
            rec[empty] = 0
            conv[empty] = 0
        return rec, conv

    def set_kda(self, layer, recurrent, conv):
        self.working[layer] = (recurrent, conv)

    def record_kda_inputs(self, layer, k, v, g, beta, conv_in):
        s = self.rec_seats
        self.scratch.store(self.eng.kda_index[layer], self.rec_rows, self.t0, k[s], v[s], g[s], beta[s], conv_in[s])


@dataclass
class VerifyResult:
    logits: list[list[torch.Tensor]]    # [row][t] logits [vocab] after position t (t < len(tokens[row]))
    routing: list[list[torch.Tensor]]   # [row][t] routed experts of position t
    scratch: ReplayScratch
    forwards: int
    features: list[list[torch.Tensor]] | None = None   # [row][t] the target's drafter features of position t


@contextlib.contextmanager
def _at_positions(rows: list["_Seq"], offset: int):
    """Temporarily place every row at pos0 + offset (PoolView reads `pos` for its page writes and key lengths)."""
    pos0 = [s.pos for s in rows]
    for s, p in zip(rows, pos0):
        s.pos = p + offset
    try:
        yield
    finally:
        for s, p in zip(rows, pos0):
            s.pos = p


def verify(eng: "Engine", rows: list["_Seq"], tokens: list[list[int]], mode: VerifyMode,
           capture=None, keep_going=None) -> VerifyResult:
    """Score `tokens[r]` (the pending token, then the draft) for every row; rows must have their pages prepared
    for len(tokens[r]) positions. The decode batch size is the engine's `decode_batch` (rows <= it). `capture`: a
    drafter.FeatureCapture whose hooks are on the target during the pass (features returned per row, position).
    `keep_going(r, t, logits)` (EXACT mode): False once row r's draft is known rejected after position t; its later
    positions are then not computed (greedy rows: the target's argmax differs from the draft)."""
    B = eng.cfg.decode_batch
    if len(rows) > B:
        raise ValueError(f"verify: {len(rows)} rows exceed decode_batch {B}")
    T = max(len(t) for t in tokens)
    mc = eng.model.config
    scratch = ReplayScratch.allocate(mc, len(eng.kda_index), eng.dtype, len(rows), T, eng.device)
    row_of_seat: list[int | None] = list(range(len(rows))) + [None] * (B - len(rows))
    logits: list[list[torch.Tensor]] = [[] for _ in rows]
    routing: list[list[torch.Tensor]] = [[] for _ in rows]
    working: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    forwards = 0
    features: list[list[torch.Tensor]] | None = [[] for _ in rows] if capture is not None else None
    spans = [(t, 1) for t in range(T)] if mode is VerifyMode.EXACT else [(0, T)]
    stopped = [False] * len(rows)
    for t0, width in spans:
        seats = [s if (r is not None and len(tokens[r]) > t0 and not stopped[r]) else None
                 for s, r in zip(rows + [None] * (B - len(rows)), row_of_seat)]
        live = [s for s in seats if s is not None]
        if not live:   # every row's draft was rejected earlier (or is shorter)
            break
        ids = torch.zeros(B, width, dtype=torch.long)
        for b, s in enumerate(seats):
            if s is not None:
                toks = tokens[row_of_seat[b]][t0:t0 + width]
                ids[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
                ids[b, len(toks):] = toks[-1]   # batched mode: rows with shorter drafts repeat their last token
        with _at_positions(live, t0):
            view = SpecView(eng, seats, width, t0, scratch, row_of_seat, working)
            with eng._adapters_for(seats), (capture if capture is not None else contextlib.nullcontext()):
                out = eng.model(ids.to(eng.device), view, return_routed_experts=True)
            feats = capture.features() if capture is not None else None
        forwards += 1
        for b, s in enumerate(seats):
            if s is None:
                continue
            r = row_of_seat[b]
            for j in range(width):
                if t0 + j < len(tokens[r]):
                    logits[r].append(out.logits[b, j])
                    if feats is not None:
                        features[r].append(feats[b, j])
                    routing[r].append(out.routed_experts[b, j] if out.routed_experts is not None
                                      else torch.zeros(0, dtype=torch.long))
            if keep_going is not None and width == 1 and not keep_going(r, t0, out.logits[b, 0]):
                stopped[r] = True
    return VerifyResult(logits, routing, scratch, forwards, features)
