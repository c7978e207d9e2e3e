"""The CacheView protocol with ragged rows (what a rollout engine's pools provide) gives the same logits as
extending each row on its own."""
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM, K3State


class RaggedView:
    """Rows with different past lengths, MLA keys right-padded; written back per row after the step."""

    def __init__(self, states: list[K3State]):
        self.states = states
        self.new_mla: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.new_kda: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def mla(self, layer, c_kv, k_pe):
        B, T, _ = c_kv.shape
        past = torch.tensor([s.seq_len for s in self.states])
        S = int(past.max()) + T
        C = c_kv.new_zeros(B, S, c_kv.shape[-1]); P = k_pe.new_zeros(B, S, k_pe.shape[-1])
        for b, s in enumerate(self.states):
            L = s.seq_len
            C[b, :L], P[b, :L] = s.layers[layer].c_kv[0], s.layers[layer].k_pe[0]
            C[b, L:L + T], P[b, L:L + T] = c_kv[b], k_pe[b]
        self.new_mla[layer] = (c_kv, k_pe)
        return C, P, past

    def kda(self, layer):
        return (torch.cat([s.layers[layer].recurrent for s in self.states]),
                torch.cat([s.layers[layer].conv for s in self.states]))

    def set_kda(self, layer, recurrent, conv):
        self.new_kda[layer] = (recurrent, conv)


def test_ragged_cache_view_matches_per_row_extend():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    V = model.config.vocab_size
    prompts = [torch.randint(0, V, (1, n)) for n in (5, 23, 70)]
    with torch.no_grad():
        states = [model.extend(p)[1] for p in prompts]
        step = torch.randint(0, V, (3, 2))
        ref = torch.cat([model.extend(step[b:b + 1], states[b])[0] for b in range(3)])
        view = RaggedView(states)
        out = model(step, view)
    assert out.state is None
    assert (out.logits - ref).abs().max() < 1e-5
    assert set(view.new_kda) == {i for i in range(8) if model.config.is_kda_layer(i)}
    assert set(view.new_mla) == {i for i in range(8) if not model.config.is_kda_layer(i)}
