"""`k3 rl --serverless URL`: the calculator GSPO loop through the service, 2 updates, via the CLI."""
import json

import pytest

from k3.cli import main
from k3.serverless.server import ServerThread

from _serverless_helpers import tiny_config

SETTINGS = ["rollout.tasks_per_update=2", "rollout.group_size=3", "rollout.max_turn_tokens=8", "eval.heldout=2",
            "eval.samples=1", "eval.every=2", "rl.lora_rank=4"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("job"), max_seq_len=512, max_data=4, max_sample_tokens=16)
    st = ServerThread(cfg)
    with st as url:
        yield url, st.service


def test_rl_serverless_runs_two_gspo_updates(server, tmp_path):
    url, service = server
    args = ["rl", "--serverless", url, "--updates", "2", "--out", str(tmp_path)]
    for s in SETTINGS:
        args += ["--set", s]
    assert main(args) == 0
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2] and [r["step"] for r in rows] == [1, 2]
    assert all(r["samples"] == 6 and r["trained_tokens"] > 0 for r in rows)
    assert all(0.0 <= r["reward"] <= 1.0 for r in rows) and "heldout_reward" in rows[-1]
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert summary["updates"] == 2
    sid = summary["session_id"]
    assert service.sessions[sid].step == 2
    # 6 episodes per update in chunks of max_data = 4: two forward_backward calls, one optimizer step each
    assert service.stats["trained_rows"] >= 12
    assert service.stats["replayed_rows"] >= 12       # rl.router_replay (default on): the data carry the routing


def test_rl_serverless_bad_url_is_one_line(tmp_path, capsys):
    assert main(["rl", "--serverless", "http://127.0.0.1:9", "--updates", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--serverless http://127.0.0.1:9: cannot reach the service" in err[0]


def test_serve_bad_setting_is_one_line_before_start(tmp_path, capsys):
    assert main(["serve", "--port", "70000", "--data-dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("k3 serve: bad config: port")
    cfg = tmp_path / "serve.toml"
    cfg.write_text('max_rank = 4\nmystery = 1\n')
    assert main(["serve", "--config", str(cfg)]) == 2
    assert "mystery: unknown setting" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()          # nothing was created
