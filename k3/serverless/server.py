"""The HTTP layer of `k3 serve` (FastAPI + uvicorn): routes -> `k3.serverless.service.Service`.

Auth: `Authorization: Bearer <session api key>` on every session and sampler route (a key reaches only its own
session: 403 otherwise); creating a session needs the server's creation key when one is configured. Errors are
JSON `{"detail": "<field>: <why>"}` with a 4xx status for the request's own faults (malformed JSON included)."""
from __future__ import annotations

import json
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import save

from k3.serverless.config import ServeConfig
from k3.serverless.losses import LossConfig
from k3.serverless.service import Service, validate_name
from k3.serverless.types import LOSS_FNS, AdamParams, ServiceError

API = "/v1"


def _key(request: Request) -> str | None:
    h = request.headers.get("authorization", "")
    return h[7:].strip() if h.lower().startswith("bearer ") else None


async def _body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServiceError(400, f"body: not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise ServiceError(400, "body: expected a JSON object")
    return body


def _known(body: dict, fields: set[str]) -> None:
    for k in body:
        if k not in fields:
            raise ServiceError(400, f"{k}: unknown field (known: {sorted(fields)})")


def build_app(service: Service) -> FastAPI:
    app = FastAPI(title="k3 serverless", version="1")

    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, e: ServiceError):
        return JSONResponse({"detail": e.detail}, status_code=e.status)

    @app.get(f"{API}/info")
    async def info():
        c = service.config
        return {"base_model": c.base_model, "max_rank": c.max_rank, "max_data": c.max_data,
                "max_seq_len": c.max_seq_len, "max_num_samples": c.max_num_samples,
                "max_sample_tokens": c.max_sample_tokens, "vocab_size": service.vocab,
                "loss_fns": list(LOSS_FNS)}

    @app.get(f"{API}/stats")
    async def stats():
        return {**service.stats, "sessions": len(service.sessions), **service.scheduler.counters(),
                "engine": dict(service.engine.stats)}

    # calls that wait for the scheduler run in the thread pool (`_threaded`), never on the event loop
    @app.post(f"{API}/sessions")
    async def create(request: Request):
        body = await _body(request)
        _known(body, {"base_model", "rank", "alpha", "seed"})
        if "rank" not in body:
            raise ServiceError(400, "rank: required")
        sid, key = await _threaded(lambda: service.create_session(
            body.get("base_model", service.config.base_model), body["rank"], alpha=body.get("alpha"),
            seed=body.get("seed"), create_key=_key(request)))
        return {"session_id": sid, "api_key": key}

    @app.get(f"{API}/sessions/{{sid}}")
    async def get_session(sid: str, request: Request):
        return service.info(service.authorize(sid, _key(request)))

    @app.delete(f"{API}/sessions/{{sid}}")
    async def delete(sid: str, request: Request):
        s = service.authorize(sid, _key(request))
        await _threaded(lambda: service.delete_session(s))
        return {"deleted": sid}

    @app.post(f"{API}/sessions/{{sid}}/forward_backward")
    async def forward_backward(sid: str, request: Request):
        return await _train(sid, request, backward=True)

    @app.post(f"{API}/sessions/{{sid}}/forward")
    async def forward(sid: str, request: Request):
        return await _train(sid, request, backward=False)

    async def _train(sid: str, request: Request, backward: bool):
        s = service.authorize(sid, _key(request))
        body = await _body(request)
        _known(body, {"data", "loss_fn", "loss_fn_config"})
        loss_fn = body.get("loss_fn", "cross_entropy")
        data = service.parse_data(body.get("data"), loss_fn)
        try:
            cfg = LossConfig.from_json(body.get("loss_fn_config"))
        except ValueError as e:
            raise ServiceError(400, str(e)) from None
        return await _threaded(lambda: service.forward_backward(s, data, loss_fn, cfg, backward))

    @app.post(f"{API}/sessions/{{sid}}/optim_step")
    async def optim_step(sid: str, request: Request):
        s = service.authorize(sid, _key(request))
        body = await _body(request)
        _known(body, {"adam_params"})
        p = body.get("adam_params", {})
        if not isinstance(p, dict):
            raise ServiceError(400, "adam_params: expected an object")
        fields = set(AdamParams.__dataclass_fields__)
        for k in p:
            if k not in fields:
                raise ServiceError(400, f"adam_params.{k}: unknown field (known: {sorted(fields)})")
        adam = AdamParams(**p)
        try:
            adam.validate()
        except ValueError as e:
            raise ServiceError(400, str(e)) from None
        return await _threaded(lambda: service.optim_step(s, adam))

    for route, method in (("save_state", "save_state"), ("load_state", "load_state"), ("samplers", "save_sampler")):
        def make(method=method):
            async def endpoint(sid: str, request: Request):
                s = service.authorize(sid, _key(request))
                body = await _body(request)
                _known(body, {"name"})
                name = validate_name(body.get("name"))
                return await _threaded(lambda: getattr(service, method)(s, name))
            return endpoint
        app.post(f"{API}/sessions/{{sid}}/{route}")(make())

    @app.get(f"{API}/sessions/{{sid}}/weights")
    async def weights(sid: str, request: Request):
        s = service.authorize(sid, _key(request))
        tensors = await _threaded(lambda: service.adapter_bytes(s))
        meta = {"format": "k3-lora", "version": "1", "config": json.dumps(s.config.to_dict())}
        return Response(save(tensors, metadata=meta), media_type="application/octet-stream")

    @app.get(f"{API}/sessions/{{sid}}/merged_weights")
    async def merged_weights(sid: str, request: Request):
        s = service.authorize(sid, _key(request))
        tensors, meta = await _threaded(lambda: service.merged_weights(s))
        return Response(save(tensors, metadata=meta), media_type="application/octet-stream")

    @app.post(f"{API}/samplers/{{sampler_id}}/sample")
    async def sample(sampler_id: str, request: Request):
        owner = service.authorize_sampler(sampler_id, _key(request))
        body = await _body(request)
        _known(body, {"prompt", "num_samples", "sampling_params", "return_routed_experts"})
        return await _threaded(lambda: service.sample(sampler_id, owner, body.get("prompt"),
                                                      body.get("num_samples", 1), body.get("sampling_params", {}),
                                                      body.get("return_routed_experts", False)))

    @app.post(f"{API}/samplers/{{sampler_id}}/logprobs")
    async def logprobs(sampler_id: str, request: Request):
        owner = service.authorize_sampler(sampler_id, _key(request))
        body = await _body(request)
        _known(body, {"prompt"})
        return {"logprobs": await _threaded(lambda: service.compute_logprobs(sampler_id, owner, body.get("prompt")))}

    return app


async def _threaded(fn):
    """Run a blocking service call (it waits for the scheduler) off the event loop."""
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn)


class ServerThread:
    """uvicorn in a background thread (tests, benchmarks): `with ServerThread(config) as url: ...`."""

    def __init__(self, config: ServeConfig, service: Service | None = None) -> None:
        import uvicorn

        self.service = service or Service(config)
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.service), host=config.host, port=config.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://{config.host}:{config.port}"

    def __enter__(self) -> str:
        import time

        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if not self.thread.is_alive() or time.time() - t0 > 60:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.service.close()


def serve(config: ServeConfig) -> None:
    """Run the service in the foreground (`k3 serve`)."""
    import uvicorn

    service = Service(config)
    try:
        uvicorn.run(build_app(service), host=config.host, port=config.port, log_level="info")
    finally:
        service.close()
