import random

import pytest

from k3.envs import CalcError, CalcTokenizer, CalculatorEnv, evaluate, heldout_tasks, train_tasks


@pytest.mark.parametrize("expr, value", [("2+3*4", 14), ("(2+3)*4", 20), ("-7+2", -5), ("84/4", 21),
                                         ("99*99-98", 9703), ("((1))", 1), ("2*-3", -6)])
def test_evaluate(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("expr, why", [
    ("", "empty"), ("2+", "expected a number"), ("(2+3", "missing"), ("2+3)", "unexpected"),
    ("__import__('os')", "grammar"), ("1/0", "division by zero"), ("7/2", "inexact"),
    ("9" * 14, "too long"), ("999999*999999*999999", "magnitude"), ("(" * 20 + "1" + ")" * 20, "nested"),
    ("1+" * 40 + "1", "longer than"),
])
def test_sandbox_refuses(expr, why):
    with pytest.raises(CalcError, match=why):
        evaluate(expr)


def test_tokenizer_roundtrip():
    tok = CalcTokenizer()
    for text in ["Q: 37*52+18 =", "<call> 37*52+18 </call>", "<result> -1942 </result>", "<answer> 5 </answer>"]:
        assert tok.decode(tok.encode(text)) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    with pytest.raises(ValueError, match="no token"):
        tok.encode("x")


def test_splits_are_fixed_and_disjoint():
    held = heldout_tasks()
    assert len(held) == 50 and held == heldout_tasks()
    train = train_tasks(3, 500)
    assert train == train_tasks(3, 500)
    assert not {t.expression for t in held} & {t.expression for t in train}


def _play(env, task, turns):
    ep = env.start(task)
    for text in turns:
        env.step(ep, env.tok.encode(text))
        if ep.done:
            break
    return ep


def test_rubric():
    env = CalculatorEnv()
    task = heldout_tasks()[0]
    a = str(task.answer)
    perfect = _play(env, task, [f"<call> {task.expression} </call>", f"<answer> {a} </answer>"])
    assert env.reward(perfect) == pytest.approx(1.0)
    assert perfect.tokens[-len(env.tok.encode(f'<answer> {a} </answer>')):] == env.tok.encode(f"<answer> {a} </answer>")
    guessed_right = _play(env, task, [f"<answer> {a} </answer>"])
    assert env.reward(guessed_right) == pytest.approx(1.0)
    wrong = _play(env, task, [f"<answer> {int(a) + 1} </answer>"])
    assert env.reward(wrong) == pytest.approx(0.2)
    wasted = _play(env, task, ["<call> 1+1 </call>", f"<call> {task.expression} </call>", f"<answer> {a} </answer>"])
    assert wasted.done and env.reward(wasted) == pytest.approx(0.9)  # correct and well-formed, one call too many
    endless = _play(env, task, ["<call> 1+1 </call>"] * 3)
    assert endless.done and endless.answer is None and env.reward(endless) == 0.0  # MAX_TURNS reached
    failed = _play(env, task, ["<call> 1/0 </call>", f"<answer> {a} </answer>"])
    assert env.reward(failed) == pytest.approx(0.8)  # correct, but a failing call: not well-formed
    outside = env.start(task)
    env.step(outside, [len(env.tok) + 5])
    assert outside.done and outside.malformed and env.reward(outside) == 0.0
    malformed = _play(env, task, ["<call> </call>"])
    assert malformed.malformed and env.reward(malformed) == 0.0
    # tool output is not the model's: masked out
    assert sum(perfect.model_mask) == len(env.tok.encode(f"<call> {task.expression} </call>")) + \
        len(env.tok.encode(f"<answer> {a} </answer>"))


def test_demonstrations_mix_good_and_bad():
    env = CalculatorEnv()
    rng = random.Random(0)
    rewards = [env.reward(env.demonstration(t, rng)) for t in train_tasks(0, 400)]
    assert all(0.0 <= r <= 1.0 for r in rewards)
    mean = sum(rewards) / len(rewards)
    assert 0.2 < mean < 0.6, mean
    assert max(rewards) == 1.0 and min(rewards) < 0.5
