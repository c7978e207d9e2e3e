import pytest

from k3.jobs.config import JobConfigError, load_config


def test_example_config_loads():
    cfg = load_config("examples/calculator_gspo.toml")
    assert cfg.updates == 20 and cfg.rl.mode == "lora" and cfg.rollout.group_size == 8


@pytest.mark.parametrize("overrides, field", [
    ({"rl.lrr": 1.0}, "rl.lrr"), ({"rl.mode": "half"}, "rl.mode"), ({"rollout.group_size": 1}, "rollout.group_size"),
    ({"rollout.top_p": 0.0}, "rollout.top_p"), ({"sft.steps": "many"}, "sft.steps"), ({"model.preset": "huge"},
    "model.preset"), ({"eval.heldout": 51}, "eval.heldout"), ({"nosection.x": 1}, "nosection"),
    ({"sft.p_copy": 1.5}, "sft.p_copy"), ({"rl.micro_batch_size": 0}, "rl.micro_batch_size"),
])
def test_bad_fields_are_named(overrides, field):
    with pytest.raises(JobConfigError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


def test_bad_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("updates = [")
    with pytest.raises(JobConfigError, match="not valid TOML"):
        load_config(p)
    with pytest.raises(JobConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
