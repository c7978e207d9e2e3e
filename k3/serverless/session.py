"""A training session: one LoRA adapter on the shared base, its AdamW state, its step count.

The optimizer state moves between the compute device and host memory: `offload()` when the scheduler has not
picked the session for a while, `stage()` starts the copy back on a background thread (non-blocking copies from
pinned memory on CUDA) and `ready()` waits for it before the state is used. On a CPU-only server host and device
are the same memory: the moves are bookkeeping only.

`optim_step` is all or nothing: parameters and moments are copied first and restored if anything fails (a
non-finite gradient norm is refused before the step)."""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from k3.lora import LoRAAdapter, LoRAConfig
from k3.serverless.types import AdamParams, ServiceError

_STAGER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-opt-stage")


class Session:
    def __init__(self, sid: str, key_hash: str, adapter: LoRAAdapter, seed: int, device: torch.device) -> None:
        self.id, self.key_hash, self.adapter, self.seed, self.device = sid, key_hash, adapter, seed, device
        self.params = list(adapter.parameters())
        self.names = [n for n, _ in adapter.named_parameters()]
        for p in self.params:
            p.requires_grad_(True)
        # CUDA: the multi-tensor AdamW (a few hundred adapter tensors: one launch per op for all of them, not per
        # tensor); CPU: the per-tensor loop, as measured before
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, foreach=device.type == "cuda")
        self.step = 0
        self.pending = 0          # forward_backward calls since the last optim_step
        self.resident = True      # optimizer state on the compute device
        self._staging: Future | None = None
        self._lock = threading.Lock()

    @property
    def config(self) -> LoRAConfig:
        return self.adapter.config

    # ------------------------------------------------------------------ gradients
    def grads(self) -> list[torch.Tensor | None]:
        return [None if p.grad is None else p.grad.clone() for p in self.params]

    def restore_grads(self, grads: list[torch.Tensor | None]) -> None:
        for p, g in zip(self.params, grads):
            p.grad = g

    def drop_grads(self) -> None:
        for p in self.params:
            p.grad = None
        self.pending = 0

    # ------------------------------------------------------------------ optimizer state residency
    def _move(self, device: torch.device, non_blocking: bool) -> None:
        pin = device.type == "cpu" and self.device.type == "cuda"
        for st in self.optimizer.state.values():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and k != "step":
                    v2 = v.to(device, non_blocking=non_blocking)
                    st[k] = v2.pin_memory() if pin else v2

    def offload(self) -> None:
        with self._lock:
            self._settle()
            self._move(torch.device("cpu"), False)
            self.resident = False

    def stage(self) -> None:
        """Start moving the optimizer state back to the device (asynchronously)."""
        with self._lock:
            if self.resident or self._staging is not None:
                return

            def run() -> None:
                self._move(self.device, True)
                if self.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()
            self._staging = _STAGER.submit(run)

    def ready(self) -> None:
        """Wait for staging started by `stage` (or stage synchronously); afterwards the state is resident. Under the
        lock: `stage` runs on request threads, and a staging run must never overlap another move of the state."""
        with self._lock:
            self._settle()

    def _settle(self) -> None:
        """(lock held) Finish an in-flight staging run, or move the state back synchronously."""
        fut, self._staging = self._staging, None
        if fut is not None:
            fut.result()
        elif not self.resident:
            self._move(self.device, False)
        self.resident = True

    # ------------------------------------------------------------------ optimizer step
    def optim_step(self, adam: AdamParams, before: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """One AdamW step, all or nothing in memory; `before` is a `state_tensors()` copy the caller already holds
        (the state to return to on failure), taken here if not given."""
        if self.pending == 0:
            raise ServiceError(409, "optim_step: no gradient accumulated (call forward_backward first)")
        self.ready()
        grads = [p.grad for p in self.params]
        sq = [(g.double() ** 2).sum() for g in grads if g is not None]
        norm = math.sqrt(float(torch.stack(sq).sum())) if sq else 0.0   # one device-to-host read
        if not math.isfinite(norm):
            self.drop_grads()
            raise ServiceError(422, f"optim_step: gradient norm is {norm}; step refused, gradient dropped")
        if before is None:
            before = self.state_tensors()
        try:
            if adam.grad_clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, adam.grad_clip_norm,
                                               foreach=self.device.type == "cuda")
            for g in self.optimizer.param_groups:
                g.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                         weight_decay=adam.weight_decay)
            self.optimizer.step()
        except BaseException:
            self.load_state_tensors(before)
            raise
        self.drop_grads()
        self.step += 1
        return {"grad_norm": norm, "step": float(self.step)}

    # ------------------------------------------------------------------ (de)serialisation
    def state_tensors(self, copy: bool = True) -> dict[str, torch.Tensor]:
        """Adapter weights and AdamW state as flat named tensors: copies, or with `copy=False` the live tensors
        (detached; for writing them out at once, before anything changes them)."""
        self.ready()
        own = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())
        out = {f"adapter/{n}": own(p) for n, p in zip(self.names, self.params)}
        for i, p in enumerate(self.params):
            st = self.optimizer.state.get(p)
            if st:
                out[f"adam/{self.names[i]}/step"] = own(torch.as_tensor(st["step"])).reshape(1)
                out[f"adam/{self.names[i]}/exp_avg"] = own(st["exp_avg"])
                out[f"adam/{self.names[i]}/exp_avg_sq"] = own(st["exp_avg_sq"])
        return out

    def load_state_tensors(self, t: dict[str, torch.Tensor]) -> None:
        """Inverse of `state_tensors`, all or nothing (every tensor is checked before anything is written)."""
        for n, p in zip(self.names, self.params):
            k = f"adapter/{n}"
            if k not in t or tuple(t[k].shape) != tuple(p.shape):
                raise ValueError(f"state: tensor {k!r} is missing or has the wrong shape")
        with self._lock:   # a staging run iterates the optimizer state: let it finish before the state is replaced
            fut, self._staging = self._staging, None
            if fut is not None:
                fut.exception()   # waits; whatever it moved is overwritten below
            with torch.no_grad():
                for n, p in zip(self.names, self.params):
                    p.copy_(t[f"adapter/{n}"])
            self.optimizer.state.clear()
            for n, p in zip(self.names, self.params):
                if f"adam/{n}/step" in t:
                    self.optimizer.state[p] = {
                        "step": t[f"adam/{n}/step"].reshape(()).clone().float(),
                        "exp_avg": t[f"adam/{n}/exp_avg"].clone().to(p.device),
                        "exp_avg_sq": t[f"adam/{n}/exp_avg_sq"].clone().to(p.device)}
            self.resident = True
