"""Apply LoRA adapters to a K3 model, train and serve: one base copy, several named adapters, a per-token choice.

`LoRAManager(model)` attaches hooks (nothing of the base is copied or changed): a forward hook on every targeted
`nn.Linear` adds the low-rank path, and targeted routed-expert modules get a `RoutedExperts.project` override that
adds it per expert.
Which adapter a token uses is set with `use(...)` / `activate(...)`:

    None                      the base model (every hook is a no-op: outputs are bitwise the base outputs)
    "name"                    one adapter for the whole batch (training, single-tenant serving)
    ["a", None, "b"]          one adapter (or none) per row of input_ids: a multi-LoRA batch
    LongTensor [B, T]         one adapter slot per token (`slot(name)`, -1 = none): packed/ragged engine batches

A multi-LoRA batch runs each adapter's low-rank path on its own rows only (a plain-torch gather/scatter version of
Punica's SGMV, arXiv 2310.18547), so row i gives what a batch using only row i's adapter gives.

`merge(name)` folds an adapter into the base weights (a copy of each merged-over weight is kept) and `unmerge()`
restores them bit for bit; `merged_state_dict(name)` gives the merged weights without touching the model.
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Iterator, Sequence, Union

import torch
from torch import nn

from k3.lora.adapter import LoRAAdapter, LoRAError
from k3.lora.config import LoRAConfig, Target, candidate_targets
from k3.model import ops
from k3.model.moe import RoutedExperts

Selection = Union[None, str, Sequence[Union[str, None]], torch.Tensor]


@dataclass
class _Plan:
    """The adapter choice for one forward over input_ids [B, T]: `single` for the whole batch, or per-token
    `slots` [B*T] (-1 = none) with `row_slots` [B] when every row uses one adapter."""

    single: LoRAAdapter | None = None
    slots: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None
    shape: tuple[int, int] = (0, 0)
    groups: tuple[tuple[int, LoRAAdapter], ...] = ()
    # fused path (ops.fused_multi_lora): per set of groups, the device tensors mapping a slot + 1 to its stack
    # index (-1: no delta) and the stacked adapters' scales; built once per forward (a captured plan: once)
    stacks: dict = field(default_factory=dict)
    # a captured forward's plan (`LoRAManager.captured_plan`): `slots` is rewritten between forwards, so nothing
    # derived from its values is memoised and the fused path takes the per-token kernel (no host read)
    captured: bool = False

    def slots_for(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The slot of each row of a projection input x: [B, T, in] or [B*T, in] are the forward's tokens;
        [B, S, in] with S != T (MLA's kv_b_proj over the cached latent) are per-row and need one adapter a row."""
        B, T = self.shape
        if (x.dim() == 3 and tuple(x.shape[:2]) == (B, T)) or (x.dim() == 2 and x.shape[0] == B * T):
            return self.slots
        if x.dim() == 3 and x.shape[0] == B:
            if self.row_slots is None:
                raise LoRAError(f"{name} reads {x.shape[1]} positions per row (cached tokens): a selection with "
                                f"several adapters inside one row cannot be applied to it; use one adapter per row")
            return self.row_slots[:, None].expand(B, x.shape[1]).reshape(-1)   # (no host sync: capturable)
        raise LoRAError(f"{name}: input of shape {tuple(x.shape)} does not match the forward's tokens {(B, T)}")


class LoRAManager:
    """Named adapters on one base model and the per-forward choice between them (see module doc)."""

    def __init__(self, model: nn.Module) -> None:
        if getattr(model, "_lora_manager", None) is not None:
            raise LoRAError("this model already has a LoRAManager; close() it first (one manager per model)")
        self.model = model
        model._lora_manager = self
        self._cands = candidate_targets(model)
        self._adapters: dict[str, LoRAAdapter] = {}
        self._slots: dict[str, int] = {}
        self._next_slot = 0
        self._selection: Selection = None
        self._plan: _Plan | None = None
        self._fixed_plan: _Plan | None = None   # use_plan's (a captured forward's)
        self._hooked: set[str] = set()
        self._handles: list = []
        self._experts: dict[str, RoutedExperts] = {}
        self._merged: str | None = None
        self._backup: dict[str, torch.Tensor] = {}
        # Every forward (also `extend`, which calls forward directly) embeds input_ids [B, T] first: the plan for
        # this forward is resolved there.
        embed = model.get_submodule("model.embed_tokens")
        self._handles.append(embed.register_forward_pre_hook(self._pre_forward, with_kwargs=True))

    # ------------------------------------------------------------------ adapters
    @property
    def adapters(self) -> dict[str, LoRAAdapter]:
        return dict(self._adapters)

    def create(self, name: str, config: LoRAConfig, *, dtype: torch.dtype = torch.float32,
               seed: int | None = None) -> LoRAAdapter:
        """Create a new adapter for this model (B = 0 unless config.init_scale) and add it under `name`."""
        return self.add(name, LoRAAdapter.for_model(self.model, config, dtype=dtype, seed=seed))

    def add(self, name: str, adapter: LoRAAdapter) -> LoRAAdapter:
        """Register `adapter` under `name`; its targets must exist in the model with the adapter's shapes."""
        if not isinstance(name, str) or not name:
            raise LoRAError(f"adapter name must be a non-empty string, got {name!r}")
        if name in self._adapters:
            raise LoRAError(f"an adapter named {name!r} is already added; remove it first")
        r = adapter.config.rank
        for tname, t in adapter.targets.items():
            mine = self._cands.get(tname)
            if mine is None:
                raise LoRAError(f"adapter {name!r} targets {tname!r}, which this model does not have")
            if mine.a_shape(r) != tuple(adapter.A(tname).shape) or mine.b_shape(r) != tuple(adapter.B(tname).shape):
                raise LoRAError(f"adapter {name!r}: {tname}.lora_A/B shapes {tuple(adapter.A(tname).shape)}/"
                                f"{tuple(adapter.B(tname).shape)} do not fit the model ({mine.a_shape(r)}/"
                                f"{mine.b_shape(r)})")
        self._adapters[name] = adapter
        self._slots[name] = self._next_slot
        self._next_slot += 1
        for t in adapter.targets.values():
            self._hook(t)
        return adapter

    def remove(self, name: str) -> LoRAAdapter:
        """Drop adapter `name` (hooks stay; they are no-ops for absent adapters)."""
        self._require(name)
        if self._merged == name:
            raise LoRAError(f"adapter {name!r} is merged into the base weights; unmerge() first")
        if self._mentions(self._selection, name, self._slots[name]):
            self._selection = None
        del self._slots[name]
        return self._adapters.pop(name)

    def slot(self, name: str) -> int:
        """The integer id of adapter `name` for per-token selections."""
        self._require(name)
        return self._slots[name]

    def close(self) -> None:
        """Remove every hook and projection override (unmerging first): the model is the plain base model again."""
        if self._merged is not None:
            self.unmerge()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for mod in self._experts.values():
            del mod.project
        self._experts.clear()
        self._hooked.clear()
        self.model._lora_manager = None

    # ------------------------------------------------------------------ selection
    def activate(self, selection: Selection) -> None:
        """Set the adapter choice for following forwards (see module doc for the forms)."""
        self._validate(selection)
        self._selection = selection

    @contextlib.contextmanager
    def use(self, selection: Selection) -> Iterator[None]:
        """Temporarily select adapters: `with manager.use(["a", None]): model(ids)`."""
        prev = self._selection
        self.activate(selection)
        try:
            yield
        finally:
            self._selection = prev

    @property
    def selection(self) -> Selection:
        return self._selection

    def _require(self, name: str) -> None:
        if name not in self._adapters:
            raise LoRAError(f"no adapter named {name!r} (have {sorted(self._adapters)})")

    @staticmethod
    def _mentions(selection: Selection, name: str, slot: int) -> bool:
        if isinstance(selection, str):
            return selection == name
        if isinstance(selection, torch.Tensor):
            return bool((selection == slot).any())
        return isinstance(selection, (list, tuple)) and name in selection

    def _validate(self, selection: Selection) -> None:
        if selection is None:
            return
        if self._merged is not None and selection != self._merged:
            raise LoRAError(f"adapter {self._merged!r} is merged into the base weights: only it can be selected "
                            f"until unmerge()")
        if isinstance(selection, str):
            self._require(selection)
        elif isinstance(selection, torch.Tensor):
            if selection.dim() != 2 or selection.dtype in (torch.bool,) or selection.is_floating_point():
                raise LoRAError(f"a per-token adapter selection must be an integer [B, T] tensor, got "
                                f"{selection.dtype} {tuple(selection.shape)}")
            known = torch.tensor(sorted(self._slots.values()) + [-1], device=selection.device)
            bad = ~torch.isin(selection, known)
            if bool(bad.any()):
                raise LoRAError(f"per-token adapter slots {sorted(set(selection[bad].tolist()))[:4]} are not "
                                f"added adapters (slots {sorted(self._slots.values())}, -1 = none)")
        elif isinstance(selection, (list, tuple)):
            for s in selection:
                if s is not None:
                    if not isinstance(s, str):
                        raise LoRAError(f"per-row adapter selection entries must be names or None, got {s!r}")
                    self._require(s)
        else:
            raise LoRAError(f"adapter selection must be None, a name, a per-row list or a [B, T] slot tensor, "
                            f"got {type(selection).__name__}")

    # ------------------------------------------------------------------ captured forwards (k3.rollout.graphs)
    def capturable(self) -> bool:
        """Whether forwards through the adapters can be captured as CUDA graphs: none targets routed experts (their
        per-expert path reads the routing on the host)."""
        return all(t.kind == "linear" for ad in self._adapters.values() for t in ad.targets.values())

    def signature(self) -> tuple[int, ...] | None:
        """What a captured forward's adapter path depends on besides the adapters' values (read in place at every
        replay): the added adapters' slots (a slot is never reused, so adding or removing one changes it); None
        when an adapter is merged (the served weights are the whole model: no adapter path)."""
        return None if self._merged is not None else tuple(sorted(self._slots.values()))

    def captured_plan(self, slots: torch.Tensor, rows: int, tokens: int) -> _Plan:
        """A plan for forwards over input_ids [rows, tokens] whose per-token adapter slots (-1 = none; one adapter
        a row) are read from `slots` [rows * tokens], a device tensor the caller rewrites between forwards (a CUDA
        graph's static input). Every added adapter is in it and nothing reads the slots on the host; run forwards
        under `use_plan`. Valid while `signature()` is unchanged."""
        if not self.capturable():
            raise LoRAError("captured_plan: an adapter targets routed experts, whose path reads the routing on the "
                            "host; such forwards run eagerly")
        if self._merged is not None:
            raise LoRAError(f"captured_plan: adapter {self._merged!r} is merged; the base model serves")
        if slots.shape != (rows * tokens,) or slots.dtype != torch.long:
            raise LoRAError(f"captured_plan: slots must be an int64 [{rows * tokens}] tensor, got {slots.dtype} "
                            f"{tuple(slots.shape)}")
        by_slot = {v: k for k, v in self._slots.items()}
        return _Plan(slots=slots, row_slots=slots.view(rows, tokens)[:, 0], shape=(rows, tokens), captured=True,
                     groups=tuple((s, self._adapters[by_slot[s]]) for s in sorted(by_slot)))

    @contextlib.contextmanager
    def use_plan(self, plan: _Plan) -> Iterator[None]:
        """Forwards inside take `plan` (from `captured_plan`) instead of resolving a selection."""
        prev = self._fixed_plan
        self._fixed_plan = plan
        try:
            yield
        finally:
            self._fixed_plan = prev

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Resolve the selection against this forward's input_ids [B, T] (the embedding's input) into a plan."""
        if self._fixed_plan is not None:
            ids = args[0] if args else kwargs.get("input_ids")
            if tuple(ids.shape) != self._fixed_plan.shape:
                raise LoRAError(f"input_ids {tuple(ids.shape)} do not match the captured plan's "
                                f"{self._fixed_plan.shape}")
            self._plan = self._fixed_plan
            return
        sel = self._selection
        if sel is None or (self._merged is not None and sel == self._merged):
            self._plan = None
            return
        if isinstance(sel, str):
            self._plan = _Plan(single=self._adapters[sel])
            return
        ids = args[0] if args else kwargs.get("input_ids")
        B, T = ids.shape
        if isinstance(sel, torch.Tensor):
            if tuple(sel.shape) != (B, T):
                raise LoRAError(f"per-token adapter selection has shape {tuple(sel.shape)} but input_ids is {(B, T)}")
            slots = sel.to(device=ids.device, dtype=torch.long).reshape(-1)
        else:
            if len(sel) != B:
                raise LoRAError(f"per-row adapter selection has {len(sel)} entries but input_ids has {B} rows")
            rows = torch.tensor([-1 if s is None else self._slots[s] for s in sel], device=ids.device)
            slots = rows[:, None].expand(B, T).reshape(-1)
        by_slot = {v: k for k, v in self._slots.items()}
        present = sorted(int(s) for s in torch.unique(slots).tolist() if s >= 0)
        grid = slots.view(B, T)
        row_slots = grid[:, 0] if bool((grid == grid[:, :1]).all()) else None
        self._plan = _Plan(slots=slots, row_slots=row_slots, shape=(B, T),
                           groups=tuple((s, self._adapters[by_slot[s]]) for s in present))

    # ------------------------------------------------------------------ application
    def _hook(self, t: Target) -> None:
        if t.name in self._hooked:
            return
        self._hooked.add(t.name)
        mod = self.model.get_submodule(t.module_name)
        if t.kind == "linear":
            self._handles.append(mod.register_forward_hook(self._linear_hook(t.name)))
        elif t.module_name not in self._experts:
            self._experts[t.module_name] = mod
            mod.project = types.MethodType(self._experts_project(t.module_name), mod)

    def _linear_hook(self, name: str):
        def hook(mod: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            plan = self._plan
            if plan is None:
                return None
            x = args[0]
            slots = None if plan.single is not None else plan.slots_for(name, x)
            y = self._add_lowrank(plan, name, x.reshape(-1, mod.in_features), out.reshape(-1, mod.out_features),
                                  slots, None)
            return y.view(out.shape)
        return hook

    @staticmethod
    def _add_lowrank(plan: _Plan, name: str, x: torch.Tensor, base: torch.Tensor, slots: torch.Tensor | None,
                     expert: int | None) -> torch.Tensor:
        """base + the selected adapters' (alpha/r) B A x for the rows of x [n, in]; `slots` [n] gives each row's
        adapter slot (unused with a single adapter)."""
        if plan.single is not None:
            if name not in plan.single.targets:
                return base
            return base + _lowrank(plan.single, name, x, expert).to(base.dtype)
        if ops.fused_multi_lora(x):
            return _fused_lowrank(plan, name, x, base, slots, expert)
        delta = None
        for slot, ad in plan.groups:
            if name not in ad.targets:
                continue
            pos = (slots == slot).nonzero(as_tuple=True)[0]
            if pos.numel() == 0:
                continue
            d = _lowrank(ad, name, x[pos], expert).to(base.dtype)
            delta = (base.new_zeros(base.shape) if delta is None else delta).index_put((pos,), d)
        return base if delta is None else base + delta

    def _experts_project(self, module_name: str):
        """`RoutedExperts.project` for a targeted module: the base projection plus the selected adapters'
        per-expert low-rank path (tokens routed to expert e use A[e], B[e])."""
        names = {p: f"{module_name}.{p}" for p in ("w1", "w3", "w2")}
        manager = self

        def project(mod: RoutedExperts, which: str, expert: int, tok: torch.Tensor, x: torch.Tensor,
                    weight: torch.Tensor) -> torch.Tensor:
            base = ops.linear(x, weight)
            plan = manager._plan
            if plan is None:
                return base
            if plan.single is None and int(tok.max()) >= plan.slots.shape[0]:
                raise LoRAError(f"{module_name}: routed token {int(tok.max())} is outside the adapter selection "
                                f"({plan.slots.shape[0]} tokens)")
            slots = None if plan.single is not None else plan.slots[tok]
            return manager._add_lowrank(plan, names[which], x, base, slots, expert)

        return project

    # ------------------------------------------------------------------ merging
    def _weight(self, t: Target) -> nn.Parameter:
        return getattr(self.model.get_submodule(t.module_name), t.param)

    @torch.no_grad()
    def merge(self, name: str) -> None:
        """Fold adapter `name` into the base weights (W += (alpha/r) B A, in the base dtype) and select it.
        A copy of each merged-over weight is kept so that `unmerge` restores it exactly."""
        self._require(name)
        if self._merged is not None:
            raise LoRAError(f"adapter {self._merged!r} is already merged; unmerge() first")
        ad = self._adapters[name]
        deltas = {n: ad.delta(n) for n in ad.targets}  # compute all first: nothing half applied on error
        for n, t in ad.targets.items():
            w = self._weight(t)
            self._backup[n] = w.detach().clone()
            w.add_(deltas[n].to(w.dtype))
        self._merged = name
        self._selection = name

    @torch.no_grad()
    def unmerge(self) -> None:
        """Restore the weights saved by `merge` (bitwise the base weights); the selection goes back to None."""
        if self._merged is None:
            raise LoRAError("no adapter is merged")
        ad = self._adapters[self._merged]
        for n, t in ad.targets.items():
            self._weight(t).copy_(self._backup.pop(n))
        self._merged = None
        self._selection = None

    @property
    def merged(self) -> str | None:
        return self._merged

    @torch.no_grad()
    def merged_state_dict(self, name: str | None) -> dict[str, torch.Tensor]:
        """The model's state dict with adapter `name` folded in (None: the base), without changing the model.
        Target weights equal what `merge(name)` writes, bit for bit; other tensors are the model's own (detached)."""
        if name is not None:
            self._require(name)
        if self._merged is not None:
            if name == self._merged:
                return {k: v.detach() for k, v in self.model.state_dict().items()}
            raise LoRAError(f"adapter {self._merged!r} is merged; unmerge() before exporting other weights")
        out = {k: v.detach() for k, v in self.model.state_dict().items()}
        if name is not None:
            ad = self._adapters[name]
            for n, t in ad.targets.items():
                w = out[t.weight_name]
                out[t.weight_name] = w + ad.delta(n).to(w.dtype)
        return out


def _lowrank(ad: LoRAAdapter, name: str, x: torch.Tensor, expert: int | None) -> torch.Tensor:
    """(alpha/r) (x A^T) B^T for rows x [n, in] (expert `e`'s pair for stacked targets), in the adapter dtype;
    through the model's (batch-invariant) linear, so a row's result does not depend on which rows share it."""
    a, b = ad.A(name), ad.B(name)
    if expert is not None:
        a, b = a[expert], b[expert]
    return ops.linear(ops.linear(x.to(a.dtype), a), b) * ad.scaling


def _fused_lowrank(plan: _Plan, name: str, x: torch.Tensor, base: torch.Tensor, slots: torch.Tensor,
                   expert: int | None) -> torch.Tensor:
    """`_add_lowrank` for a multi-adapter plan through `ops.multi_lora`: the adapters targeting `name` stacked
    (ranks below the largest padded with zeros), one shrink/expand pair for every row whatever its adapter."""
    groups = tuple((slot, ad) for slot, ad in plan.groups if name in ad.targets)
    if not groups:
        return base
    key = tuple(slot for slot, _ in groups)
    if key not in plan.stacks:
        lut = torch.full((max(slot for slot, _ in plan.groups) + 2,), -1, dtype=torch.long)
        lut[torch.tensor(key) + 1] = torch.arange(len(key))
        scale = torch.tensor([ad.scaling for _, ad in groups], dtype=torch.float32)
        plan.stacks[key] = (lut.to(x.device), scale.to(x.device))
    lut, scale = plan.stacks[key]
    rank = max(ad.config.rank for _, ad in groups)
    dtype = groups[0][1].A(name).dtype
    a_list, b_list = [], []
    for _, ad in groups:
        a, b = ad.A(name), ad.B(name)
        if expert is not None:
            a, b = a[expert], b[expert]
        pad = rank - a.shape[0]
        a_list.append((torch.nn.functional.pad(a, (0, 0, 0, pad)) if pad else a).to(dtype))
        b_list.append((torch.nn.functional.pad(b, (0, pad)) if pad else b).to(dtype))
    if plan.captured:   # slots rewritten between replays: mapped in every forward, the per-token kernel
        return ops.multi_lora_per_token(x.contiguous(), base.contiguous(), torch.stack(a_list), torch.stack(b_list),
                                        lut[slots + 1], scale)
    if slots is plan.slots:   # every projection over the forward's tokens: one mapped tensor (its segments memoised)
        if ("slots", key) not in plan.stacks:
            plan.stacks[("slots", key)] = lut[slots + 1]
        stack_slots = plan.stacks[("slots", key)]
    else:
        stack_slots = lut[slots + 1]
    return ops.multi_lora(x.contiguous(), base.contiguous(), torch.stack(a_list), torch.stack(b_list),
                          stack_slots, scale)
