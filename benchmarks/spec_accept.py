"""Accept lengths (tokens per verify step, bonus included) of the drafters on the calculator's three kinds of turn,
CPU, the job's tiny SFT base and its cached trained drafter (`ensure_base`, `ensure_drafter`), greedy, the 50
held-out tasks, batched verify at decode batch 8:

- `direct`: the question's prompt (the SFT base answers without the tool: `<answer> 124 </answer>`);
- `call`: the prompt plus `<call>` (the tool branch: the model copies the question's expression into the call);
- `result`: that call, then the tool's `<result> N </result>` (the model copies N into its answer);
- `episodes_t1`: the main job's rollouts (k3.jobs.episodes.run_episodes: whole episodes, temperature 1, groups of
  4, 16 tasks) with MATCH acceptance (each position drawn as plain decoding draws it), as `k3 rl` speculates.

Methods: prompt lookup (`ngram`), the trained head alone (`lookup=0`), and the head with prompt lookup beside it
(`SpecConfig.lookup`, the default), as chains of 3 and 2x3 token trees. Every run is checked bitwise against plain
decoding. Writes benchmarks/results/spec_accept.json.

    python -m benchmarks.spec_accept
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks._results import RESULTS, run_header, write_results
from benchmarks.spec_decode import _same, episodes_driver
from k3.rollout import Engine, SamplingParams
from k3.rollout.spec import SpecConfig


def workloads(env, tasks, model, sp) -> dict[str, list[list[int]]]:
    direct = [env.prompt(t) for t in tasks]
    call = [p + [env.tok["<call>"]] for p in direct]
    calls = Engine(model, prefix_cache=False, decode_batch=8).generate(call, sp)
    result = [p + c.token_ids + env.tok.encode(f"<result> {t.answer} </result>")
              for p, c, t in zip(call, calls, tasks)]
    return {"direct": direct, "call": call, "result": result}


def main() -> None:
    from k3.envs import CalculatorEnv
    from k3.envs.calc_task import heldout_tasks
    from k3.jobs.config import load_config
    from k3.jobs.sft import ensure_base
    from k3.model import K3ForCausalLM
    from k3.rollout.spec.train_drafter import ensure_drafter
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(RESULTS / "spec_accept.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    res = run_header("spec_accept", "cpu")
    job = load_config(None, {})
    base, _ = ensure_base(job)
    drafter = str(ensure_drafter(job)[0])
    model = K3ForCausalLM.from_pretrained(base).eval()
    env = CalculatorEnv()
    tasks = heldout_tasks()
    sp = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=tuple(env.stop_ids))
    loads = workloads(env, tasks, model, sp)
    refs = {k: Engine(model, prefix_cache=False, decode_batch=8).generate(v, sp) for k, v in loads.items()}
    episodes = episodes_driver(env, tasks[:16], job.rollout.max_turn_tokens)
    refs["episodes_t1"] = episodes(Engine(model, prefix_cache=True, decode_batch=8))
    methods = {"ngram_chain_3": SpecConfig(draft_len=3, verify="batched")}
    for shape, branching in (("chain_3", 1), ("tree_2x3", 2)):
        for label, lookup in (("head_only", 0), ("head_with_lookup", SpecConfig.lookup)):
            methods[f"drafter_{label}_{shape}"] = SpecConfig(method="drafter", draft_len=3, branching=branching,
                                                             verify="batched", drafter_path=drafter, lookup=lookup)
    table = {}
    for name, spec in methods.items():
        row = {}
        for kind in refs:
            if kind == "episodes_t1":
                eng = Engine(model, prefix_cache=True, decode_batch=8,
                             speculative=dataclasses.replace(spec, acceptance="match"))
                out = episodes(eng)
            else:
                eng = Engine(model, prefix_cache=False, decode_batch=8, speculative=spec)
                out = eng.generate(loads[kind], sp)
            same = len(out) == len(refs[kind]) and _same(out, refs[kind])
            st = eng.stats
            row[kind] = {"accept_length": st["spec_emitted_tokens"] / max(st["spec_verifies"], 1),
                         "verifies": st["spec_verifies"], "decode_tokens": st["spec_emitted_tokens"],
                         "bitwise_equal_to_plain": same}
        table[name] = row
        print(f"{name:>34}  " + "  ".join(f"{k} {v['accept_length']:.3f}" for k, v in row.items()), flush=True)
    res.update(model="the job's tiny SFT base (k3.jobs.sft.ensure_base), its cached drafter (ensure_drafter)",
               workload=f"{len(tasks)} held-out calculator tasks, greedy, at most 16 new tokens, stop tokens; "
                        f"decode batch 8, batched verify",
               samples={k: env.tok.decode(refs[k][0].token_ids) for k in loads},
               episodes_sample=env.tok.decode(refs["episodes_t1"][0].token_ids[-24:]),
               accept_length=table, lookup_default=SpecConfig.lookup)
    print("wrote", write_results(a.out, res))


if __name__ == "__main__":
    main()
