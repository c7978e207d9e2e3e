"""Durability: `k3 serve` killed (SIGKILL) and started again on the same data dir: every session resumes (step,
adapter, AdamW moments, saved states, sampler snapshots) and its next step is bitwise equal to an uninterrupted
run of the same session; a gradient that was pending at the kill is gone (never half applied)."""
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors

from k3.serverless import AdamParams, ModelInput, SamplingParams, ServiceClient, ServiceError

from _serverless_helpers import free_port, rand_datum

ADAM = AdamParams(learning_rate=5e-3, weight_decay=0.01)
SESSIONS = [(4, 31, "cross_entropy"), (16, 32, "gspo")]


def _start(cfg_path, port):
    env = {**os.environ, "K3_CPU_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", "--config", str(cfg_path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    t0 = time.time()
    while time.time() - t0 < 120:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/info", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def _data(i, loss_fn):
    return [rand_datum(500 + 10 * i + j, loss_fn=loss_fn) for j in range(3)]


def _step(tc, data, loss_fn):
    tc.forward_backward(data, loss_fn)
    tc.optim_step(ADAM)


def _weights(tc):
    return load_safetensors(tc.download_weights())


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("restart")
    port = free_port()
    path = root / "serve.toml"
    path.write_text(f'port = {port}\ndata_dir = "{root / "data"}"\nmax_seq_len = 96\nmax_data = 8\n'
                    f'max_sample_tokens = 8\n')
    return path, port, root / "data"


def test_kill_and_restart_resumes_every_session_bitwise(config):
    path, port, data_dir = config
    url = f"http://127.0.0.1:{port}"
    proc = _start(path, port)
    try:
        client = ServiceClient(url)
        clients, samples = [], []
        for i, (rank, seed, loss) in enumerate(SESSIONS):
            tc = client.create_lora_training_client("k3-tiny", rank=rank, seed=seed)
            for _ in range(2):
                _step(tc, _data(i, loss), loss)
            tc.save_state("after2")
            sc = tc.save_weights_and_get_sampling_client("v2")
            samples.append((sc.sampler_id, sc.sample(ModelInput.from_ints([3, 4, 5]), 2,
                                                     SamplingParams(max_tokens=5, seed=1))))
            clients.append((tc.session_id, tc.api_key))
        # a gradient pending at the kill, and a step's file written but never committed
        pending = client.training_client(*clients[0])
        pending.forward_backward(_data(9, "cross_entropy"), "cross_entropy")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    orphan = data_dir / "sessions" / clients[1][0] / "step-3.safetensors.tmp"
    orphan.write_bytes(b"partial write")
    proc = _start(path, port)
    try:
        client = ServiceClient(url)
        for i, ((sid, key), (rank, seed, loss)) in enumerate(zip(clients, SESSIONS)):
            tc = client.training_client(sid, key)
            info = tc.get_info()
            assert info["step"] == 2 and info["pending"] == 0, info
            sampler_id, before = samples[i]
            sc = client.sampling_client(sampler_id, key)
            assert sc.sample(ModelInput.from_ints([3, 4, 5]), 2, SamplingParams(max_tokens=5, seed=1)) == before
            _step(tc, _data(i, loss), loss)
            resumed = _weights(tc)
            ref = client.create_lora_training_client("k3-tiny", rank=rank, seed=seed)
            for _ in range(3):
                _step(ref, _data(i, loss), loss)
            want = _weights(ref)
            assert resumed.keys() == want.keys()
            assert all(torch.equal(resumed[k], want[k]) for k in want), sid
            # the saved state survived too: loading it and stepping again repeats step 3 exactly
            assert tc.load_state("after2") == 2
            _step(tc, _data(i, loss), loss)
            again = _weights(tc)
            assert all(torch.equal(again[k], want[k]) for k in want)
        with pytest.raises(ServiceError) as e:   # keys still reach only their own session
            client.training_client(clients[0][0], clients[1][1])
        assert e.value.status == 403
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
