"""Multi-turn arithmetic with a calculator tool.

Prompt:   <bos> [fixed preamble of words] Q: 37*52+18 =
Model:    <call> 37*52+18 </call>           (stops at </call>)
Env:      <result> 1942 </result>           (sandboxed evaluation, appended as tokens)
Model:    <answer> 1942 </answer> <eos>
Rubric reward in [0, 1]: 0.8 correct final answer + 0.1 well-formed (calls parse, answer closed) + 0.1 no wasted
calls (at most one call, none failing). Deterministic train stream and a fixed held-out set of 50 tasks.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from k3.envs.calculator import CalcError, evaluate
from k3.envs.tokenizer import CalcTokenizer

MAX_TURNS = 3
HELDOUT_SEED = 20261130
HELDOUT_SIZE = 50
SYSTEM_SEED = 7
SYSTEM_TOKENS = 256


@dataclass(frozen=True)
class Task:
    expression: str
    answer: int


def make_task(rng: random.Random) -> Task:
    """Two or three 1-2 digit operands with + - *: too hard to do 'in the head' for a tiny model, easy with the tool."""
    n_ops = rng.choice([1, 2])
    parts = [str(rng.randint(2, 99))]
    for _ in range(n_ops):
        parts += [rng.choice("+-*"), str(rng.randint(2, 99))]
    expr = "".join(parts)
    return Task(expr, evaluate(expr))


def heldout_tasks() -> list[Task]:
    rng = random.Random(HELDOUT_SEED)
    return [make_task(rng) for _ in range(HELDOUT_SIZE)]


def system_prompt(tok: CalcTokenizer) -> list[int]:
    """A fixed preamble of plain words shared by every prompt (what a prefix cache serves across an RL run). It
    holds no question, expression or tool marker: the model's MLA layers have no positions (NoPE), so worked
    examples in the preamble would compete with the live question for every copy the model must make."""
    rng = random.Random(SYSTEM_SEED)
    words = ["compute", "the", "is", "what", "error"]
    return [tok.bos_id] + tok.encode(" ".join(rng.choice(words) for _ in range(SYSTEM_TOKENS)))


def train_tasks(seed: int, n: int) -> list[Task]:
    """n training tasks from the stream `seed`, never one of the held-out expressions."""
    held = {t.expression for t in heldout_tasks()}
    rng = random.Random(seed)
    out: list[Task] = []
    while len(out) < n:
        t = make_task(rng)
        if t.expression not in held:
            out.append(t)
    return out


@dataclass
class Episode:
    """One multi-turn episode: the token transcript and which tokens the model produced."""
    task: Task
    tokens: list[int]
    model_mask: list[bool]
    calls: list[str] = field(default_factory=list)
    failed_calls: int = 0
    answer: str | None = None
    malformed: bool = False
    done: bool = False
    turns: int = 0


class CalculatorEnv:
    def __init__(self, tokenizer: CalcTokenizer | None = None) -> None:
        self.tok = tokenizer or CalcTokenizer()
        t = self.tok
        self.stop_ids = [t["</call>"], t["</answer>"], t.eos_id]
        self.system = system_prompt(t)

    def prompt(self, task: Task) -> list[int]:
        """The shared system prompt (worked examples of tool use) then the question."""
        return [*self.system, *self.tok.encode(f"Q: {task.expression} =")]

    def start(self, task: Task) -> Episode:
        p = self.prompt(task)
        return Episode(task, list(p), [False] * len(p))

    def step(self, ep: Episode, generated: list[int]) -> list[int]:
        """Record a model turn; return the tool output tokens to append (empty when the episode is over)."""
        t = self.tok
        ep.tokens += generated
        ep.model_mask += [True] * len(generated)
        ep.turns += 1
        if not generated or any(not 0 <= i < len(t) for i in generated):  # outside the task's vocabulary
            ep.malformed, ep.done = True, True
            return []
        text = t.decode(generated).split()
        if "<call>" in text:
            if text[0] != "<call>" or text[-1] != "</call>" or len(text) != 3:
                ep.malformed, ep.done = True, True
                return []
            expr = text[1]
            ep.calls.append(expr)
            try:
                result = str(evaluate(expr))
            except CalcError:
                ep.failed_calls += 1
                result = "error"
            if ep.turns >= MAX_TURNS:
                ep.done = True
                return []
            out = t.encode(f"<result> {result} </result>")
            ep.tokens += out
            ep.model_mask += [False] * len(out)
            return out
        ep.done = True
        if text[-1:] == ["<eos>"]:
            text = text[:-1]
        if len(text) == 3 and text[0] == "<answer>" and text[2] == "</answer>":
            ep.answer = text[1]
        else:
            ep.malformed = True
        return []

    def reward(self, ep: Episode) -> float:
        correct = ep.answer is not None and ep.answer == str(ep.task.answer)
        well_formed = ep.answer is not None and not ep.malformed and ep.failed_calls == 0
        efficient = well_formed and len(ep.calls) <= 1
        return 0.8 * correct + 0.1 * well_formed + 0.1 * efficient

    def demonstration(self, task: Task, rng: random.Random, p_tool: float = 0.5, p_slip: float = 0.5) -> Episode:
        """A synthetic demonstration, deliberately imperfect: with prob. p_tool it uses the tool and copies the
        result; otherwise it answers from the head (a plausible but usually wrong number) or, with prob. p_slip of
        the tool uses, garbles the copied call or result."""
        ep = self.start(task)
        if rng.random() < p_tool:
            expr = task.expression
            garble = rng.random() < p_slip
            if garble and rng.random() < 0.5:
                expr = _garble(expr, rng)
            self.step(ep, self.tok.encode(f"<call> {expr} </call>"))
            try:
                result = str(evaluate(expr))
            except CalcError:
                result = "0"
            if garble and expr == task.expression:
                result = _garble_number(result, rng)
            self.step(ep, self.tok.encode(f"<answer> {result} </answer>"))
        else:
            guess = str(task.answer + rng.choice([-1, 1]) * rng.randint(1, 99)) if rng.random() < 0.9 else str(task.answer)
            self.step(ep, self.tok.encode(f"<answer> {guess} </answer>"))
        return ep


def _garble(expr: str, rng: random.Random) -> str:
    i = rng.randrange(len(expr))
    if expr[i].isdigit():
        return expr[:i] + str((int(expr[i]) + rng.randint(1, 9)) % 10) + expr[i + 1:]
    return expr


def _garble_number(s: str, rng: random.Random) -> str:
    digits = [i for i, c in enumerate(s) if c.isdigit()]
    i = rng.choice(digits)
    return s[:i] + str((int(s[i]) + rng.randint(1, 9)) % 10) + s[i + 1:]
