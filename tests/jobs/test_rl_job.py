"""A shortened `k3 rl` run: the loop's invariants, not its learning (that is `make demo`'s job)."""
import json
import math

import pytest
import torch

from k3.jobs.config import load_config
from k3.jobs.rl import RLJob
from k3.sync import states_equal


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("rl")
    cfg = load_config("examples/calculator_gspo.toml", {
        "sft.steps": 2, "sft.batch_size": 4, "sft.cache_dir": str(root / "cache"), "updates": 2, "eval.every": 1,
        "eval.heldout": 2, "rollout.tasks_per_update": 2, "rollout.group_size": 2, "rollout.max_turn_tokens": 6})
    return RLJob(cfg, root / "out", progress=False)


def test_short_run_invariants(job):
    versions = []
    original_sync = job.sync

    def checked_sync(version):
        out = original_sync(version)
        # the engine's weights are the learner's, bit for bit, and the cache only holds the new version's entries
        assert states_equal(job._serving_state(), job._published())
        assert all(scope[1] == version for scope in job.engine.tree.roots)
        versions.append(version)
        return out

    job.sync = checked_sync
    summary = job.run(2)
    assert versions == [1, 2]
    rows = [json.loads(line) for line in (job.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("update", "reward", "heldout_reward", "kl_k3", "cache_hit_rate", "delta_bytes", "full_bytes"):
            assert k in r and math.isfinite(r[k]), k
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["heldout_reward"] <= 1.0
        assert 0.0 <= r["cache_hit_rate"] <= 1.0
        assert r["kl_k3"] < 1e-3                     # rollout and trainer agree (same weights, exact sync)
        assert 0 < r["delta_bytes"] < r["full_bytes"] + 4096
        assert 0.0 <= r["tool_rate"] <= 1.0 and 0.0 <= r["heldout_tool_rate"] <= 1.0
    saved = json.loads((job.out / "summary.json").read_text())
    assert saved["summary"]["updates"] == 2 == summary["updates"]
    assert (job.out / "rl.png").stat().st_size > 1000
    # a second run reuses the cached SFT base
    assert job.sft_trained


def test_sft_base_is_cached(job):
    from k3.jobs.sft import ensure_base
    path, trained = ensure_base(job.cfg, progress=False)
    assert not trained and (path / "model.safetensors").exists()


def test_same_config_same_metrics(job):
    """A second job of the same config (cached base) reproduces every metric but the wall time, payload sizes
    included (the sync chain id comes from the config)."""
    if not (job.out / "metrics.jsonl").exists():  # selected alone: the first job has not run yet
        job.run(2)
    other = RLJob(job.cfg, job.out.parent / "out2", progress=False)
    assert not other.sft_trained and other.publisher.chain == job.publisher.chain
    other.run(2)

    def rows(d):
        return [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
                for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert rows(other.out) == rows(job.out)
