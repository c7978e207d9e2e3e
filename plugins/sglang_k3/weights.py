"""XOR-delta weight updates into a live SGLang engine, through SGLang's own update path.

A trainer publishes `k3.sync` payloads (a full snapshot, then XOR deltas against the previous version, zstd,
checksummed: `k3.sync.WeightPublisher`). The engine side is SGLang's session protocol, unchanged:

    engine.begin_weight_update()
    engine.update_weights_from_tensor([(PAYLOAD_TENSOR, torch.frombuffer(payload, dtype=torch.uint8))],
                                      load_format="k3_xor_delta")      # or update_weights_from_disk(path, ...)
    engine.end_weight_update()

Each model runner's `WeightUpdater` (model_runner_components/weight_updater.py) gets an AROUND hook for that one
`load_format` (every other format goes to SGLang's code untouched). It keeps a `k3.sync.WeightReceiver` per model
(the served version, under checkpoint names), decodes and verifies the whole payload into staging (manifest, base
version, chain, names, dtypes, shapes, every frame checksum), and only then writes: receiver tensors in place,
then `model.load_weights(...)` (SGLang's loader maps checkpoint names onto its fused / sharded parameters).
A refused payload returns `(False, reason)` to SGLang's scheduler (which then neither records a weight version nor
flushes the cache): the served weights and version stay as they were and the next good payload applies.
The first payload of a model must be a full snapshot (it sets the version and names the tensors).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from k3.sync import SyncError, WeightReceiver
from k3.sync.codec import _Source, read_manifest

LOAD_FORMAT = "k3_xor_delta"
PAYLOAD_TENSOR = "k3.sync.payload"  # the one named tensor: the payload's bytes as uint8
RUNNER_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
_RECEIVER_ATTR = "_k3_weight_receiver"


@dataclass(frozen=True)
class AppliedUpdate:
    kind: str  # "full" | "delta"
    version: int
    tensors: int


def served_version(model: torch.nn.Module) -> int | None:
    """The k3.sync version `model` serves (None before its first payload)."""
    receiver = getattr(model, _RECEIVER_ATTR, None)
    return None if receiver is None else receiver.version


def _payload_bytes(named_tensors) -> bytes:
    if len(named_tensors) != 1 or named_tensors[0][0] != PAYLOAD_TENSOR:
        names = [n for n, _ in named_tensors]
        raise SyncError(f"named_tensors: load_format={LOAD_FORMAT!r} takes exactly one tensor named "
                        f"{PAYLOAD_TENSOR!r} (the payload's bytes), got {names}")
    tensor = named_tensors[0][1]
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

    if isinstance(tensor, LocalSerializedTensor):  # the engine API's per-rank IPC form, as SGLang unwraps it
        from sglang.srt.runtime_context import get_parallel

        tensor = tensor.get(get_parallel().tp_rank)
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.uint8 or tensor.dim() != 1:
        got = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise SyncError(f"named_tensors[{PAYLOAD_TENSOR!r}]: must be a 1-D uint8 tensor, got {got}")
    return tensor.cpu().numpy().tobytes()


def _load(model: torch.nn.Module, receiver: WeightReceiver) -> None:
    device = next(model.parameters()).device
    model.load_weights([(name, t.to(device)) for name, t in receiver.state_dict().items()])


def apply_payload(model: torch.nn.Module, payload: bytes) -> AppliedUpdate:
    """Verify, then apply one payload to `model`; raises `SyncError` (model and receiver unchanged) if refused."""
    receiver: WeightReceiver | None = getattr(model, _RECEIVER_ATTR, None)
    if receiver is None:
        man = read_manifest(_Source(payload))
        if man.kind != "full":
            raise SyncError(f"payload: the model serves no k3.sync version yet, so the first payload must be a full "
                            f"snapshot, got a {man.kind} (base {man.base_version} -> {man.new_version})")
        fresh = WeightReceiver.from_payload(payload)  # fully verified before anything reaches the model
        _load(model, fresh)
        setattr(model, _RECEIVER_ATTR, fresh)
        return AppliedUpdate("full", fresh.version, len(fresh.state_dict()))
    kind = read_manifest(_Source(payload)).kind
    receiver.apply(payload)  # verified into staging first; refused -> unchanged
    _load(model, receiver)
    return AppliedUpdate(kind, receiver.version, len(receiver.state_dict()))


def _refused(exc: Exception, model) -> tuple[bool, str]:
    return False, (f"k3 weight update refused ({type(exc).__name__}: {exc}); still serving version "
                   f"{served_version(model)}")


def _guards(updater, op: str) -> str | None:
    """SGLang's own refusals for any in-place update (shared CUDA-IPC weight cache, derived weight caches)."""
    from sglang.srt.model_executor.model_runner_components import weight_updater as upstream

    updater._assert_weight_cache_inactive(op)
    return upstream._unsupported_derived_weight_cache_error(updater.get_model())


def _update_from_tensor(original, self, named_tensors, load_format=None, **kwargs):
    if load_format != LOAD_FORMAT:
        return original(self, named_tensors, load_format, **kwargs)
    error = _guards(self, "update_weights_from_tensor")
    if error is not None:
        return False, error
    model = self.get_model()
    try:
        done = apply_payload(model, _payload_bytes(named_tensors))
    except SyncError as exc:
        return _refused(exc, model)
    return True, f"k3 {done.kind} payload applied: version {done.version} ({done.tensors} tensors)"


def _update_from_disk(original, self, model_path, load_format, *args, **kwargs):
    if load_format != LOAD_FORMAT:
        return original(self, model_path, load_format, *args, **kwargs)
    error = _guards(self, "update_weights_from_disk")
    if error is not None:
        return False, error
    model = self.get_model()
    try:
        if not os.path.isfile(model_path):
            raise SyncError(f"model_path: {model_path!r} is not a k3.sync payload file")
        with open(model_path, "rb") as f:
            done = apply_payload(model, f.read())
    except SyncError as exc:
        return _refused(exc, model)
    return True, f"k3 {done.kind} payload applied from {model_path}: version {done.version}"


_done = False


def register() -> None:
    global _done
    if _done:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{RUNNER_UPDATER}.update_weights_from_tensor", _update_from_tensor, HookType.AROUND)
    HookRegistry.register(f"{RUNNER_UPDATER}.update_weights_from_disk", _update_from_disk, HookType.AROUND)
    _done = True
