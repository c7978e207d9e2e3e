"""The RL learner: GSPO with off-policy corrections on a K3 model, LoRA or full parameters, with Router Replay.

    learner = Learner(model, LearnerConfig(lora=LoRAConfig.preset("tiny")))
    metrics = learner.forward_backward(batch)     # any number of calls accumulate gradients (micro-batches)
    metrics |= learner.optim_step()               # AdamW + grad clipping; returns the grad norm
    weights = learner.policy_state_dict()         # what the rollout engine loads (LoRA merged in)

Token log-probs: the model reads tokens[:, :-1]; the logits at position t score token t + 1, so log p of token t
lands at column t of a [B, T] tensor (column 0 is 0: nothing predicts the first token). All [B, T] inputs use the
same alignment: `rollout_logp[:, t]` is the engine's log-prob of `tokens[:, t]`.

pi_old (`Batch.old_logp`) defaults to the trainer's own log-probs of this forward, detached: the on-policy case
(the learner's weights are the sampling weights until `optim_step`), where the GSPO ratio starts at 1 and the
train/rollout mismatch is corrected by the importance weights pi_old / mu (band masking, `k3.rl.gspo_loss`).
Pass `old_logp` (e.g. from `compute_logprobs` before the first update) for several updates on one batch.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import nn

from k3.lora import LoRAAdapter, LoRAConfig, LoRAManager
from k3.rl import _checks
from k3.rl.gspo import AGG_MODES, gspo_loss
from k3.rl.kl import KL_KINDS
from k3.rl.off_policy import DEFAULT_BAND, mismatch_metrics
from k3.rl.router_replay import check_routed_experts, routing_diff

POLICY_ADAPTER = "policy"


@dataclass
class Batch:
    """One RL batch of B sequences of T tokens (prompt + response, right-padded).

    tokens [B, T] integer ids; response_mask [B, T] bool/0-1 at response tokens (never column 0);
    rollout_logp [B, T] the engine's log-prob of each token (finite at response tokens); advantages [B]
    (or [B, T] with token-level GSPO); old_logp [B, T] optional pi_old; routed_experts [B, T or T-1, n_moe, k]
    the engine's expert ids (Router Replay); seq_weights [B] >= 0 optional (staleness, `k3.rl.filter_stale`)."""

    tokens: torch.Tensor
    response_mask: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None
    seq_weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.tokens.shape[0])

    def validate(self, config=None) -> None:
        """Check shapes, dtypes and values; every error is a ValueError naming the field. `config` (K3Config)
        adds the vocabulary and routing checks."""
        t = self.tokens
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"tokens must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"tokens must be an integer [B, T] tensor, got {t.dtype} {tuple(t.shape)}")
        B, T = t.shape
        if B == 0 or T < 2:
            raise ValueError(f"tokens must have B >= 1 rows and T >= 2 tokens, got {tuple(t.shape)}")
        if config is not None and (int(t.min()) < 0 or int(t.max()) >= config.vocab_size):
            raise ValueError(f"tokens: ids must be in [0, {config.vocab_size}), got range [{int(t.min())}, "
                             f"{int(t.max())}]")
        like = torch.empty(B, T, device=t.device)
        mask = _checks.mask_tensor("response_mask", self.response_mask, like, "tokens")
        if bool(mask[:, 0].any()):
            raise ValueError("response_mask[:, 0] must be 0: the first token has no prediction")
        _checks.nonempty_rows("response_mask", mask)
        for name in ("rollout_logp", "old_logp"):
            v = getattr(self, name)
            if v is None and name == "old_logp":
                continue
            v = _checks.token_tensor(name, v, like, "tokens")
            _checks.finite_at(name, v, mask)
        a = self.advantages
        if not isinstance(a, torch.Tensor) or not a.is_floating_point():
            raise ValueError(f"advantages must be a floating torch.Tensor, got "
                             f"{getattr(a, 'dtype', type(a).__name__)}")
        if a.shape not in ((B,), (B, T)):
            raise ValueError(f"advantages must be [B] or [B, T] = {(B,)} or {(B, T)}, got {tuple(a.shape)}")
        if a.dim() == 1 and not bool(torch.isfinite(a).all()):
            raise ValueError("advantages has NaN/inf values")
        if a.dim() == 2:
            _checks.finite_at("advantages", a, mask.to(a.device))
        if self.routed_experts is not None:
            check_routed_experts(self.routed_experts, B, T, config)
        if self.seq_weights is not None:
            w = self.seq_weights
            if not isinstance(w, torch.Tensor) or w.shape != (B,) or not w.is_floating_point():
                raise ValueError(f"seq_weights must be a floating [B] = {(B,)} tensor, got "
                                 f"{getattr(w, 'dtype', None)} {tuple(getattr(w, 'shape', ()))}")
            if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
                raise ValueError("seq_weights must be finite and >= 0")

    def to(self, device: torch.device | str) -> "Batch":
        return Batch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                        for f in fields(self)})

    def select(self, rows: slice) -> "Batch":
        """The sequences `rows` (a slice) as a Batch."""
        return Batch(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[rows]
                        for f in fields(self)})


@dataclass
class LearnerConfig:
    """Optimiser (AdamW), GSPO and correction settings. `lora=None` trains all parameters."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    token_level: bool = False
    agg: str = "seq-mean-token-mean"
    is_band: tuple[float, float] | None = DEFAULT_BAND
    is_level: Literal["token", "sequence"] | None = "token"
    seq_mask: bool = False
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    router_replay: bool = True
    micro_batch_size: int | None = None
    lora: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm}")
        if self.agg not in AGG_MODES:
            raise ValueError(f"agg must be one of {AGG_MODES}, got {self.agg!r}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"kl_kind must be one of {KL_KINDS}, got {self.kl_kind!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {self.micro_batch_size}")
        if not (0.0 <= self.eps_low < 1.0 and self.eps_high >= 0.0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.is_level not in ("token", "sequence", None):
            raise ValueError(f"is_level must be 'token', 'sequence' or None, got {self.is_level!r}")
        self.is_band = _checks.band("is_band", self.is_band)


class Learner:
    """forward_backward / optim_step over a K3ForCausalLM (see module doc).

    LoRA mode (`config.lora`): a `LoRAManager` holds one adapter named "policy"; the base weights are frozen and
    the KL reference is the base model (adapter disabled). Full mode: every trainable parameter is optimised and
    the KL reference is `ref_model` (a frozen copy of the initial model when kl_coef > 0 and none is given)."""

    def __init__(self, model: nn.Module, config: LearnerConfig | None = None, *, ref_model: nn.Module | None = None,
                 seed: int | None = None) -> None:
        self.model = model
        self.config = config or LearnerConfig()
        self.device = next(model.parameters()).device
        self.version = 0
        self._pending = 0
        self.lora: LoRAManager | None = None
        self.adapter: LoRAAdapter | None = None
        self.ref_model: nn.Module | None = None
        if self.config.lora is not None:
            if ref_model is not None:
                raise ValueError("ref_model: in LoRA mode the reference is the base model (adapter disabled)")
            model.requires_grad_(False)
            self.lora = LoRAManager(model)
            self.adapter = self.lora.create(POLICY_ADAPTER, self.config.lora, seed=seed)
            self.lora.activate(POLICY_ADAPTER)
            self.params = list(self.adapter.parameters())
        else:
            self.params = [p for p in model.parameters() if p.requires_grad]
            if self.config.kl_coef > 0:
                self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
                self.ref_model.requires_grad_(False)
        if not self.params:
            raise ValueError("model: no trainable parameters")
        c = self.config
        self.optimizer = torch.optim.AdamW(self.params, lr=c.lr, betas=c.betas, eps=c.adam_eps,
                                           weight_decay=c.weight_decay)

    # ------------------------------------------------------------------ log-probs
    def _routing(self, batch: Batch) -> torch.Tensor | None:
        if not self.config.router_replay or not getattr(self.model, "moe_layer_ids", None):
            return None
        if batch.routed_experts is None:
            raise ValueError("routed_experts is required with router_replay=True (the rollout's expert ids); "
                             "set LearnerConfig(router_replay=False) to route with the trainer's router")
        return batch.routed_experts[:, : batch.tokens.shape[1] - 1].long()

    def _token_logp(self, model: nn.Module, tokens: torch.Tensor, routed: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] log-probs of tokens[:, 1:] in columns 1.. (column 0 is 0) and the routing used."""
        out = model(tokens[:, :-1], use_cache=False, routed_experts=routed, return_routed_experts=True)
        logits = out.logits.float()
        tgt = tokens[:, 1:]
        lp = logits.gather(-1, tgt[..., None])[..., 0] - torch.logsumexp(logits, dim=-1)
        return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1), out.routed_experts

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, router_replay: bool | None = None) -> torch.Tensor:
        """The current policy's [B, T] token log-probs (no gradient), routed like `forward_backward` unless
        `router_replay` overrides it (False: the trainer's own routing)."""
        batch.validate(getattr(self.model, "config", None))
        batch = batch.to(self.device)
        replay = self.config.router_replay if router_replay is None else router_replay
        routed = self._routing(batch) if replay else None
        return self._token_logp(self.model, batch.tokens, routed)[0]

    @torch.no_grad()
    def _ref_logp(self, batch: Batch, routed: torch.Tensor | None) -> torch.Tensor:
        if self.lora is not None:
            with self.lora.use(None):
                return self._token_logp(self.model, batch.tokens, routed)[0]
        return self._token_logp(self.ref_model, batch.tokens, routed)[0]

    # ------------------------------------------------------------------ training
    def forward_backward(self, batch: Batch, *, micro_batch_size: int | None = None,
                         num_seqs: float | None = None, num_tokens: float | None = None) -> dict[str, float]:
        """Accumulate the GSPO gradient of `batch` (split into micro-batches of `micro_batch_size` sequences).

        The loss of a split batch is normalised by the whole batch's response sequences/tokens, so the summed
        gradient is the full batch's (tokens masked by the corrections then stay in the denominator). To
        accumulate over several calls yourself, pass the global `num_seqs` / `num_tokens` of all of them. If a
        micro-batch fails (e.g. NaN log-probs), the whole accumulated gradient is dropped before the error is raised.
        Returns metrics: loss, pg_loss, clip_frac, masked_frac, seq_masked_frac, mismatch_k3_kl,
        max_abs_dlogp, mean_abs_dlogp (trainer vs rollout log-probs), kl_ref (per-token KL to the reference)
        and kl_loss (its aggregated penalty term) with kl_coef, num_tokens,
        num_seqs, micro_batches; router_flip_frac / router_token_flip_frac when the rollout routing is given
        but not replayed."""
        cfg = self.config
        batch.validate(getattr(self.model, "config", None))
        if micro_batch_size is not None and micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if batch.advantages.dim() == 2 and not cfg.token_level:
            raise ValueError("advantages is [B, T]: per-token advantages need LearnerConfig(token_level=True)")
        batch = batch.to(self.device)
        B = batch.batch_size
        mbs = micro_batch_size or cfg.micro_batch_size or B
        mask = batch.response_mask.bool()
        if mbs < B:
            num_seqs = float(B) if num_seqs is None else num_seqs
            num_tokens = float(mask.sum()) if num_tokens is None else num_tokens
        try:
            sums, trainer_lp, used_routes = self._accumulate(batch, mbs, num_seqs, num_tokens)
        except Exception:
            # a micro-batch failed after earlier ones added gradient: drop all of it rather than keep a part
            self.optimizer.zero_grad(set_to_none=True)
            self._pending = 0
            raise
        self._pending += 1
        kept = max(sums["num_tokens"], 1.0)
        n_resp = int(mask.sum())
        out = {
            "loss": sums["loss"],
            "pg_loss": sums["pg_loss"],
            "clip_frac": sums["clip_frac"] / kept,
            "masked_frac": sums["masked_frac"] / n_resp,
            "seq_masked_frac": sums["seq_masked_frac"] / B,
            "num_tokens": float(n_resp),
            "num_seqs": float(B),
            "micro_batches": float(math.ceil(B / mbs)),
        }
        if "kl_ref" in sums:
            out.update(kl_ref=sums["kl_ref"] / kept, kl_loss=sums["kl_loss"])
        mm = mismatch_metrics(torch.cat(trainer_lp), batch.rollout_logp, mask)
        out.update(mismatch_k3_kl=mm["k3_kl"], max_abs_dlogp=mm["max_abs_dlogp"], mean_abs_dlogp=mm["mean_abs_dlogp"])
        if batch.routed_experts is not None and not cfg.router_replay and used_routes[0] is not None:
            T1 = batch.tokens.shape[1] - 1
            rd = routing_diff(torch.cat(used_routes), batch.routed_experts[:, :T1].long(), mask[:, 1:])
            out.update(router_flip_frac=rd["flip_frac"], router_token_flip_frac=rd["token_flip_frac"])
        return out

    def _accumulate(self, batch: Batch, mbs: int, num_seqs: float | None, num_tokens: float | None
                    ) -> tuple[dict[str, float], list[torch.Tensor], list[torch.Tensor | None]]:
        """Forward and backward of each micro-batch of `mbs` sequences; returns the metric sums (fractions
        weighted by what they are fractions of), the trainer's detached log-probs and the routings used."""
        cfg = self.config
        sums: dict[str, float] = {}
        trainer_lp, used_routes = [], []

        def add(key: str, value: float) -> None:
            sums[key] = sums.get(key, 0.0) + value

        for start in range(0, batch.batch_size, mbs):
            mb = batch.select(slice(start, start + mbs))
            routed = self._routing(mb)
            lp, used = self._token_logp(self.model, mb.tokens, routed)
            old = lp.detach() if mb.old_logp is None else mb.old_logp
            ref = self._ref_logp(mb, routed) if cfg.kl_coef > 0 else None
            loss, m = gspo_loss(
                lp, old, mb.advantages, mb.response_mask, cfg.eps_low, cfg.eps_high,
                token_level=cfg.token_level, rollout_logp=mb.rollout_logp, is_band=cfg.is_band,
                is_level=cfg.is_level, seq_mask=cfg.seq_mask, seq_weights=mb.seq_weights, ref_logp=ref,
                kl_coef=cfg.kl_coef, kl_kind=cfg.kl_kind, agg=cfg.agg, num_seqs=num_seqs, num_tokens=num_tokens)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"GSPO loss is {float(loss)} on sequences {start}..{start + mb.batch_size}")
            loss.backward()
            add("loss", m["loss"])
            add("pg_loss", m["pg_loss"])
            add("clip_frac", m["clip_frac"] * m["num_tokens"])
            add("num_tokens", m["num_tokens"])
            add("masked_frac", m["masked_frac"] * int(mb.response_mask.bool().sum()))
            add("seq_masked_frac", m["seq_masked_frac"] * mb.batch_size)
            if "kl_ref" in m:
                add("kl_ref", m["kl_ref"] * m["num_tokens"])
                add("kl_loss", m["kl_loss"])
            trainer_lp.append(lp.detach())
            used_routes.append(used)
        return sums, trainer_lp, used_routes

    def optim_step(self) -> dict[str, float]:
        """Clip the accumulated gradient to `max_grad_norm`, take an AdamW step, zero the gradient.
        Returns grad_norm (before clipping), lr and step. Raises if no gradient was accumulated, or if the
        gradient is NaN/inf (the step is then skipped and the gradient dropped)."""
        if self._pending == 0:
            raise RuntimeError("optim_step() needs a forward_backward() first: no gradient accumulated")
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm is not None else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self._pending = 0
            raise FloatingPointError(f"gradient norm is {grad_norm}: step skipped, gradient dropped")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._pending = 0
        self.version += 1
        return {"grad_norm": grad_norm, "lr": self.optimizer.param_groups[0]["lr"], "step": float(self.version)}

    # ------------------------------------------------------------------ export
    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a rollout engine needs, in the model's state-dict names: the full model (LoRA merged in,
        computed out of place; the model is not changed)."""
        if self.lora is not None:
            return self.lora.merged_state_dict(POLICY_ADAPTER)
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter's tensors alone (`<target>.lora_A|B`)."""
        if self.adapter is None:
            raise ValueError("adapter_state_dict: the learner trains full parameters (no LoRA adapter)")
        return self.adapter.tensors()

    def save_adapter(self, path) -> None:
        """Write the LoRA adapter alone to a safetensors file (see `k3.lora.LoRAAdapter.save`)."""
        if self.adapter is None:
            raise ValueError("save_adapter: the learner trains full parameters (no LoRA adapter)")
        self.adapter.save(path)


__all__ = ["Batch", "Learner", "LearnerConfig", "POLICY_ADAPTER"]
