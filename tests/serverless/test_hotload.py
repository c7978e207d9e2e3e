"""Sampler snapshots are hot-loaded: with room for 2 in the manager, 4 snapshots of 2 sessions sample exactly as
when each was fresh (LRU unload + reload from its file, cache entries of the id released), and the manager never
holds more than 2."""
import pytest

from k3.serverless import AdamParams, ModelInput, SamplingParams, ServiceClient
from k3.serverless.server import ServerThread

from _serverless_helpers import rand_datum, tiny_config

PROMPT = ModelInput.from_ints(list(range(40, 80)))
PARAMS = SamplingParams(max_tokens=5, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    st = ServerThread(tiny_config(tmp_path_factory.mktemp("hot"), max_loaded_samplers=2))
    with st as url:
        yield url, st.service


def test_unloaded_snapshots_reload_and_sample_the_same(server):
    url, service = server
    client = ServiceClient(url)
    first = {}
    for seed in (1, 2):
        tc = client.create_lora_training_client("k3-tiny", rank=4, seed=seed)
        for step in range(2):
            tc.forward_backward([rand_datum(seed * 10 + step)], "cross_entropy")
            tc.optim_step(AdamParams(learning_rate=5e-2))
            sc = tc.save_weights_and_get_sampling_client(f"v{step}")
            first[sc.sampler_id] = (sc, sc.sample(PROMPT, 2, PARAMS))
    samplers = lambda: [n for n in service.manager.adapters if n in service.samplers]  # noqa: E731
    assert len(samplers()) == 2 and len(first) == 4
    assert len({str(r) for _, r in first.values()}) == 4          # four different snapshots
    for _ in range(2):
        for sid, (sc, want) in first.items():
            assert sc.sample(PROMPT, 2, PARAMS) == want, sid
            assert len(samplers()) <= 2
    client.close()
