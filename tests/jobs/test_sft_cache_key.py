"""The SFT base's cache key covers the code that trains it, not only the config. A checkout's `.cache/k3` once
held a base trained by an earlier commit under the same key: its weights differed from the current code's (371
of 380 tensors), so that checkout's main job started from another policy than a fresh clone's, silently."""
from pathlib import Path

import k3.jobs.sft as sft
from k3.jobs.config import load_config


def test_same_config_and_code_same_key_other_code_other_key(monkeypatch):
    cfg = load_config(None, {})
    assert sft.sft_key(cfg) == sft.sft_key(load_config(None, {}))
    assert sft.sft_key(cfg) != sft.sft_key(load_config(None, {"sft.steps": cfg.sft.steps + 1}))
    before = sft.sft_key(cfg)
    monkeypatch.setattr(sft, "sft_code_digest", lambda: "0" * 64)
    assert sft.sft_key(cfg) != before


def test_digest_follows_the_model_ops_data_and_loop_sources_only(monkeypatch):
    """Editing a source that shapes the base's bits (ops, the KDA reference, the demonstrations, this loop) changes
    the digest; editing one that does not (the serverless service) leaves it, so its edits keep the cache."""
    base = sft.sft_code_digest()
    read = Path.read_bytes

    def edited(target: str):
        def read_bytes(self):
            data = read(self)
            return data + b"\n# edited\n" if self.as_posix().endswith(target) else data
        return read_bytes

    for target in ("k3/model/ops.py", "kda/naive.py", "k3/envs/calculator.py", "k3/jobs/sft.py", "k3/config.py"):
        monkeypatch.setattr(Path, "read_bytes", edited(target))
        assert sft.sft_code_digest() != base, target
    monkeypatch.setattr(Path, "read_bytes", edited("k3/serverless/service.py"))
    assert sft.sft_code_digest() == base
