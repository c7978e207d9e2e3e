"""k3_kernels in SGLang's KDA layouts (`k3_sglang.kda_layouts`: what `--linear-attn-backend k3` runs) against the
project's plain-torch spec (`k3_kernels.kda.naive`), per request, with no SGLang import: this file also runs on the
GPU machine, where SGLang cannot be installed (the kit-driven tests beside it cover the SGLang path on CPU).

Cases follow the kit's shapes (its 10 cases' prefix / extend lengths and page-crossing lengths, HV = 2, K = V =
32, fp32 state pool, shuffled pool slots) plus K3's lower-bound gate, a GQA head ratio and, on the GPU, K3's head
dims (128) in bf16.
"""
import os

import pytest
import torch

from k3_kernels.kda.naive import l2norm, naive_kda_gate, naive_kda_lowerbound_gate, naive_recurrent_kda
from k3_sglang import kda_layouts, spec

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (prefix lens, extend lens) of the kit's extend cases; decode: prefix lens only
EXTEND_CASES = [((2, 4), (3, 1)), ((0,), (16,)), ((0, 0, 0), (15, 16, 17)), ((16,), (2,)), ((8,), (8,)),
                ((15,), (2,)), ((0, 8, 16), (15, 8, 1)), ((31,), (2,)), ((5,), (70,))]


def _skip_cpu_without_interpreter(device):
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs the Triton kernels only under TRITON_INTERPRET=1")


class Layer:
    def __init__(self, device, H=2, HV=2, K=32, V=32, lower_bound=None, dtype=torch.float32, seed=0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
        self.H, self.HV, self.K, self.V, self.lb, self.dtype, self.device = H, HV, K, V, lower_bound, dtype, device
        self.A_log = (r(HV) * 0.1).to(device)
        self.dt_bias = (r(HV * K) * 0.1).to(device)
        self.r = r

    def inputs(self, T):
        r, d = self.r, self.device
        q, k = r(1, T, self.H, self.K), r(1, T, self.H, self.K)
        v = r(1, T, self.HV, self.V)
        a, b = r(T, self.HV * self.K), r(T, self.HV)
        return [x.to(d, self.dtype) for x in (q, k, v, a, b)]

    def pool(self, P):
        return (self.r(P, self.HV, self.V, self.K) * 0.1).to(self.device)

    def reference(self, q, k, v, a, b, state_vk):
        """One request: o [T, HV, V] and the final state [HV, V, K], by the spec."""
        raw = a.float().view(-1, self.HV, self.K)
        g = (naive_kda_gate(raw, self.A_log, self.dt_bias) if self.lb is None
             else naive_kda_lowerbound_gate(raw, self.A_log, self.dt_bias, self.lb))
        o, s = naive_recurrent_kda(l2norm(q.float()), l2norm(k.float()), v.float(), g[None],
                                   torch.sigmoid(b.float().view(1, -1, self.HV)),
                                   initial_state=state_vk.transpose(-1, -2)[None].float(), output_final_state=True)
        return o[0], s[0].transpose(-1, -2)


def _tol(layer):
    return dict(atol=2e-5, rtol=2e-5) if layer.dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)


def _layers(device):
    out = [dict(), dict(lower_bound=-5.0), dict(H=1, HV=2)]
    if device == "cuda":
        out += [dict(H=4, HV=4, K=128, V=128, lower_bound=-5.0, dtype=torch.bfloat16)]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefix,lens", EXTEND_CASES)
def test_extend_matches_the_spec_per_request(device, prefix, lens):
    _skip_cpu_without_interpreter(device)
    for kw in _layers(device):
        layer = Layer(device, **kw)
        T = sum(lens)
        q, k, v, a, b = layer.inputs(T)
        pool = layer.pool(8)
        slots = torch.randperm(8)[: len(lens)].to(device)
        if not any(prefix):
            pool[slots] = 0
        before = pool.clone()
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)
        o = kda_layouts.extend(q, k, v, a.view(1, T, layer.HV, layer.K), b.view(1, T, layer.HV), ssm_states=pool,
                               cache_indices=slots, query_start_loc=cu, A_log=layer.A_log, dt_bias=layer.dt_bias,
                               lower_bound=layer.lb)
        for i, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            want_o, want_s = layer.reference(q[:, s0:s1], k[:, s0:s1], v[:, s0:s1], a[s0:s1], b[s0:s1],
                                             before[slots[i]])
            torch.testing.assert_close(o[0, s0:s1].float(), want_o, **_tol(layer))
            torch.testing.assert_close(pool[slots[i]], want_s, **_tol(layer))
        untouched = torch.ones(8, dtype=torch.bool)
        untouched[slots.cpu()] = False
        assert torch.equal(pool[untouched.to(device)], before[untouched.to(device)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [1, 3])
def test_decode_matches_the_spec_and_updates_only_its_slots(device, batch):
    _skip_cpu_without_interpreter(device)
    for kw in _layers(device):
        layer = Layer(device, **kw)
        q, k, v, a, b = layer.inputs(batch)
        pool = layer.pool(6)
        slots = torch.randperm(6)[:batch].to(device)
        before = pool.clone()
        o = kda_layouts.decode(q, k, v, a, b, A_log=layer.A_log, dt_bias=layer.dt_bias, ssm_states=pool,
                               cache_indices=slots, query_start_loc=torch.arange(batch + 1, device=device),
                               lower_bound=layer.lb)
        for i in range(batch):
            want_o, want_s = layer.reference(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], a[i:i + 1], b[i:i + 1],
                                             before[slots[i]])
            torch.testing.assert_close(o[0, i].float(), want_o[0], **_tol(layer))
            torch.testing.assert_close(pool[slots[i]], want_s, **_tol(layer))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_verify_writes_each_draft_state_from_its_parent(device, tree):
    _skip_cpu_without_interpreter(device)
    D, B = 4, 2
    parents = [-1, 0, 0, 1] if tree else [-1, 0, 1, 2]
    for kw in _layers(device):
        layer = Layer(device, **kw)
        q, k, v, a, b = layer.inputs(B * D)
        pool = layer.pool(5)
        slots = torch.tensor([3, 1], device=device)
        before = pool.clone()
        buf = torch.zeros(5, D, layer.HV, layer.V, layer.K, device=device)
        rpt = torch.tensor([parents] * B, device=device) if tree else None
        o = kda_layouts.target_verify(layer.A_log, layer.dt_bias, q, k, v, a, b, ssm_states=pool,
                                      cache_indices=slots, intermediate_states_buffer=buf,
                                      intermediate_state_indices=torch.tensor([2, 0], device=device),
                                      cache_steps=D, retrieve_parent_token=rpt, lower_bound=layer.lb)
        assert torch.equal(pool, before)
        for i, row in enumerate((2, 0)):
            for t in range(D):
                j = i * D + t
                start = before[slots[i]] if parents[t] < 0 else buf[row, parents[t]]
                want_o, want_s = layer.reference(q[:, j:j + 1], k[:, j:j + 1], v[:, j:j + 1], a[j:j + 1],
                                                 b[j:j + 1], start)
                torch.testing.assert_close(o[0, j].float(), want_o[0], **_tol(layer))
                torch.testing.assert_close(buf[row, t], want_s, **_tol(layer))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_replay_verify_and_commit_equal_the_per_draft_states(device, tree):
    """ReplaySSM (K3_REPLAY): outputs from inputs only, then the accepted path folded into the committed state,
    against the per-draft states `target_verify` writes (what SGLang's default commit would copy)."""
    _skip_cpu_without_interpreter(device)
    D, B = 4, 2
    parents = [-1, 0, 0, 1] if tree else [-1, 0, 1, 2]
    accepted = torch.tensor([3, 2] if tree else [3, 1], device=device)
    for kw in _layers(device):
        layer = Layer(device, **kw)
        q, k, v, a, b = layer.inputs(B * D)
        pool = layer.pool(4)
        slots = torch.tensor([2, 0], device=device)
        buf = torch.zeros(B, D, layer.HV, layer.V, layer.K, device=device)
        rpt = torch.tensor([parents] * B, device=device) if tree else None
        want_o = kda_layouts.target_verify(layer.A_log, layer.dt_bias, q, k, v, a, b, ssm_states=pool,
                                           cache_indices=slots, intermediate_states_buffer=buf,
                                           intermediate_state_indices=torch.arange(B, device=device), cache_steps=D,
                                           retrieve_parent_token=rpt, lower_bound=layer.lb)
        o = spec.replay_verify(A_log=layer.A_log, dt_bias=layer.dt_bias, q=q, k=k, v=v, a=a, b=b, ssm_states=pool,
                               cache_indices=slots, layer_key=-1, cache_steps=D, retrieve_parent_token=rpt,
                               lower_bound=layer.lb)
        inputs = spec.pending_layers()[-1]
        spec._pending.clear()
        torch.testing.assert_close(o.float(), want_o.float(), **_tol(layer))
        committed = pool.index_select(0, slots)
        spec.commit_layer(pool, committed, slots, accepted, inputs)
        for i in range(B):
            torch.testing.assert_close(pool[slots[i]], buf[i, int(accepted[i])], **_tol(layer))
