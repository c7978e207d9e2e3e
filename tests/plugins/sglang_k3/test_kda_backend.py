"""`--linear-attn-backend k3` through SGLang's real KDA stack: SGLang's own KDA kit
(`sglang/test/kits/attention_unittest/attention_methods/kda_attention.py`) builds the real `KDAAttnBackend`
(pools, conv, metadata) and checks it against its pure-torch reference; the backend name reaches our kernels
only through the plugin (entry point -> `load_plugins()` -> choices + the dispatcher hook).

CPU: our Triton kernels run under `TRITON_INTERPRET=1`, fp32 (the interpreter's dtype here); the kit's default
device is CUDA, so it is given device="cpu".
"""
import pytest
import torch

from _sglang_helpers import ContextOverride, kit_testcase, load_k3_plugins, rebind_triton_aliases, run_kda_verify

load_k3_plugins()

from sglang.srt.layers.attention.linear.kda_backend import KDAKernelDispatcher  # noqa: E402
from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import kda_attention as kit  # noqa: E402

from k3_sglang.kda_backend import K3KDAKernel  # noqa: E402

rebind_triton_aliases()


def _select(monkeypatch, **fields):
    real = kit.get_context
    monkeypatch.setattr(kit, "get_context", lambda: ContextOverride(real(), linear_attn_backend="k3", **fields))


@pytest.fixture
def k3_backend_selected(monkeypatch):
    _select(monkeypatch)


CASES = kit.make_kda_cases("torch_native")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sglang_kda_kit_case_on_k3_kernels(case, k3_backend_selected):
    fixture = kit.build_kda_attention_fixture(kit_testcase(), case, dtype=torch.float32, device="cpu")
    dispatcher = fixture.backend.linear_attn_backend.kernel_dispatcher
    assert isinstance(dispatcher.extend_kernel, K3KDAKernel) and isinstance(dispatcher.decode_kernel, K3KDAKernel)
    assert isinstance(dispatcher.verify_kernel, K3KDAKernel)  # unset verify follows decode to k3
    initial = kit._ssm_states(fixture).clone()
    actual = kit.run_kda_fixture_eager(fixture)
    expected = kit._pure_torch_kda_reference(fixture, initial)
    torch.testing.assert_close(actual, expected.output, atol=kit.KDA_ATOL, rtol=kit.KDA_RTOL)
    rows = kit._cache_indices(fixture)
    # final states are written back to the pool in both modes (the kit checks decode only)
    torch.testing.assert_close(kit._ssm_states(fixture)[rows], expected.final_states[rows], atol=kit.KDA_ATOL,
                               rtol=kit.KDA_RTOL)


# --- target_verify (speculative verification) -------------------------------------------------------------------
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.runner_modes import (  # noqa: E402
    speculative_target_verify_runner as verify_kit)

rebind_triton_aliases()


def _verify_case(topk: int):
    return kit.KDAAttentionCase(name=f"kda_verify_topk{topk}", backend="torch_native",
                                forward_mode=ForwardMode.TARGET_VERIFY, num_k_heads=2, num_v_heads=2, page_size=1,
                                prefix_lens=(4, 7), extend_lens=(3, 3))


def _reference_token_states(fixture, qkv_act, parents, root_states):
    """State after each draft token (the kit's recurrence, kept per token): [B, D, HV, V, K]."""
    module, case = fixture.reference_module, fixture.case
    q, k, v = module.split_qkv(qkv_act)
    g, beta = kit._pure_torch_kda_gating(module, fixture.a_raw, fixture.b_raw)
    D, ratio = case.input_lens[0], case.num_v_heads // case.num_k_heads
    out = torch.empty(case.batch_size, D, case.num_v_heads, module.head_v_dim, module.head_k_dim)
    for i in range(case.batch_size):
        for t in range(D):
            s = (root_states[i] if parents[t] < 0 else out[i, parents[t]]).clone()
            j = i * D + t
            for h in range(case.num_v_heads):
                kn = k[0, j, h // ratio].float()
                kn = kn / torch.sqrt(torch.sum(kn * kn) + 1e-6)  # the kit's l2norm
                s[h] = s[h] * torch.exp(g[j, h]).unsqueeze(0)
                s[h] = s[h] + ((v[0, j, h].float() - s[h] @ kn) * beta[j, h]).unsqueeze(1) * kn.unsqueeze(0)
            out[i, t] = s
    return out


@pytest.fixture(params=[1, 2], ids=["chain", "tree"])
def verify_topk(request, monkeypatch):
    """The kit publishes `speculative_eagle_topk=1` for every verify case, so its topk=2 case reaches the backend
    as a chain (`HybridLinearAttnBackend.topk` is read from the server args): the tree is published here."""
    _select(monkeypatch, speculative_eagle_topk=request.param)
    return request.param


def test_sglang_kda_verify_kit_case_on_k3_kernels(verify_topk):
    """SGLang's own verify runner (real EagleVerifyInput, conv with intermediate windows, the backend's verify
    path) at its tolerance (1e-1: its reference leaves out the conv's silu, see the next test)."""
    topk = verify_topk
    verify_kit.run_kda_eagle_verify_case(kit_testcase(), _verify_case(topk), topk=topk, dtype=torch.float32,
                                         device="cpu")


def test_k3_verify_is_exact_writes_every_draft_state_and_leaves_the_pool(verify_topk):
    topk = verify_topk
    case = _verify_case(topk)
    fixture, inputs, pool_before, actual = run_kda_verify(case, topk)
    # identity conv weights + the backend's silu: the reference's inputs are silu(mixed_qkv)
    qkv_act = torch.nn.functional.silu(inputs["mixed_qkv"].float())
    expected = kit.expected_kda_verify_output_from_inputs(
        fixture, case, {**inputs, "mixed_qkv": qkv_act}, (None, pool_before), topk=topk)
    torch.testing.assert_close(actual, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(kit._ssm_states(fixture), pool_before)  # verify never commits; SGLang's commit hook does
    linear = fixture.backend.linear_attn_backend
    cache = linear.req_to_token_pool.mamba2_layer_cache(0)
    rows = linear.verify_intermediate_state_indices[: case.batch_size].long()
    parents = kit._kda_verify_parent_indices(case.input_lens[0], topk)
    root = pool_before[kit._cache_indices(fixture)]
    want = _reference_token_states(fixture, qkv_act, parents, root)
    torch.testing.assert_close(cache.intermediate_ssm[rows, : case.input_lens[0]].float(), want, atol=2e-5,
                               rtol=2e-5)
    assert parents[-1] == (0 if topk == 2 else 1)  # the tree case really branches (two children of token 0)


def test_k3_is_one_of_sglangs_backend_choices_and_bad_pools_are_refused():
    from sglang.srt.arg_groups.choices import LINEAR_ATTN_KERNEL_BACKEND_CHOICES

    assert "k3" in LINEAR_ATTN_KERNEL_BACKEND_CHOICES  # what argparse checks --linear-attn-*-backend against
    q = torch.randn(1, 2, 2, 32)
    v = torch.randn(1, 2, 2, 32)
    bf16_pool = torch.zeros(4, 2, 32, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ssm_states"):
        K3KDAKernel().decode(q, q, v, torch.randn(2, 64), torch.randn(1, 2, 2), A_log=torch.zeros(2),
                             dt_bias=torch.zeros(64), ssm_states=bf16_pool, cache_indices=torch.tensor([0, 1]),
                             query_start_loc=torch.tensor([0, 1, 2]))
