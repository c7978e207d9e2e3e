"""Shared by the engine tests: token draws, the small engine settings, a branching multi-turn workload, a bitwise
comparison of completions and a tiny model serving LoRA adapters."""
import torch

from k3.rollout import Engine, SamplingParams

# small chunks, checkpoints and pages so that short prompts cross every boundary the engine has
SMALL = dict(chunk_size=16, checkpoint_interval=32, page_size=8, decode_batch=4, max_step_tokens=48)
# pools so small that spills to the host tier, restores and evictions happen all the time
TINY_POOLS = dict(device_pages=22, host_pages=40, device_states=6, host_states=2)


def rand_tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def workload(engine: Engine, greedy: bool, adapter_id: str | None = None) -> list:
    """Two tasks sharing a system prompt, 2 samples each, two more turns with tool outputs, one branch."""
    system = rand_tokens(40, 1)
    prompts = [system + rand_tokens(9, 2), system + rand_tokens(21, 3)]
    sp = SamplingParams(temperature=0.0 if greedy else 1.0, seed=11, max_tokens=6, n=2, stop_token_ids=(7,),
                        adapter_id=adapter_id)
    out = engine.generate(prompts, sp)
    turn2 = [c.extend(rand_tokens(5 + i, 10 + i)) for i, c in enumerate(out)]
    sp2 = SamplingParams(temperature=0.0 if greedy else 0.8, top_k=40, top_p=0.9, seed=5, max_tokens=5,
                         adapter_id=adapter_id)
    out2 = engine.generate(turn2, sp2)
    branch = [out2[0].extend(rand_tokens(3, 20)), out2[0].extend(rand_tokens(4, 21)), turn2[1]]
    out3 = engine.generate(branch, SamplingParams(temperature=1.0, seed=9, max_tokens=4, adapter_id=adapter_id))
    return out + out2 + out3


def same(a, b) -> bool:
    """Bitwise-equal completions: tokens, both log-prob lists and the routing."""
    return len(a) == len(b) and all(
        x.token_ids == y.token_ids and x.logprobs == y.logprobs and x.sampling_logprobs == y.sampling_logprobs
        and torch.equal(x.routed_experts, y.routed_experts) for x, y in zip(a, b))


def flat_conversations(engine: Engine, conversations: int = 3, turns: int = 3, system_len: int = 40,
                       max_tokens: int = 6) -> list[list]:
    """Multi-turn chats sharing a system prompt, re-sent each turn as ONE flat token list (history + the new user
    tokens), as OpenAI-style clients do; greedy. Returns the completions of each turn."""
    system = rand_tokens(system_len, 1)
    history = [system + rand_tokens(7 + i, 100 + i) for i in range(conversations)]
    turns_out = []
    for t in range(turns):
        comps = engine.generate(history, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        turns_out.append(comps)
        history = [h + c.token_ids + rand_tokens(5 + i, 200 + 10 * t + i)
                   for i, (h, c) in enumerate(zip(history, comps))]
    return turns_out


def lora_served(adapters: dict, device: str = "cpu"):
    """(the tiny preset seeded 0 on `device`, eval; its LoRAManager with `adapters` {name: LoRAConfig} created with
    seeds 1, 2, ... in order). The caller closes the manager."""
    from k3.config import K3Config
    from k3.lora import LoRAManager
    from k3.model import K3ForCausalLM
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).to(device).eval()
    lora = LoRAManager(model)
    for seed, (name, cfg) in enumerate(adapters.items(), start=1):
        lora.create(name, cfg, seed=seed)
    return model, lora

