"""The Python client of `k3 serve`, shaped like Tinker's: ServiceClient -> TrainingClient / SamplingClient.
Every call has an `_async` twin returning a `concurrent.futures.Future` (call `.result()`). No torch needed."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from k3.serverless.types import (AdamParams, Datum, ForwardBackwardOutput, ModelInput, OptimStepOutput,
                                 SampledSequence, SampleResponse, SamplingParams, ServiceError)


class _Http:
    def __init__(self, base_url: str, timeout: float) -> None:
        self.client = httpx.Client(base_url=base_url.rstrip("/") + "/v1", timeout=timeout)
        self.pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="k3-client")

    def call(self, method: str, path: str, key: str | None, body: dict | None = None, raw: bool = False) -> Any:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = self.client.request(method, path, json=body, headers=headers)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ServiceError(r.status_code, detail if isinstance(detail, str) else str(detail))
        return r.content if raw else r.json()

    def submit(self, fn, *args, **kwargs) -> Future:
        return self.pool.submit(fn, *args, **kwargs)


class ServiceClient:
    """Entry point: `ServiceClient(base_url, api_key=None)`; `api_key` is the server's creation key if it has one."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 600.0) -> None:
        self._http = _Http(base_url, timeout)
        self.api_key = api_key

    def get_server_capabilities(self) -> dict:
        return self._http.call("GET", "/info", None)

    def create_lora_training_client(self, base_model: str, rank: int = 32, *, alpha: float | None = None,
                                    seed: int | None = None) -> "TrainingClient":
        body = {"base_model": base_model, "rank": rank}
        if alpha is not None:
            body["alpha"] = alpha
        if seed is not None:
            body["seed"] = seed
        r = self._http.call("POST", "/sessions", self.api_key, body)
        return TrainingClient(self._http, r["session_id"], r["api_key"])

    def create_lora_training_client_async(self, *args, **kwargs) -> Future:
        return self._http.submit(self.create_lora_training_client, *args, **kwargs)

    def training_client(self, session_id: str, api_key: str) -> "TrainingClient":
        """Re-attach to an existing session (e.g. after a client or server restart)."""
        self._http.call("GET", f"/sessions/{session_id}", api_key)
        return TrainingClient(self._http, session_id, api_key)

    def sampling_client(self, sampler_id: str, api_key: str) -> "SamplingClient":
        return SamplingClient(self._http, sampler_id, api_key)

    def close(self) -> None:
        self._http.client.close()


class TrainingClient:
    def __init__(self, http: _Http, session_id: str, api_key: str) -> None:
        self._http, self.session_id, self.api_key = http, session_id, api_key

    def _post(self, route: str, body: dict) -> Any:
        return self._http.call("POST", f"/sessions/{self.session_id}/{route}", self.api_key, body)

    def forward_backward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None
                         ) -> ForwardBackwardOutput:
        body = {"data": [d.to_json() for d in data], "loss_fn": loss_fn}
        if loss_fn_config:
            body["loss_fn_config"] = loss_fn_config
        r = self._post("forward_backward", body)
        return ForwardBackwardOutput(r["loss_fn_outputs"], r["metrics"])

    def forward(self, data: list[Datum], loss_fn: str, loss_fn_config: dict | None = None) -> ForwardBackwardOutput:
        body = {"data": [d.to_json() for d in data], "loss_fn": loss_fn}
        if loss_fn_config:
            body["loss_fn_config"] = loss_fn_config
        r = self._post("forward", body)
        return ForwardBackwardOutput(r["loss_fn_outputs"], r["metrics"])

    def forward_backward_custom(self, data: list[Datum], loss_fn) -> ForwardBackwardOutput:
        """Train on any differentiable function of the log-probs (Tinker's forward_backward_custom):
        `loss_fn(data, logprobs) -> (loss, metrics)` gets one torch tensor of target-token log-probs per datum
        and returns a scalar tensor and a dict of floats. A `forward` gives the log-probs, the loss's gradient
        with respect to them is taken here (torch on the client), and `forward_backward(..., "logprob_linear")`
        sends it back: the server's backward of sum_t g_t log p_t is the loss's parameter gradient (taken at the
        forward's log-probs). Needs target_tokens in every datum; returns the forward's log-probs and the
        loss's value and metrics."""
        import torch

        fwd = self.forward(data, "cross_entropy")
        lps = [torch.tensor(o["logprobs"], dtype=torch.float32, requires_grad=True) for o in fwd.loss_fn_outputs]
        loss, metrics = loss_fn(data, lps)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("forward_backward_custom: loss_fn must return (a scalar tensor, a dict of floats)")
        grads = torch.autograd.grad(loss, lps, allow_unused=True)
        linear = []
        for d, lp, g in zip(data, lps, grads):
            g = torch.zeros_like(lp) if g is None else g
            inputs = {k: v for k, v in d.loss_fn_inputs.items() if k in ("target_tokens", "routed_experts")}
            linear.append(Datum(d.model_input, {**inputs, "logprob_grads": g.tolist()}))
        fb = self.forward_backward(linear, "logprob_linear")
        return ForwardBackwardOutput(fwd.loss_fn_outputs, {**{k: float(v) for k, v in dict(metrics).items()},
                                                           "loss": float(loss.detach())})

    def optim_step(self, adam_params: AdamParams) -> OptimStepOutput:
        r = self._post("optim_step", {"adam_params": adam_params.to_json()})
        return OptimStepOutput(r["step"], r["metrics"])

    def save_state(self, name: str) -> str:
        return self._post("save_state", {"name": name})["path"]

    def load_state(self, name: str) -> int:
        return self._post("load_state", {"name": name})["step"]

    def save_weights_for_sampler(self, name: str) -> str:
        return self._post("samplers", {"name": name})["sampler_id"]

    def save_weights_and_get_sampling_client(self, name: str) -> "SamplingClient":
        return SamplingClient(self._http, self.save_weights_for_sampler(name), self.api_key)

    def get_info(self) -> dict:
        return self._http.call("GET", f"/sessions/{self.session_id}", self.api_key)

    def download_weights(self) -> bytes:
        """The adapter alone as a safetensors file (k3.lora.LoRAAdapter format)."""
        return self._http.call("GET", f"/sessions/{self.session_id}/weights", self.api_key, raw=True)

    def download_merged_weights(self) -> bytes:
        """The base model with this adapter merged in, as one safetensors file (a K3ForCausalLM state dict; the
        model config as JSON in the metadata's "config")."""
        return self._http.call("GET", f"/sessions/{self.session_id}/merged_weights", self.api_key, raw=True)

    def delete(self) -> None:
        self._http.call("DELETE", f"/sessions/{self.session_id}", self.api_key)

    def __getattr__(self, name: str):
        if name.endswith("_async"):
            fn = getattr(self, name[: -len("_async")])
            return lambda *a, **k: self._http.submit(fn, *a, **k)
        raise AttributeError(name)


class SamplingClient:
    """An immutable snapshot (adapter id + version) of a session's weights."""

    def __init__(self, http: _Http, sampler_id: str, api_key: str) -> None:
        self._http, self.sampler_id, self.api_key = http, sampler_id, api_key

    def sample(self, prompt: ModelInput, num_samples: int = 1, sampling_params: SamplingParams | None = None,
               return_routed_experts: bool = False) -> SampleResponse:
        """`return_routed_experts`: each sequence also carries its routing (for Router Replay in training)."""
        body = {"prompt": prompt.to_ints(), "num_samples": num_samples,
                "sampling_params": (sampling_params or SamplingParams()).to_json()}
        if return_routed_experts:
            body["return_routed_experts"] = True
        r = self._http.call("POST", f"/samplers/{self.sampler_id}/sample", self.api_key, body)
        return SampleResponse([SampledSequence(s["tokens"], s["logprobs"], s["stop_reason"], s.get("routed_experts"))
                               for s in r["sequences"]])

    def compute_logprobs(self, prompt: ModelInput) -> list[float | None]:
        r = self._http.call("POST", f"/samplers/{self.sampler_id}/logprobs", self.api_key,
                            {"prompt": prompt.to_ints()})
        return r["logprobs"]

    def __getattr__(self, name: str):
        if name.endswith("_async"):
            fn = getattr(self, name[: -len("_async")])
            return lambda *a, **k: self._http.submit(fn, *a, **k)
        raise AttributeError(name)
