"""The service behind `k3 serve`, framework-free: one base model, one LoRAManager holding every session's adapter
and every sampler snapshot, one rollout engine, one scheduler thread that runs all model work.

Every public method checks its inputs in the caller's thread (ServiceError 4xx naming the field, before any work)
and then queues the work; the scheduler batches it with other sessions' (`k3.serverless.scheduler`) and runs it
(`k3.serverless.compute`). Sampler snapshots are immutable adapters (session, name, step) registered in the same
manager; the engine serves them by id, so its prefix cache is scoped by (adapter, version) by construction, and a
snapshot id that is loaded again is flushed from the cache with `engine.adapter_updated`.

Snapshots are hot-loaded: at most `max_loaded_samplers` are held by the manager (least recently used ones are
unloaded, and their cache entries released); a request for an unloaded one starts reading its file on a loader
thread when it is submitted, so the scheduler thread only registers the ready adapter."""
from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from k3.config import K3Config
from k3.lora import LoRAAdapter, LoRAConfig, LoRAManager
from k3.model import K3ForCausalLM
from k3.rollout import Engine
from k3.rollout import SamplingParams as EngineSampling
from k3.serverless.compute import Work, prompt_logprobs, run_packed
from k3.serverless.config import ServeConfig
from k3.serverless.losses import LossConfig
from k3.serverless.scheduler import Request, Scheduler
from k3.serverless.session import Session
from k3.serverless.store import SessionRow, Store, hash_key, key_matches, read_tensors, write_tensors
from k3.serverless.types import (LOSS_FNS, LOSS_INPUTS, AdamParams, Datum, ServiceError, datum_from_json)


class Service:
    def __init__(self, config: ServeConfig) -> None:
        config.validate()
        self.config = config
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
        self.device = torch.device(config.resolved_device())
        if config.base_dir:
            model = K3ForCausalLM.from_pretrained(config.base_dir)
        else:
            torch.manual_seed(config.model_seed)
            model = K3ForCausalLM(K3Config.preset(config.preset))
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.vocab = self.model.config.vocab_size
        self.manager = LoRAManager(self.model)
        self.engine = Engine(self.model, prefix_cache=True, config=config.engine_config())
        self.store = Store(config.data_dir)
        self.sessions: dict[str, Session] = {}
        self.samplers: dict[str, str] = {}       # sampler id -> owning session (loaded or not)
        self._sampler_files: dict[str, str] = {}
        self._loaded: OrderedDict[str, None] = OrderedDict()   # samplers held by the manager, LRU order
        self._loading: dict[str, Future] = {}
        self._retired: set[str] = set()          # sampler ids removed by the retention rule since this start
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3-adapter-load")
        self._lock = threading.Lock()
        self.stats = {"trained_rows": 0, "trained_tokens": 0, "sampled_tokens": 0, "replayed_rows": 0,
                      "sample_load_s": 0.0, "sample_generate_s": 0.0}   # a sample round: adapters in, engine
        self._restore()
        self.scheduler = Scheduler(self._execute, max_batch_rows=config.max_batch_rows,
                                   offload_after=config.offload_after, max_skips=config.max_skips,
                                   batch_wait_s=config.batch_wait_ms / 1000,
                                   is_resident=lambda s: s not in self.sessions or self.sessions[s].resident,
                                   stage=lambda s: s in self.sessions and self.sessions[s].stage(),
                                   offload=lambda s: s in self.sessions and self.sessions[s].offload())

    def close(self) -> None:
        self.scheduler.close()
        self._loader.shutdown(wait=True)
        self.store.close()
        self.manager.close()

    # ------------------------------------------------------------------ restart
    def _new_adapter(self, lora: LoRAConfig, seed: int) -> LoRAAdapter:
        return LoRAAdapter.for_model(self.model, lora, seed=seed)

    def _restore(self) -> None:
        for row in self.store.sessions():
            s = Session(row.id, row.key_hash, self._new_adapter(LoRAConfig.from_dict(row.lora), row.seed), row.seed,
                        self.device)
            s.load_state_tensors(read_tensors(self.store.root / row.state_file))
            s.step = row.step
            self.manager.add(row.id, s.adapter)
            self.sessions[row.id] = s
        for sampler_id, sid, _name, _step, file in self.store.samplers():
            if sid in self.sessions:   # loaded on first use (hot-load)
                self.samplers[sampler_id] = sid
                self._sampler_files[sampler_id] = file
        for sid in self.sessions:      # the rule as configured now (it may be stricter than at the last start)
            self._retain(sid)
        referenced = {Path(f).name for f in self._sampler_files.values()}
        for f in (self.store.root / "samplers").glob("*.safetensors*"):
            if f.name not in referenced:   # left by a crash between a row's removal and its file's
                f.unlink(missing_ok=True)

    # ------------------------------------------------------------------ auth and checks
    def authorize(self, sid: str, key: str | None) -> Session:
        s = self.sessions.get(sid)
        if s is None:
            raise ServiceError(404, f"session_id: no session {sid!r}")
        if not key or not key_matches(key, s.key_hash):
            raise ServiceError(403, f"api_key: this key does not own session {sid!r}")
        return s

    def authorize_sampler(self, sampler_id: str, key: str | None) -> Session:
        sid = self.samplers.get(sampler_id)
        if sid is None and sampler_id in self._retired:
            raise ServiceError(410, f"sampler_id: {sampler_id!r} was removed by the retention rule (the newest "
                                    f"{self.config.keep_samplers} snapshots of a session are kept)")
        if sid is None:
            raise ServiceError(404, f"sampler_id: no sampler {sampler_id!r}")
        return self.authorize(sid, key)

    def _check_tokens(self, toks, where: str) -> list[int]:
        if not isinstance(toks, list) or not toks or not all(isinstance(t, int) and not isinstance(t, bool)
                                                              for t in toks):
            raise ServiceError(400, f"{where}: expected a non-empty list of token ids")
        if len(toks) > self.config.max_seq_len:
            raise ServiceError(413, f"{where}: {len(toks)} tokens exceed the limit of {self.config.max_seq_len}")
        bad = [t for t in toks if not 0 <= t < self.vocab]
        if bad:
            raise ServiceError(400, f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.vocab})")
        return toks

    def parse_data(self, data, loss_fn: str) -> list[Datum]:
        if loss_fn not in LOSS_FNS:
            raise ServiceError(400, f"loss_fn: unknown {loss_fn!r} (choose from {list(LOSS_FNS)})")
        if not isinstance(data, list) or not data:
            raise ServiceError(400, "data: expected a non-empty list of Datum")
        if len(data) > self.config.max_data:
            raise ServiceError(413, f"data: {len(data)} data exceed the limit of {self.config.max_data} per call")
        out = []
        for i, d in enumerate(data):
            try:
                dat = datum_from_json(d, f"data[{i}]")
            except ValueError as e:
                raise ServiceError(400, str(e)) from None
            self._check_tokens(list(dat.model_input.tokens), f"data[{i}].model_input")
            for name in LOSS_INPUTS[loss_fn]:
                if name not in dat.loss_fn_inputs:
                    raise ServiceError(400, f"data[{i}].loss_fn_inputs.{name}: required by loss_fn {loss_fn!r}")
            tt = dat.loss_fn_inputs["target_tokens"]
            bad = [t for t in tt if not 0 <= t < self.vocab]
            if bad:
                raise ServiceError(400, f"data[{i}].loss_fn_inputs.target_tokens: token id {bad[0]} is outside "
                                        f"the vocabulary [0, {self.vocab})")
            w = dat.loss_fn_inputs.get("weights")
            if w is not None and any(x < 0 for x in w):
                raise ServiceError(400, f"data[{i}].loss_fn_inputs.weights: must be >= 0")
            if "routed_experts" in dat.loss_fn_inputs:
                self._check_routing(dat.loss_fn_inputs["routed_experts"], f"data[{i}].loss_fn_inputs.routed_experts")
            out.append(dat)
        return out

    def _check_routing(self, routed: list, where: str) -> None:
        """Recorded expert ids [T][n_moe][k] against the model (k3.rl.router_replay.check_routed_experts)."""
        from k3.rl.router_replay import check_routed_experts

        cfg = self.model.config
        n_moe, k = len(cfg.moe_layer_ids), cfg.num_experts_per_token
        if not n_moe:
            raise ServiceError(400, f"{where}: the served model has no MoE layers to replay")
        if any(len(x) != n_moe or any(len(layer) != k for layer in x) for x in routed):
            raise ServiceError(400, f"{where}: expected per position {n_moe} MoE layers x {k} expert ids")
        try:
            check_routed_experts(torch.tensor(routed, dtype=torch.long)[None], 1, len(routed), cfg, name=where)
        except ValueError as e:
            raise ServiceError(400, str(e)) from None

    @staticmethod
    def _wait(fut: Future):
        return fut.result()

    # ------------------------------------------------------------------ sessions
    def create_session(self, base_model, rank, *, alpha=None, seed=None, create_key: str | None = None
                       ) -> tuple[str, str]:
        c = self.config
        if c.create_key_sha256 and not (create_key and key_matches(create_key, c.create_key_sha256)):
            raise ServiceError(403, "api_key: creating sessions needs the server's creation key")
        if base_model != c.base_model:
            raise ServiceError(400, f"base_model: this server serves {c.base_model!r}, got {base_model!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= c.max_rank:
            raise ServiceError(400, f"rank: must be an integer in [1, {c.max_rank}], got {rank!r}")
        alpha = 32.0 if alpha is None else alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1e6:
            raise ServiceError(400, f"alpha: must be a positive number, got {alpha!r}")
        if seed is None:
            seed = secrets.randbits(31)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
            raise ServiceError(400, f"seed: must be an integer in [0, 2**63), got {seed!r}")
        with self._lock:
            if len(self.sessions) >= c.max_sessions:
                raise ServiceError(429, f"sessions: the server holds its limit of {c.max_sessions} sessions")
            sid = "s-" + secrets.token_hex(8)
            key = "k3-" + secrets.token_urlsafe(32)
            lora = LoRAConfig(rank=rank, alpha=float(alpha), targets=c.lora_targets)
            s = Session(sid, hash_key(key), self._new_adapter(lora, seed), seed, self.device)
            rel = self.store.state_path(sid, 0).relative_to(self.store.root)
            write_tensors(self.store.root / rel, s.state_tensors(copy=False))
            self.store.add_session(SessionRow(sid, s.key_hash, lora.to_dict(), seed, 0, str(rel)), time.time())
            self.sessions[sid] = s
        self._wait(self.scheduler.submit("register", sid, s))
        return sid, key

    def info(self, s: Session) -> dict:
        return {"session_id": s.id, "base_model": self.config.base_model, "rank": s.config.rank,
                "alpha": s.config.alpha, "step": s.step, "pending": s.pending,
                "samplers": sorted(k for k, v in self.samplers.items() if v == s.id)}

    def delete_session(self, s: Session) -> None:
        self._wait(self.scheduler.submit("delete", s.id, s))

    # ------------------------------------------------------------------ training
    def forward_backward(self, s: Session, data: list[Datum], loss_fn: str, loss_config: LossConfig,
                         backward: bool = True) -> dict:
        work = Work(s.id, data, loss_fn, loss_config)
        return self._wait(self.scheduler.submit("forward_backward" if backward else "forward", s.id, work,
                                                rows=len(data)))

    def optim_step(self, s: Session, adam: AdamParams) -> dict:
        return self._wait(self.scheduler.submit("optim_step", s.id, adam))

    def save_state(self, s: Session, name: str) -> dict:
        return self._wait(self.scheduler.submit("save_state", s.id, name))

    def load_state(self, s: Session, name: str) -> dict:
        return self._wait(self.scheduler.submit("load_state", s.id, name))

    def save_sampler(self, s: Session, name: str) -> dict:
        return self._wait(self.scheduler.submit("save_sampler", s.id, name))

    def adapter_bytes(self, s: Session) -> dict[str, torch.Tensor]:
        return self._wait(self.scheduler.submit("read_weights", s.id, None))

    def merged_weights(self, s: Session) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """The base weights with the session's adapter folded in (W + (alpha/r) B A, k3.lora's merge), as a
        K3ForCausalLM state dict, and metadata (the model config, the step): a checkpoint that serves without
        LoRA."""
        return self._wait(self.scheduler.submit("merged_weights", s.id, None))

    # ------------------------------------------------------------------ sampling
    def sample(self, sampler_id: str, owner: Session, prompt: list[int], num_samples: int, params: dict,
               return_routed_experts: bool = False) -> dict:
        c = self.config
        self._check_tokens(prompt, "prompt")
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or not 1 <= num_samples <= c.max_num_samples:
            raise ServiceError(400 if not isinstance(num_samples, int) or num_samples < 1 else 413,
                               f"num_samples: must be an integer in [1, {c.max_num_samples}], got {num_samples!r}")
        known = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
        if not isinstance(params, dict):
            raise ServiceError(400, "sampling_params: expected an object")
        for k in params:
            if k not in known:
                raise ServiceError(400, f"sampling_params.{k}: unknown field (known: {sorted(known)})")
        mt = params.get("max_tokens", 32)
        if isinstance(mt, int) and not isinstance(mt, bool) and mt > c.max_sample_tokens:
            raise ServiceError(413, f"sampling_params.max_tokens: {mt} exceeds the limit of {c.max_sample_tokens}")
        stop = params.get("stop", [])
        if not isinstance(stop, list):
            raise ServiceError(400, "sampling_params.stop: expected a list of token ids")
        sp = EngineSampling(temperature=params.get("temperature", 1.0), top_p=params.get("top_p", 1.0),
                            top_k=params.get("top_k", 0), seed=params.get("seed"), max_tokens=mt,
                            stop_token_ids=tuple(stop), n=num_samples, adapter_id=sampler_id)
        try:
            sp.validate("sampling_params")
        except ValueError as e:
            raise ServiceError(400, str(e)) from None
        if len(prompt) + mt > self.model.config.max_position_embeddings:
            raise ServiceError(413, "sampling_params.max_tokens: prompt + max_tokens exceed the model's positions")
        self._prefetch(sampler_id)
        if not isinstance(return_routed_experts, bool):
            raise ServiceError(400, f"return_routed_experts: expected true or false, got {return_routed_experts!r}")
        return self._wait(self.scheduler.submit("sample", owner.id, (prompt, sp, return_routed_experts),
                                                rows=num_samples))

    def compute_logprobs(self, sampler_id: str, owner: Session, prompt: list[int]) -> list[float | None]:
        self._check_tokens(prompt, "prompt")
        self._prefetch(sampler_id)
        return self._wait(self.scheduler.submit("logprobs", owner.id, (sampler_id, prompt)))

    # ------------------------------------------------------------------ execution (scheduler thread)
    def _execute(self, kind: str, batch: list[Request]) -> None:
        gone = [r for r in batch if r.session not in self.sessions and kind != "register"]
        for r in gone:   # deleted while the request waited
            r.future.set_exception(ServiceError(404, f"session_id: no session {r.session!r}"))
        batch = [r for r in batch if r not in gone]
        if not batch:
            return
        try:
            if kind in ("forward_backward", "forward"):
                self._run_training(batch, backward=kind == "forward_backward")
            elif kind in ("sample", "logprobs"):
                batch = self._drop_retired(batch, kind)
                if not batch:
                    return
                t0 = time.perf_counter()
                self._ensure_loaded([r.payload[1].adapter_id if kind == "sample" else r.payload[0] for r in batch])
                if kind == "sample":
                    t1 = time.perf_counter()
                    self._run_sample(batch)
                    self.stats["sample_load_s"] += t1 - t0
                    self.stats["sample_generate_s"] += time.perf_counter() - t1
                else:
                    for r, lp in zip(batch, prompt_logprobs(self.model, self.manager, [r.payload for r in batch],
                                                            bucket=self.config.length_bucket)):
                        r.future.set_result(lp)
            else:
                self._run_each(kind, batch)
        except ServiceError:
            raise
        except FloatingPointError as e:
            raise ServiceError(422, f"{kind}: {e}") from None
        except Exception as e:  # noqa: BLE001 - reported to this round's requests; the service goes on
            raise ServiceError(500, f"{kind}: {type(e).__name__}: {e}") from None

    def _run_each(self, kind: str, batch: list[Request]) -> None:
        for r in batch:
            try:
                r.future.set_result(getattr(self, f"_do_{kind}")(self.sessions[r.session] if kind != "register"
                                                                  else r.payload, r.payload))
            except ServiceError as e:
                r.future.set_exception(e)
            except FloatingPointError as e:
                r.future.set_exception(ServiceError(422, f"{kind}: {e}"))
            except Exception as e:  # noqa: BLE001 - reported to that request only
                r.future.set_exception(ServiceError(500, f"{kind}: {type(e).__name__}: {e}"))

    def _run_training(self, batch: list[Request], backward: bool) -> None:
        sessions = [self.sessions[r.session] for r in batch]
        for s in sessions:
            s.ready()
        saved = [s.grads() for s in sessions]
        try:
            results = run_packed(self.model, self.manager, [r.payload for r in batch],
                                 bucket=self.config.length_bucket, backward=backward)
        except Exception:
            for s, g in zip(sessions, saved):
                s.restore_grads(g)
            if len(batch) == 1:
                raise
            for r in batch:  # one bad request must not fail the others: run each alone
                self._run_training([r], backward)
            return
        for r, s, res in zip(batch, sessions, results):
            if backward:
                s.pending += 1
                self.stats["trained_rows"] += len(r.payload.data)
                self.stats["replayed_rows"] += sum("routed_experts" in d.loss_fn_inputs for d in r.payload.data)
                self.stats["trained_tokens"] += int(res.metrics.get("num_tokens", 0))
            r.future.set_result({"loss_fn_outputs": [{"logprobs": lp} for lp in res.logprobs],
                                 "metrics": res.metrics})

    def _run_sample(self, batch: list[Request]) -> None:
        prompts = [r.payload[0] for r in batch]
        params = [r.payload[1] for r in batch]
        comps = self.engine.generate(prompts, params)
        i = 0
        for r, sp in zip(batch, params):
            seqs = comps[i:i + sp.n]
            i += sp.n
            self.stats["sampled_tokens"] += sum(len(c.token_ids) for c in seqs)
            out = [{"tokens": list(c.token_ids), "logprobs": list(c.logprobs), "stop_reason": c.finish_reason}
                   for c in seqs]
            if r.payload[2]:
                for o, c in zip(out, seqs):
                    o["routed_experts"] = c.routed_experts.tolist()
            r.future.set_result({"sequences": out})

    def _do_register(self, s: Session, _payload) -> dict:
        self.manager.add(s.id, s.adapter)
        return {"session_id": s.id}

    def _do_delete(self, s: Session, _payload) -> dict:
        files = [f for k, f in self._sampler_files.items() if self.samplers.get(k) == s.id]
        self._unload_samplers_of(s.id)
        self.manager.remove(s.id)
        self.store.delete_session(s.id)
        for f in files:
            (self.store.root / f).unlink(missing_ok=True)
        del self.sessions[s.id]
        self.scheduler.forget(s.id)
        return {"deleted": s.id}

    def _do_optim_step(self, s: Session, adam: AdamParams) -> dict:
        before, grads, pending = s.state_tensors(), s.grads(), s.pending
        m = s.optim_step(adam, before=before)   # all or nothing in memory
        try:
            rel = self.store.state_path(s.id, s.step).relative_to(self.store.root)
            write_tensors(self.store.root / rel, s.state_tensors(copy=False))
            old = self.store.state_path(s.id, s.step - 1)
            self.store.commit_step(s.id, s.step, str(rel))
        except BaseException:   # not durable: undo the step in memory too
            s.load_state_tensors(before)
            s.restore_grads(grads)
            s.step -= 1
            s.pending = pending
            raise
        old.unlink(missing_ok=True)
        return {"step": s.step, "metrics": m}

    def _do_save_state(self, s: Session, name: str) -> dict:
        rel = Path("sessions") / s.id / f"ckpt-{name}.safetensors"
        write_tensors(self.store.root / rel, s.state_tensors(copy=False))
        self.store.put_checkpoint(s.id, name, s.step, str(rel))
        return {"path": f"k3://{s.id}/{name}", "step": s.step}

    def _do_load_state(self, s: Session, name: str) -> dict:
        ck = self.store.checkpoint(s.id, name)
        if ck is None:
            raise ServiceError(404, f"name: session {s.id} has no saved state {name!r}")
        step, rel = ck
        t = read_tensors(self.store.root / rel)
        s.load_state_tensors(t)
        s.drop_grads()
        prev = s.step
        s.step = step
        path = self.store.state_path(s.id, step).relative_to(self.store.root)
        if step != prev:
            write_tensors(self.store.root / path, t)
            self.store.commit_step(s.id, step, str(path))
        return {"step": s.step}

    def _build_sampler(self, sampler_id: str, owner: str, tensors: dict[str, torch.Tensor] | None) -> LoRAAdapter:
        s = self.sessions[owner]
        if tensors is None:
            tensors = read_tensors(self.store.root / self._sampler_files[sampler_id])
        ad = LoRAAdapter(s.config, s.adapter.targets, device=self.device)
        ad.load_tensors(tensors)
        ad.requires_grad_(False)
        return ad

    def _prefetch(self, sampler_id: str) -> None:
        """Start reading an unloaded snapshot on the loader thread (called at submit, off the scheduler)."""
        with self._lock:
            owner = self.samplers.get(sampler_id)
            if owner is None or sampler_id in self._loaded or sampler_id in self._loading:
                return
            self._loading[sampler_id] = self._loader.submit(self._build_sampler, sampler_id, owner, None)

    def _register(self, sampler_id: str, ad: LoRAAdapter) -> None:
        """Scheduler thread: put a snapshot into the manager (LRU eviction beyond max_loaded_samplers)."""
        if sampler_id in self.manager.adapters:
            self.manager.remove(sampler_id)
        self.engine.adapter_updated(sampler_id)      # nothing cached under this id survives a (re)load
        self.manager.add(sampler_id, ad)
        self._loaded[sampler_id] = None
        self._loaded.move_to_end(sampler_id)
        while len(self._loaded) > self.config.max_loaded_samplers:
            old, _ = self._loaded.popitem(last=False)
            self.manager.remove(old)
            self.engine.adapter_updated(old)

    def _ensure_loaded(self, sampler_ids: list[str]) -> None:
        if len(set(sampler_ids)) > self.config.max_loaded_samplers:
            raise ServiceError(503, f"sampler_id: one round needs {len(set(sampler_ids))} snapshots, more than "
                                    f"max_loaded_samplers {self.config.max_loaded_samplers}")
        for sid in dict.fromkeys(sampler_ids):
            if sid in self._loaded:
                self._loaded.move_to_end(sid)
                continue
            with self._lock:
                fut = self._loading.pop(sid, None)
            ad = fut.result() if fut is not None else self._build_sampler(sid, self.samplers[sid], None)
            self._register(sid, ad)
        for sid in sampler_ids:   # a later registration in this loop may not evict an earlier one of this round
            if sid not in self._loaded:
                raise ServiceError(503, f"sampler_id: {sid!r} could not be kept loaded")

    def _drop_retired(self, batch: list[Request], kind: str) -> list[Request]:
        """Requests for snapshots removed (retention) while they waited get 410; the others go on."""
        keep = []
        for r in batch:
            sampler_id = r.payload[1].adapter_id if kind == "sample" else r.payload[0]
            if sampler_id in self.samplers:
                keep.append(r)
            else:
                r.future.set_exception(ServiceError(410, f"sampler_id: {sampler_id!r} was removed by the "
                                                         f"retention rule while the request waited"))
        return keep

    def _retain(self, owner: str) -> None:
        """Keep the newest `keep_samplers` snapshots of session `owner` (creation order); remove the others:
        unloaded, their rows deleted (one transaction), then their files."""
        mine = [k for k, v in self.samplers.items() if v == owner]   # insertion order = creation order
        old = mine[: max(0, len(mine) - self.config.keep_samplers)]
        if old:
            files = [self._sampler_files[k] for k in old]
            self._unload_samplers(old)
            self.store.delete_samplers(old)
            self._retired.update(old)
            for f in files:
                (self.store.root / f).unlink(missing_ok=True)

    def _unload_samplers_of(self, owner: str) -> None:
        self._unload_samplers([k for k, v in self.samplers.items() if v == owner])

    def _unload_samplers(self, sampler_ids: list[str]) -> None:
        for sampler_id in sampler_ids:
            if sampler_id in self._loaded:
                del self._loaded[sampler_id]
                self.manager.remove(sampler_id)
                self.engine.adapter_updated(sampler_id)
            with self._lock:
                fut = self._loading.pop(sampler_id, None)
            if fut is not None:
                fut.cancel()
            del self.samplers[sampler_id]
            self._sampler_files.pop(sampler_id, None)

    def _do_save_sampler(self, s: Session, name: str) -> dict:
        sampler_id = f"{s.id}.{name}.{s.step}"
        if sampler_id not in self.samplers:
            tensors = s.adapter.tensors()
            rel = Path("samplers") / f"{sampler_id}.safetensors"
            write_tensors(self.store.root / rel, tensors)
            self.store.add_sampler(sampler_id, s.id, name, s.step, str(rel))
            self.samplers[sampler_id] = s.id
            self._sampler_files[sampler_id] = str(rel)
            self._register(sampler_id, self._build_sampler(sampler_id, s.id, tensors))
            self._retain(s.id)
        return {"sampler_id": sampler_id, "step": s.step}

    def _do_read_weights(self, s: Session, _payload) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in s.adapter.tensors().items()}

    def _do_merged_weights(self, s: Session, _payload) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        import json

        sd = self.manager.merged_state_dict(s.id)
        tensors = {k: v.detach().contiguous().cpu().clone() for k, v in sd.items()}
        meta = {"format": "k3-merged", "config": json.dumps(self.model.config.to_dict()),
                "base_model": self.config.base_model, "session_id": s.id, "step": str(s.step)}
        return tensors, meta


def validate_name(name, where: str = "name") -> str:
    if not isinstance(name, str) or not name or len(name) > 64 or not all(c.isalnum() or c in "-_" for c in name):
        raise ServiceError(400, f"{where}: expected 1-64 characters of letters, digits, '-' or '_', got {name!r}")
    return name
