"""Request/response types of the embedded rollout engine.

A sequence's *key* records how every token was computed, not only which token it is: the engine always processes
a sequence in the same segments (prefill chunks aligned to absolute multiples of `chunk_size` and cut at the end
of every prefill span; every decode token alone). A token's computation depends on its whole segment (a chunk of
59 tokens runs other kernels than one of 32), so each key element holds the token, the length of its segment and
a kind: key = (token << 12) | (segment length << 2) | kind. Two sequences with equal key prefixes have
bitwise-equal caches over that prefix, and they diverge at a segment start at the latest.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

KIND_PREFILL = 0      # prompt / tool-output token inside a prefill span
KIND_PREFILL_END = 1  # last token of a prefill span (its logits are sampled from)
KIND_DECODE = 2       # generated token fed back alone (one-token decode step)
SPAN_KINDS = ("prefill", "decode")
MAX_SEGMENT = 1023


def make_key(token: int, seg_len: int, kind: int) -> int:
    return (token << 12) | (seg_len << 2) | kind


def key_token(k: int) -> int:
    return k >> 12


def key_len(k: int) -> int:
    """Length of the segment this token belongs to (the engine reads it at the segment's first token)."""
    return (k >> 2) & MAX_SEGMENT


def key_kind(k: int) -> int:
    return k & 3


@dataclass
class SamplingParams:
    """Per-request sampling. temperature 0 = greedy. top_k 0 = off; top_p 1 = off. `seed` makes the sampled tokens
    a function of the request alone (sample i of n uses its own generator seeded from (seed, i)); None draws a
    seed from the engine's seeded counter. `stop_token_ids` end a turn (the stop token is kept in the output)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    adapter_id: str | None = None

    def validate(self, where: str = "sampling") -> None:
        """Types, finiteness and ranges of every field, each error naming `where.field`: a request must fail here,
        before admission, never inside sampling (where it would fail after its pages and states were taken)."""
        _real(self.temperature, f"{where}.temperature", lambda v: v >= 0.0, "must be finite and >= 0")
        _real(self.top_p, f"{where}.top_p", lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
        _integer(self.top_k, f"{where}.top_k", 0)
        if self.seed is not None:
            _integer(self.seed, f"{where}.seed", 0)
        _integer(self.max_tokens, f"{where}.max_tokens", 1)
        _integer(self.n, f"{where}.n", 1)
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise ValueError(f"{where}.stop_token_ids: expected a tuple of token ids, got "
                             f"{type(self.stop_token_ids).__name__}")
        for t in self.stop_token_ids:
            _integer(t, f"{where}.stop_token_ids", 0)
        if self.adapter_id is not None and (not isinstance(self.adapter_id, str) or not self.adapter_id):
            raise ValueError(f"{where}.adapter_id: expected None or a non-empty adapter name, got {self.adapter_id!r}")


def _integer(v, name: str, low: int) -> None:
    """A Python/numpy integer (not a bool, not a float such as 2.5 or 3.0) >= low."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{name}: expected an integer, got {type(v).__name__} ({v!r})")
    if v < low:
        raise ValueError(f"{name}: must be >= {low}, got {v}")


def _real(v, name: str, ok, why: str) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name}: expected a number, got {type(v).__name__} ({v!r})")
    if not math.isfinite(v) or not ok(v):
        raise ValueError(f"{name}: {why}, got {v}")


def as_token_ids(tokens, where: str) -> list[int]:
    """Token ids as a list[int]; integers only (a float token or a bool is a client bug, not a token)."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise ValueError(f"{where}: a tensor prompt must be a 1-D integer tensor, got {tokens.dtype} "
                             f"{tuple(tokens.shape)}")
        return tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
        raise ValueError(f"{where}: expected a list of token ids, got {type(tokens).__name__}")
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{where}[{i}]: token ids must be integers, got {type(t).__name__} ({t!r})")
        out.append(int(t))
    return out


class Prompt(list):
    """Token ids (a list[int]) plus how they are to be computed: `spans` = [(length, "prefill"|"decode"), ...].
    A plain list[int] prompt is one prefill span. `Completion.extend(tool_tokens)` builds the next turn's prompt:
    the history keeps the decode spans it was generated with, so a prefix-cache hit resumes it with zero
    recompute, and an engine without the cache recomputes it with exactly the same ops."""

    def __init__(self, tokens, spans: list[tuple[int, str]] | None = None, parent_len: int = 0):
        super().__init__(int(t) for t in tokens)
        self.spans = [(len(self), "prefill")] if spans is None else [(int(n), k) for n, k in spans if n > 0]
        self.parent_len = parent_len  # tokens the previous turn already computed (recompute accounting)

    def validate(self, vocab_size: int, where: str = "prompt") -> None:
        if len(self) == 0:
            raise ValueError(f"{where}: empty prompt")
        bad = [t for t in self if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{where}: token ids must be in [0, {vocab_size}), got {bad[:5]}")
        if sum(n for n, _ in self.spans) != len(self):
            raise ValueError(f"{where}.spans: lengths sum to {sum(n for n, _ in self.spans)}, prompt has {len(self)}")
        if any(k not in SPAN_KINDS for _, k in self.spans):
            raise ValueError(f"{where}.spans: kinds must be in {SPAN_KINDS}, got {[k for _, k in self.spans]}")
        if self.spans[-1][1] != "prefill":
            raise ValueError(f"{where}.spans: the last span must be a prefill span (the engine samples after it)")

    def key(self, chunk_size: int) -> list[int]:
        """Key elements: prefill spans cut into chunks at absolute multiples of chunk_size and at the span end."""
        if not 1 <= chunk_size <= MAX_SEGMENT:
            raise ValueError(f"chunk_size: must be in [1, {MAX_SEGMENT}], got {chunk_size}")
        out: list[int] = []
        i = 0
        for n, kind in self.spans:
            if kind == "decode":
                out.extend(make_key(t, 1, KIND_DECODE) for t in self[i:i + n])
            else:
                a, b = i, i + n
                while a < b:
                    e = min(b, (a // chunk_size + 1) * chunk_size)
                    out.extend(make_key(t, e - a, KIND_PREFILL) for t in self[a:e])
                    a = e
                out[-1] = make_key(self[b - 1], key_len(out[-1]), KIND_PREFILL_END)
            i += n
        return out


@dataclass
class Completion:
    """One sample. `logprobs[i]` is log p(token_ids[i]) under the model's full softmax at temperature 1 (no top-k /
    top-p truncation): what a learner's forward computes for the same tokens. `sampling_logprobs[i]` is the
    log-prob under the distribution actually sampled from (temperature, top-k, top-p applied; 0.0 when greedy).
    `routed_experts[i]` is the routing [n_moe_layers, top_k] of the position whose logits produced token i
    (the last prompt position for i = 0), for Router Replay."""
    prompt: Prompt
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    routed_experts: torch.Tensor
    finish_reason: str
    policy_version: int
    adapter_id: str | None
    index: int = 0
    request_id: int = 0
    hit_tokens: int = 0          # prompt tokens served from the prefix cache

    def extend(self, tokens: list[int]) -> Prompt:
        """The next turn's prompt: this turn's prompt, the generated tokens, then `tokens` (e.g. tool output).
        The last generated token was never fed to the model, so it opens the new prefill span."""
        if not self.token_ids:
            raise ValueError("completion: no generated tokens to continue from")
        gen = list(self.token_ids)
        spans = list(self.prompt.spans)
        if len(gen) > 1:
            spans.append((len(gen) - 1, "decode"))
        spans.append((1 + len(tokens), "prefill"))
        return Prompt(list(self.prompt) + gen + [int(t) for t in tokens], spans,
                      parent_len=len(self.prompt) + len(gen) - 1)


def checked_requests(prompts, sampling, *, vocab_size: int, max_len: int, limit: str,
                     check_adapter) -> list[tuple[Prompt, SamplingParams, str]]:
    """Every request checked before any runs, each error naming `prompts[i]` / `sampling[i].field`: types, ranges,
    vocabulary, stop tokens, prompt + max_tokens against `max_len` (called `limit` in the message), and the adapter
    through `check_adapter(adapter_id, where)`. Returns (prompt, params, where) per request; a bare token list
    becomes a `Prompt`, a `Prompt` keeps its spans. Shared by the embedded engine and the framework backends."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: expected a non-empty list of token-id lists")
    many = isinstance(sampling, (list, tuple))
    params = list(sampling) if many else [sampling if sampling is not None else SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"sampling: {len(params)} SamplingParams for {len(prompts)} prompts")
    out = []
    for i, (pr, sp) in enumerate(zip(prompts, params)):
        where, swhere = f"prompts[{i}]", f"sampling[{i}]" if many else "sampling"
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"{swhere}: expected SamplingParams, got {type(sp).__name__}")
        sp.validate(swhere)
        if isinstance(pr, Prompt):
            as_token_ids(pr, where)   # its token types only: a Prompt keeps its spans
        else:
            pr = Prompt(as_token_ids(pr, where))
        pr.validate(vocab_size, where)
        bad = [t for t in sp.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{swhere}.stop_token_ids: {bad} outside [0, {vocab_size})")
        if len(pr) + sp.max_tokens > max_len:
            raise ValueError(f"{where}: {len(pr)} prompt tokens + max_tokens {sp.max_tokens} exceed {limit} "
                             f"{max_len}")
        check_adapter(sp.adapter_id, f"{swhere}.adapter_id")
        out.append((pr, sp, where))
    return out
