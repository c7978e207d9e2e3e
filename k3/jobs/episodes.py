"""Drive multi-turn calculator episodes through a rollout engine.

Each turn is one `engine.generate` call whose prompt is the whole transcript so far: the engine's prefix cache
serves the history (a state checkpoint at every turn end), so resuming after a tool call recomputes nothing.
The first turn of a group is one request with n = G samples sharing the prompt."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3.envs import CalculatorEnv, Episode, Task
from k3.rollout import Completion, Prompt, SamplingParams


@dataclass
class Rollout:
    """An episode plus what the learner needs, aligned with `episode.tokens`: the engine's log-prob of each model
    token (0.0 elsewhere) and, for a model token at position p, the routing of position p - 1 (whose logits
    produced it; None elsewhere)."""
    episode: Episode
    group: int
    logprobs: list[float] = field(default_factory=list)
    routed: list[torch.Tensor | None] = field(default_factory=list)
    reward: float = 0.0
    last: Completion | None = None


def run_episodes(engine, env: CalculatorEnv, tasks: list[Task], group_size: int, *, temperature: float,
                 top_p: float, top_k: int, max_turn_tokens: int, seed: int, adapter_id: str | None = None
                 ) -> list[Rollout]:
    """G samples of every task, all turns; rewards filled in. Deterministic given `seed`."""
    rollouts = []
    for gi, task in enumerate(tasks):
        for _ in range(group_size):
            ep = env.start(task)
            rollouts.append(Rollout(ep, gi, [0.0] * len(ep.tokens), [None] * len(ep.tokens)))

    def params(n: int, req_seed: int) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_turn_tokens,
                              stop_token_ids=tuple(env.stop_ids), n=n, seed=req_seed, adapter_id=adapter_id)

    # turn 0: one request per task with n = G samples sharing the prompt; the system prompt is its own prefill
    # span, so the engine keeps a state exactly at its end that every task's prompt resumes from
    S = len(env.system)
    prompts = [Prompt(rollouts[gi * group_size].episode.tokens, [(S, "prefill"), (len(rollouts[gi * group_size]
                                                                                      .episode.tokens) - S, "prefill")])
               for gi in range(len(tasks))]
    reqs = [params(group_size, _seed(seed, gi, 0)) for gi in range(len(tasks))]
    # the first task alone, then the rest: after a weight update the cache is empty, and requests admitted
    # together could not share the system prompt's state that the first one leaves behind
    comps = engine.generate(prompts[:1], reqs[:1])
    if len(prompts) > 1:
        comps += engine.generate(prompts[1:], reqs[1:])
    active = list(range(len(rollouts)))
    turn = 0
    while True:
        next_active = []
        for i, comp in zip(active, comps):
            r = rollouts[i]
            gen = list(comp.token_ids)
            start = len(r.episode.tokens)
            tool = env.step(r.episode, gen)
            r.logprobs += [float(x) for x in comp.logprobs] + [0.0] * len(tool)
            r.routed += [comp.routed_experts[j] for j in range(len(gen))] + [None] * len(tool)
            assert len(r.logprobs) == len(r.episode.tokens) == start + len(gen) + len(tool)
            r.last = comp
            if not r.episode.done:
                next_active.append(i)
        active = next_active
        turn += 1
        if not active:
            break
        # later turns: continue each episode after its tool output (the history comes from the prefix cache)
        prompts = [rollouts[i].last.extend(rollouts[i].episode.tokens[len(rollouts[i].last.prompt)
                                                                       + len(rollouts[i].last.token_ids):])
                   for i in active]
        comps = engine.generate(prompts, [params(1, _seed(seed, i, turn)) for i in active])
    for r in rollouts:
        r.reward = env.reward(r.episode)
        r.last = None
    return rollouts


def _seed(base: int, index: int, turn: int) -> int:
    return (base * 1_000_003 + index * 101 + turn) % (2 ** 63)
