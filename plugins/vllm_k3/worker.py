"""Methods added to vLLM's worker (`worker_extension_cls="k3_vllm.worker.K3WorkerExtension"`), called through
`LLM.collective_rpc("k3_...")`: live policy weights from k3.sync payloads, the served adapter, routed experts.

Live weights: the worker holds a `k3.sync.WeightReceiver` over the published tensors (a staging copy in the
published dtype, built from the first full snapshot). A payload is decoded and verified completely by the receiver
before anything changes (corrupt frames, a wrong base version or chain, mismatched tensors are refused, the old
version keeps serving); then the new weights enter the model through vLLM's reload path
(`model_runner.reload_weights(weights_iterator=...)`, which runs the model's `load_weights` and vLLM's
post-load processing) or, in LoRA mode, the served adapter's `load_tensors`. Arguments and results are plain
bytes / lists / dicts (vLLM's RPC refuses pickled objects by default). The main process resets vLLM's prefix cache
after every applied version (`k3_vllm.rollout`)."""
from __future__ import annotations

from k3.lora import LoRAConfig, LoRAManager
from k3.rollout.backend import state_digest
from k3.sync import SyncError, WeightReceiver

from .model import RoutingRecorder

_SERVED_DTYPE_NAMES = ("float32", "bfloat16", "float16")


class K3WorkerExtension:
    """Mixed into vLLM's worker class; `self.model_runner` is vLLM's."""

    def _k3_model(self):
        return self.model_runner.get_model()

    # ------------------------------------------------------------------ routed experts (Router Replay)
    def k3_enable_routing(self) -> bool:
        self._k3_model().routing = RoutingRecorder(self.model_runner)
        return True

    def k3_take_routing(self, request_ids: list[str]) -> dict:
        return self._k3_model().routing.take(list(request_ids))

    # ------------------------------------------------------------------ weights
    def k3_sync_start(self, payload: bytes, lora: dict | None = None, adapter_id: str | None = None) -> dict:
        """Serve the full snapshot `payload`: every weight of the model, or (lora) the adapter `adapter_id` with
        LoRAConfig(**lora), which every request then uses. Returns {"version"} or {"error"}."""
        try:
            receiver = WeightReceiver.from_payload(bytes(payload))
        except SyncError as e:
            return {"error": f"{type(e).__name__}: {e}"}
        model = self._k3_model()
        if lora is not None:
            manager = getattr(model, "_lora_manager", None) or LoRAManager(model)
            if adapter_id in manager.adapters:
                manager.remove(adapter_id)
            self._k3_adapter = manager.create(adapter_id, LoRAConfig(**lora))
            manager.activate(adapter_id)
        else:
            self._k3_adapter = None
        try:
            self._k3_load(receiver)
        except (SyncError, ValueError) as e:
            return {"error": f"{type(e).__name__}: {e}"}
        self._k3_receiver = receiver
        return {"version": receiver.version}

    def k3_sync_apply(self, payload: bytes) -> dict:
        """Apply one payload; {"version"} when applied, {"error", "version"} (the version still served) when
        refused. Nothing of a refused payload reaches the model."""
        receiver = getattr(self, "_k3_receiver", None)
        if receiver is None:
            return {"error": "SyncError: no weights were published to this engine yet (k3_sync_start first)",
                    "version": -1}
        try:
            version = receiver.apply(bytes(payload))
        except SyncError as e:
            return {"error": f"{type(e).__name__}: {e}", "version": receiver.version}
        self._k3_load(receiver)
        return {"version": version}

    def k3_weights_digest(self, dtype_name: str) -> str:
        """Digest of the served policy tensors (the adapter's in LoRA mode) cast to the published dtype."""
        import torch

        if dtype_name not in _SERVED_DTYPE_NAMES:
            raise ValueError(f"dtype_name: expected one of {_SERVED_DTYPE_NAMES}, got {dtype_name!r}")
        dtype = getattr(torch, dtype_name)
        adapter = getattr(self, "_k3_adapter", None)
        state = adapter.tensors() if adapter is not None else self._k3_model().checkpoint_state()
        return state_digest({k: v.to(dtype if v.is_floating_point() else v.dtype) for k, v in state.items()})

    def _k3_load(self, receiver: WeightReceiver) -> None:
        state = receiver.state_dict()
        adapter = getattr(self, "_k3_adapter", None)
        if adapter is not None:
            adapter.load_tensors({k: v.float() for k, v in state.items()})
        else:
            self.model_runner.reload_weights(weights_iterator=iter(state.items()))
