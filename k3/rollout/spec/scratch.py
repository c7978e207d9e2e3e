"""ReplaySSM scratch: what a verify pass stores per draft position of each KDA layer (the projections the step
inputs are rebuilt from), allocated for the running requests of one verify (never per pool slot), and what it
costs against one fp32 state snapshot per draft."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.config import K3Config


def scratch_layout(mc: K3Config, dtype: torch.dtype, positions: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per sequence and KDA layer: name -> (shape, dtype) of what the verify pass stores for `positions` draft
    positions: the layer's projections of each position, in the model dtype as the projections output them -- the
    pre-conv q/k/v inputs (the short-conv windows roll forward by them), the gate's f = f_b(f_a(x)) and beta's
    logit b_proj(x). The commit rebuilds k, v (conv, SiLU, L2Norm), the log-decay g and beta from them with the
    layer's own `step_inputs` at decode's shapes, so they are bitwise what decode computes; storing post-conv k, v
    and fp32 g, beta instead costs 1.75x as much (NOTES.md). No recurrent state."""
    H, K = mc.kda_num_heads, mc.kda_head_dim
    return {"conv_in": ((positions, 3, H * K), dtype), "f": ((positions, H * K), dtype), "b": ((positions, H), dtype)}


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return torch.empty(shape, dtype=dtype, device="meta").numel() * torch.empty((), dtype=dtype).element_size()


def scratch_bytes_per_sequence_layer(mc: K3Config, dtype: torch.dtype, positions: int) -> int:
    """Bytes `ReplayScratch` allocates per sequence per KDA layer for `positions` positions (from the layout the
    allocation uses)."""
    return sum(_nbytes(s, dt) for s, dt in scratch_layout(mc, dtype, positions).values())


def snapshot_bytes_per_draft(mc: K3Config) -> int:
    """One fp32 recurrent-state snapshot [H, K, V] (what per-draft snapshotting keeps for every draft token)."""
    H, K = mc.kda_num_heads, mc.kda_head_dim
    return _nbytes((H, K, K), torch.float32)


@dataclass
class ReplayScratch:
    """Step inputs of one verify pass: for every KDA layer (engine index) and name, [R, T, ...] for the R running
    requests of the pass (row r = request r of the pass) and T positions."""
    bufs: list[dict[str, torch.Tensor]]
    rows: int
    positions: int

    @staticmethod
    def allocate(mc: K3Config, n_kda_layers: int, dtype: torch.dtype, rows: int, positions: int,
                 device: torch.device) -> "ReplayScratch":
        layout = scratch_layout(mc, dtype, positions)
        bufs = [{name: torch.zeros((rows, *shape), dtype=dt, device=device) for name, (shape, dt) in layout.items()}
                for _ in range(n_kda_layers)]
        return ReplayScratch(bufs, rows, positions)

    def nbytes(self) -> int:
        return sum(t.nbytes for layer in self.bufs for t in layer.values())

    def store(self, ki: int, rows: list[int], t0: int, conv_in: torch.Tensor, f: torch.Tensor,
              b: torch.Tensor) -> None:
        """Positions [t0, t0+T) of requests `rows` from one forward's per-seat tensors [len(rows), T, ...]."""
        T = conv_in.shape[1]
        buf = self.bufs[ki]
        idx = torch.as_tensor(rows, dtype=torch.long, device=buf["f"].device)
        for name, x in (("conv_in", conv_in), ("f", f), ("b", b)):
            if x.dtype != buf[name].dtype:
                raise ValueError(f"ReplayScratch.store: {name} is {x.dtype}, the scratch holds {buf[name].dtype} "
                                 f"(a cast would change the replayed bits)")
            buf[name][idx, t0:t0 + T] = x

    def store_seats(self, ki: int, conv_in: torch.Tensor, f: torch.Tensor, b: torch.Tensor) -> None:
        """Positions [0, T) of every row from one forward's [rows, T, ...] tensors (a fixed-shape verify whose
        seats are the scratch's rows: k3.rollout.graphs; no index tensor, so it can be captured)."""
        buf = self.bufs[ki]
        for name, x in (("conv_in", conv_in), ("f", f), ("b", b)):
            if x.dtype != buf[name].dtype or x.shape[0] != self.rows:
                raise ValueError(f"ReplayScratch.store_seats: {name} is {x.dtype} {tuple(x.shape)}, the scratch "
                                 f"holds {self.rows} rows of {buf[name].dtype}")
            buf[name][:, :x.shape[1]] = x

    def first_rows(self, rows: int) -> "ReplayScratch":
        """The first `rows` rows (views, no copy)."""
        return ReplayScratch([{name: t[:rows] for name, t in layer.items()} for layer in self.bufs], rows,
                             self.positions)

    def seats(self, ki: int, name: str, seat_of_row: list[int], n_seats: int) -> torch.Tensor:
        """Position-major [T, n_seats, ...] contiguous, request r at seat seat_of_row[r], zeros in empty seats (the
        replay runs at the decode batch size, as decode does)."""
        src = self.bufs[ki][name]
        if len(seat_of_row) == n_seats == self.rows and seat_of_row == list(range(n_seats)):   # every seat a row
            return src.transpose(0, 1).contiguous()   # (no index tensor: a captured commit takes this path)
        out = src.new_zeros(self.positions, n_seats, *src.shape[2:])
        out[:, seat_of_row] = src.transpose(0, 1)
        return out

    def by_seat(self, ki: int, name: str, n_seats: int) -> torch.Tensor:
        """Seat-major [n_seats, T, ...], request r at seat r, zeros in empty seats: a view when every seat is a
        request (the captured commit), else a copy."""
        src = self.bufs[ki][name]
        if self.rows == n_seats:
            return src
        out = src.new_zeros(n_seats, *src.shape[1:])
        out[:self.rows] = src
        return out

    def reorder(self, order: list[list[int]]) -> None:
        """Row r's positions order[r] move to positions 0, 1, ... (a batched tree verify keeps its walked path)."""
        if all(list(idx) == list(range(len(idx))) for idx in order):   # nothing moves
            return
        R, T = len(order), self.positions
        dev = self.bufs[0]["f"].device if self.bufs else torch.device("cpu")
        # one index for every layer and name (one host-to-device copy); positions past a row's path stay put
        index = torch.tensor([list(idx) + list(range(len(idx), T)) for idx in order], dtype=torch.long).to(dev)
        rows = torch.arange(R, device=dev)[:, None]
        for layer in self.bufs:
            for buf in layer.values():
                buf[:R] = buf[rows, index]   # every source read before anything is written
