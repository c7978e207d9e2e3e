"""SFT rows: the decision to call the tool is trained only on the p_tool mixture, the tool's mechanics on more."""
import random

from k3.envs import CalculatorEnv, train_tasks
from k3.jobs.config import load_config
from k3.jobs.sft import demonstration_row


def _rows(**sft):
    cfg = load_config(None, {f"sft.{k}": v for k, v in sft.items()})
    env = CalculatorEnv()
    rng = random.Random(0)
    tasks = train_tasks(1, 64)
    return env, [demonstration_row(env, tasks, rng, cfg.sft) for _ in range(400)]


def test_mechanics_rows_leave_the_decision_out_of_the_loss():
    env, rows = _rows(p_copy=1.0, p_tool=0.0, p_slip=0.0)
    call = env.tok["<call>"]
    for ep in rows:
        p = len(env.prompt(ep.task))
        assert ep.tokens[p] == call and not ep.model_mask[p]      # the decision: not trained
        assert all(ep.model_mask[p + 1: p + 1 + len(env.tok.encode(ep.task.expression)) + 1])  # the call: trained
        assert ep.calls == [ep.task.expression] and ep.answer == str(ep.task.answer)


def test_trained_decisions_follow_p_tool():
    env, rows = _rows(p_copy=0.5, p_tool=0.2, p_slip=0.2)
    call = env.tok["<call>"]
    decided = [ep.tokens[len(env.prompt(ep.task))] for ep in rows if ep.model_mask[len(env.prompt(ep.task))]]
    share = sum(t == call for t in decided) / len(decided)
    assert 150 < len(decided) < 250 and 0.12 < share < 0.28
    assert sum(bool(ep.calls) for ep in rows) > 0.5 * len(rows)  # yet most rows demonstrate a call
