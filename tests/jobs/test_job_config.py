"""Job config checks: every bad value is refused by load_config (before any work), naming its `section.field`,
and `k3 sft` / `k3 rl` turn every config error into one line on stderr with exit code 2."""
import dataclasses
import math
import re
import types
from pathlib import Path

import pytest

from k3.envs import CalculatorEnv, heldout_tasks, train_tasks
from k3.envs.calc_task import MAX_TURNS
from k3.jobs.config import (ENGINE_FIELDS, JobConfig, JobConfigError, RLSection, _leaves, _RULES, engine_config,
                            load_config, max_episode_tokens)

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "calculator_gspo.toml"


def _named(field: str) -> str:
    """A pattern for an error message that starts with `field:`."""
    return "^" + re.escape(field) + ":"


def test_defaults_and_example_load():
    load_config()
    cfg = load_config(EXAMPLE)
    assert cfg.updates == 20 and cfg.rl.mode == "lora" and cfg.rollout.group_size == 8


@pytest.mark.parametrize("overrides, field", [
    ({"rl.lrr": 1.0}, "rl.lrr"), ({"rl.mode": "half"}, "rl.mode"), ({"rollout.group_size": 1}, "rollout.group_size"),
    ({"rollout.top_p": 0.0}, "rollout.top_p"), ({"sft.steps": "many"}, "sft.steps"), ({"model.preset": "huge"},
    "model.preset"), ({"eval.heldout": 51}, "eval.heldout"), ({"nosection.x": 1}, "nosection"),
    ({"sft.p_copy": 1.5}, "sft.p_copy"), ({"rl.micro_batch_size": 0}, "rl.micro_batch_size"),
    # found by a user: these passed load_config, some crashing only after the SFT base had loaded
    ({"rl.lr": math.nan}, "rl.lr"), ({"rl.lr": math.inf}, "rl.lr"), ({"sft.lr": math.nan}, "sft.lr"),
    ({"rl.lr": -1.0}, "rl.lr"), ({"sft.lr": 0.0}, "sft.lr"),
    ({"rl.eps_low": -1.0}, "rl.eps_low"), ({"rl.eps_low": 1.0}, "rl.eps_low"), ({"rl.eps_high": 0.0}, "rl.eps_high"),
    ({"rl.max_grad_norm": -1.0}, "rl.max_grad_norm"), ({"rl.lora_alpha": -16.0}, "rl.lora_alpha"),
    ({"rollout.checkpoint_every": 10}, "rollout.checkpoint_every"), ({"rollout.kv_pages": 1}, "rollout.kv_pages"),
    ({"rollout.state_slots": 8}, "rollout.state_slots"), ({"rl.kl_coef": -0.1}, "rl.kl_coef"),
    ({"rollout.temperature": 0.0}, "rollout.temperature"), ({"rl.train_seed": -1}, "rl.train_seed"),
    ({"model.seed": 2 ** 63}, "model.seed"), ({"sft.cache_dir": ""}, "sft.cache_dir"),
    ({"rl.router_replay": 1}, "rl.router_replay"), ({"updates": 0}, "updates"), ({"eval.samples": 0}, "eval.samples"),
    ({"sync.zstd_level": 23}, "sync.zstd_level"), ({"rollout.top_k": -1}, "rollout.top_k"),
    ({"rollout.cuda_graphs": "no"}, "rollout.cuda_graphs"),
    # the pools must hold a request of eval.samples samples too (evaluation is a request of that many)
    ({"eval.samples": 600}, "rollout.kv_pages"),
    # overrides that do not fit the schema: not a TypeError
    ({"rl.lr.x": 1}, "rl.lr.x"), ({"updates.x": 1}, "updates.x"), ({"rl": 1}, "rl"), ({"rl..lr": 1}, "rl..lr"),
])
def test_bad_fields_are_named(overrides, field):
    with pytest.raises(JobConfigError, match=_named(field)):
        load_config(None, overrides)


def test_every_field_has_a_rule():
    """A new field cannot be left unchecked: validate() looks its rule up by name."""
    assert set(_RULES) == {name for name, _, _ in _leaves(JobConfig())}


@pytest.mark.parametrize("name", [n for n, t, _ in _leaves(JobConfig()) if t is float])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_every_float_field_must_be_finite(name, value):
    with pytest.raises(JobConfigError, match=_named(name) + " must be finite"):
        load_config(None, {name: value})


def test_validate_checks_types_of_a_config_built_in_code():
    with pytest.raises(JobConfigError, match=_named("rl.lr")):
        JobConfig(rl=RLSection(lr="fast")).validate()
    with pytest.raises(JobConfigError, match=_named("rl.lora_rank")):
        JobConfig(rl=RLSection(lora_rank=True)).validate()
    JobConfig(rl=RLSection(lr=1)).validate()  # an int is a float value


def test_engine_config_is_built_from_the_job_fields():
    cfg = load_config(None, {"rollout.checkpoint_every": 128, "rollout.state_slots": 40, "rollout.kv_pages": 900,
                             "rollout.cuda_graphs": False})
    ec = engine_config(cfg)
    for engine_field, job_field in ENGINE_FIELDS.items():
        section, name = job_field.split(".")
        assert getattr(ec, engine_field) == getattr(getattr(cfg, section), name)


def test_episode_bound_holds_for_the_longest_episodes():
    """Every task's prompt and a worst-case episode (each turn max_turn_tokens long, each tool result as long as
    the calculator's magnitude limit allows) stay within max_episode_tokens."""
    env, T = CalculatorEnv(), 16
    result_free = max_episode_tokens(T) - MAX_TURNS * T
    for task in heldout_tasks() + train_tasks(0, 2000):
        assert len(env.prompt(task)) <= result_free
    ep = env.start(max(heldout_tasks(), key=lambda t: len(t.expression)))
    call = env.tok.encode("<call> -999999*999999 </call>")  # result -999998000001: 13 characters
    assert len(call) == T
    while not ep.done:
        env.step(ep, call)
    assert ep.turns == MAX_TURNS and len(ep.tokens) <= max_episode_tokens(T)


def test_smallest_accepted_pools_fit_the_engine():
    """At the smallest kv_pages / state_slots load_config accepts, the engine's own fit check accepts a request of
    group_size samples at the episode bound; one less of either is refused."""
    from k3.rollout import Engine, Prompt, SamplingParams

    G, T = 8, 16
    tokens = max_episode_tokens(T)
    base = {"rollout.group_size": G, "rollout.max_turn_tokens": T}
    pages = next(p for p in range(1, 10_000) if _accepts({**base, "rollout.kv_pages": p}))
    slots = next(s for s in range(1, 100) if _accepts({**base, "rollout.state_slots": s}))
    assert slots == G + 1
    cfg = load_config(None, {**base, "rollout.kv_pages": pages, "rollout.state_slots": slots})
    fake = types.SimpleNamespace(cfg=engine_config(cfg))
    fake._pages_for = lambda n: Engine._pages_for(fake, n)
    Engine._check_fits(fake, Prompt([0] * (tokens - T)), SamplingParams(max_tokens=T, n=G), "request")
    for smaller in ({"device_pages": pages - 1}, {"device_states": slots - 1}):
        tight = types.SimpleNamespace(cfg=dataclasses.replace(fake.cfg, **smaller))
        tight._pages_for = lambda n: Engine._pages_for(tight, n)
        with pytest.raises(ValueError):
            Engine._check_fits(tight, Prompt([0] * (tokens - T)), SamplingParams(max_tokens=T, n=G), "request")


def _accepts(overrides) -> bool:
    try:
        load_config(None, overrides)
        return True
    except JobConfigError:
        return False


def test_bad_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("updates = [")
    with pytest.raises(JobConfigError, match="^config: .* is not valid TOML"):
        load_config(p)
    with pytest.raises(JobConfigError, match="^config: .* does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(JobConfigError, match="^config: .* is not a file"):
        load_config(tmp_path)
    p.write_bytes(b"updates = \xff")
    with pytest.raises(JobConfigError, match="^config: .* is not valid TOML"):
        load_config(p)
    p.write_text("[rl]\nlr = 1.0\n")
    with pytest.raises(JobConfigError, match=_named("rl.lr.x")):  # a sub-field of a scalar the file set
        load_config(p, {"rl.lr.x": 1})


# ---------------------------------------------------------------------------------------------- k3 CLI
@pytest.fixture
def no_work(monkeypatch):
    """SFT and RL replaced by stand-ins that fail the test if a bad config ever reaches them."""
    import k3.jobs.rl
    import k3.jobs.sft

    def refuse(*args, **kwargs):
        raise AssertionError("the job started with a bad config")

    monkeypatch.setattr(k3.jobs.sft, "ensure_base", refuse)
    monkeypatch.setattr(k3.jobs.rl, "run_rl", refuse)


@pytest.mark.parametrize("argv, message", [
    (["rl", "--set", "rl.lr.x=1"], "k3 rl: bad config: rl.lr.x: rl.lr is a single float value, it has no sub-fields"),
    (["rl", "--set", "nosuchsection.x=1"], "k3 rl: bad config: nosuchsection: unknown field (known: eval, model, rl, "
                                           "rollout, sft, sync, updates)"),
    (["rl", "--set", "rl.lr"], "k3 rl: bad config: rl.lr: --set needs SECTION.FIELD=VALUE, got 'rl.lr'"),
    (["rl", "--set", "rl.lr=nan"], "k3 rl: bad config: rl.lr: must be finite, got nan"),
    (["sft", "--set", "sft.lr=nan"], "k3 sft: bad config: sft.lr: must be finite, got nan"),
    (["rl", "--set", "rollout.checkpoint_every=10"], "k3 rl: bad config: rollout.checkpoint_every: 10 must be a "
     "multiple of chunk_size 64 (checkpoints sit at segment ends) [engine checkpoint_interval]"),
    (["rl", "--updates", "0"], "k3 rl: bad config: updates: must be >= 1, got 0"),
])
def test_cli_bad_config_is_one_line(argv, message, capsys, no_work):
    from k3.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == message + "\n"


def test_cli_bad_files(tmp_path, capsys, no_work):
    from k3.cli import main

    missing = tmp_path / "missing.toml"
    assert main(["sft", "--config", str(missing)]) == 2
    assert capsys.readouterr().err == f"k3 sft: bad config: config: {missing} does not exist\n"
    bad = tmp_path / "bad.toml"
    bad.write_text("updates = [")
    assert main(["rl", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"k3 rl: bad config: config: {bad} is not valid TOML: ") and err.count("\n") == 1
    out_file = tmp_path / "out"
    out_file.write_text("")
    assert main(["rl", "--out", str(out_file)]) == 2
    assert capsys.readouterr().err == f"k3 rl: bad config: --out: {out_file} exists and is not a directory\n"


def test_cli_bad_thread_count(monkeypatch, capsys, no_work):
    from k3.cli import main

    monkeypatch.setenv("K3_CPU_THREADS", "many")
    assert main(["sft"]) == 2
    assert capsys.readouterr().err == "k3 sft: bad config: K3_CPU_THREADS: must be a positive integer, got 'many'\n"


def test_cli_good_config_reaches_the_job(monkeypatch, tmp_path):
    """The config the job gets is the checked one, file + --set + --updates."""
    import k3.cli
    import k3.jobs.rl

    seen = {}
    monkeypatch.setattr(k3.jobs.rl, "run_rl", lambda cfg, out: seen.update(cfg=cfg, out=out))
    monkeypatch.setattr(k3.cli, "_apply_cpu_threads", lambda n: seen.update(threads=n))
    monkeypatch.delenv("K3_CPU_THREADS", raising=False)
    rc = k3.cli.main(["rl", "--config", str(EXAMPLE), "--set", "rl.lr=1e-3", "--set", "rl.mode=full",
                      "--updates", "3", "--out", str(tmp_path / "run")])
    assert rc == 0 and seen["threads"] == 1 and seen["out"] == tmp_path / "run"
    assert (seen["cfg"].rl.lr, seen["cfg"].rl.mode, seen["cfg"].updates) == (1e-3, "full", 3)
