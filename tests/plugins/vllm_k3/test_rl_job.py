"""`k3 rl --set rollout.backend=vllm`, shortened: the GSPO loop (LoRA, Router Replay) with a vLLM engine doing the
rollouts, 2 updates. The engine gets the SFT base from disk and the adapter only as k3.sync payloads; the job checks
the served adapter's digest after every sync. Runs in .venv-vllm (`make test-vllm`)."""
from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("vllm")

from k3.jobs.config import JobConfigError, load_config  # noqa: E402
from k3.jobs.rl import RLJob  # noqa: E402
from k3.rollout.backend import state_digest  # noqa: E402

SHORT = {"sft.steps": 2, "sft.batch_size": 4, "updates": 2, "eval.every": 1, "eval.heldout": 2,
         "rollout.tasks_per_update": 2, "rollout.group_size": 2, "rollout.max_turn_tokens": 6,
         "rollout.backend": "vllm"}


def test_rl_job_runs_two_updates_on_vllm_rollouts(tmp_path):
    torch.set_num_threads(1)
    cfg = load_config("examples/calculator_gspo.toml", {**SHORT, "sft.cache_dir": str(tmp_path / "cache")})
    job = RLJob(cfg, tmp_path / "out", progress=False)
    try:
        assert type(job.engine).__name__ == "VllmRollout"
        digests = []
        original_sync = job.sync

        def checked_sync(version):
            out = original_sync(version)   # raises unless the engine's adapter digest is the published one
            assert job.backend.version == version
            digests.append(job.backend.weights_digest())
            assert digests[-1] == state_digest(job._published())
            return out

        job.sync = checked_sync
        summary = job.run(2)
        _check_seeded_sampling(job.backend)
    finally:
        job.close()
    assert len(digests) == 2
    rows = [json.loads(line) for line in (job.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2]
    for r in rows:
        for k in ("reward", "heldout_reward", "kl_k3", "max_abs_dlogp", "cache_hit_rate", "delta_bytes"):
            assert k in r and math.isfinite(r[k]), k
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["heldout_reward"] <= 1.0
        assert r["kl_k3"] < 1e-3            # vLLM's rollout log-probs agree with the learner's (Router Replay on)
        assert 0 < r["delta_bytes"] < r["full_bytes"] + 4096
    print(f"vLLM rollouts: max |dlogp| per update {[r['max_abs_dlogp'] for r in rows]}, "
          f"kl_k3 {[r['kl_k3'] for r in rows]}")
    assert summary["updates"] == 2


def _check_seeded_sampling(backend):
    """Seeded samples are a function of the request (seed, sample index), not of the batch around it."""
    from k3.rollout import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 100, (n,), generator=g).tolist() for n in (5, 17, 40, 70)]
    sp = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=1234, max_tokens=6, n=2,
                        adapter_id=backend.adapter_id)
    a = backend.generate(prompts, sp)
    b = backend.generate(prompts[::-1], sp)
    b = [c for i in range(len(prompts) - 1, -1, -1) for c in b[2 * i:2 * i + 2]]
    alone = backend.generate(prompts[2:3], sp)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.token_ids for c in alone] == [c.token_ids for c in a[4:6]]
    other = backend.generate(prompts, SamplingParams(temperature=1.0, seed=99, max_tokens=6, n=2,
                                                     adapter_id=backend.adapter_id))
    assert [c.token_ids for c in other] != [c.token_ids for c in a]


def test_unknown_backend_is_a_config_error(tmp_path):
    with pytest.raises(JobConfigError, match="rollout.backend"):
        load_config("examples/calculator_gspo.toml", {**SHORT, "rollout.backend": "sglang-x",
                                                       "sft.cache_dir": str(tmp_path)})
