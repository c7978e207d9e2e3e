"""KDA kernel backend for SGLang on k3_kernels' Triton kernels (`--linear-attn-backend k3`).

SGLang's `KDAAttnBackend` (srt/layers/attention/linear/kda_backend.py) keeps the conv, the state pools, the
prefix-cache tracking and the speculative checkpoints; it hands the recurrent part to a `LinearAttnKernelBase`
chosen per phase by `KDAKernelDispatcher`. The dispatcher knows a fixed set of names (an unknown one becomes
`LinearAttnKernelBackend.CUSTOM`, which its constructor rejects for verify), so this module:
- adds "k3" to SGLang's `--linear-attn-*-backend` choices (`add_linear_attn_kernel_backend_choices`, its own
  extension point), and
- registers an AROUND hook on `KDAKernelDispatcher.__init__` (SGLang's `HookRegistry`): the phases named "k3" are
  built as triton first (so the original constructor accepts them) and then given `K3KDAKernel`. With
  `--linear-attn-backend k3` and no explicit verify backend, verify follows decode to k3 (SGLang's own default
  sends an unset verify to triton).

The kernel works in SGLang's layouts: state pool `[P, HV, V, K]` fp32 (`state_v_first=True` in our kernels),
`cache_indices` into it, varlen `query_start_loc`, raw gate / beta (gate and sigmoid formed in the kernels:
`-exp(A_log) softplus(a + dt_bias)`, or K3's `lower_bound * sigmoid(exp(A_log) (a + dt_bias))`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

from . import kda_layouts as layouts
from . import spec

BACKEND_NAME = "k3"
DISPATCHER_INIT = "sglang.srt.layers.attention.linear.kda_backend.KDAKernelDispatcher.__init__"


@dataclass(frozen=True)
class PhaseSelection:
    """Which of the dispatcher's three phases run on k3_kernels."""

    decode: bool
    prefill: bool
    verify: bool

    @property
    def any(self) -> bool:
        return self.decode or self.prefill or self.verify


def selected_phases() -> PhaseSelection:
    """Reads the published server args (`get_exec().mamba`), where the raw names survive (the dispatcher only
    receives the enum, in which every unknown name is CUSTOM)."""
    from sglang.srt.runtime_context import get_exec

    mamba = get_exec().mamba
    base = mamba.linear_attn_backend
    decode = mamba.linear_attn_decode_backend or base
    prefill = mamba.linear_attn_prefill_backend or base
    verify = mamba.linear_attn_verify_backend or (BACKEND_NAME if decode == BACKEND_NAME else None)
    return PhaseSelection(decode=decode == BACKEND_NAME, prefill=prefill == BACKEND_NAME,
                          verify=verify == BACKEND_NAME)


class K3KDAKernel(LinearAttnKernelBase):
    """decode / extend / target_verify of SGLang's kernel contract on `k3_kernels.kda`."""

    supports_packed_decode = False  # the dispatcher then calls decode() with split q, k, v
    supports_packed_decode_safe_gate = False
    supports_safe_gate = True  # K3's lower-bound gate runs in our kernels (prefill is not re-routed to triton)
    supports_safe_gate_verify = True
    # The extra_buffer prefix-cache strategy needs an fp32 snapshot at a tracked chunk inside extend; ours returns
    # states only at sequence ends: SGLang then refuses the combination loudly (use no_buffer, which K3's exact
    # turn-boundary states need anyway).
    supports_track_state_snapshot = False

    def decode(self, q, k, v, a, b, *, A_log, dt_bias, ssm_states, cache_indices, query_start_loc,
               lower_bound: float | None = None, **kwargs) -> torch.Tensor:
        """One token per request (q, k, v [1, B, H, D]); updates `ssm_states[cache_indices]` in place."""
        return layouts.decode(q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=ssm_states,
                              cache_indices=cache_indices, query_start_loc=query_start_loc, lower_bound=lower_bound)

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, A_log=None, dt_bias=None,
               lower_bound: float | None = None, beta_is_raw: bool = False,
               return_intermediate_states: bool = False, **kwargs):
        """Prefill of packed sequences from their pool states; final states written back to the pool."""
        if return_intermediate_states or kwargs.get("track_state") is not None:
            raise NotImplementedError("k3 KDA extend does not write track snapshots: use "
                                      "--mamba-radix-cache-strategy no_buffer with --linear-attn-prefill-backend k3")
        return layouts.extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                              query_start_loc=query_start_loc, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                              beta_is_raw=beta_is_raw)

    def target_verify(self, A_log, dt_bias, q, k, v, a, b, *, ssm_states, cache_indices, query_start_loc,
                      intermediate_states_buffer, intermediate_state_indices, cache_steps: int,
                      retrieve_parent_token: torch.Tensor | None, lower_bound: float | None = None,
                      **kwargs) -> torch.Tensor:
        """Speculative verify: request i's D = cache_steps draft tokens (a chain, or a tree through
        `retrieve_parent_token[i, t]`, -1 = the committed state) start from `ssm_states[cache_indices[i]]`,
        which stays untouched; the state after draft token t goes to
        `intermediate_states_buffer[intermediate_state_indices[i], t]` (SGLang commits the accepted one after
        verification: `update_mamba_state_after_mtp_verify`). One recurrent step per draft depth, all requests
        batched in it: exact per token, the same bits whatever the batch holds."""
        if spec.replay_active():  # K3_REPLAY: outputs from inputs only, the step inputs kept for the commit
            return spec.replay_verify(A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, ssm_states=ssm_states,
                                      cache_indices=cache_indices, layer_key=intermediate_states_buffer.data_ptr(),
                                      cache_steps=cache_steps, retrieve_parent_token=retrieve_parent_token,
                                      lower_bound=lower_bound)
        if kwargs.get("cache_ring"):
            raise NotImplementedError("k3 KDA verify does not write SGLang's ReplaySSM ring "
                                      "(--enable-linear-replayssm-spec): use --speculative-algorithm K3_REPLAY")
        return layouts.target_verify(A_log, dt_bias, q, k, v, a, b, ssm_states=ssm_states,
                                     cache_indices=cache_indices, intermediate_states_buffer=intermediate_states_buffer,
                                     intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                                     retrieve_parent_token=retrieve_parent_token, lower_bound=lower_bound)


def _dispatcher_init(original, self, decode_backend, prefill_backend, verify_backend):
    """AROUND hook: phases named k3 are built as triton by SGLang's constructor, then given K3KDAKernel."""
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    phases = selected_phases()
    triton = LinearAttnKernelBackend.TRITON
    original(self, triton if phases.decode else decode_backend, triton if phases.prefill else prefill_backend,
             triton if phases.verify else verify_backend)
    if not phases.any:
        return
    kernel = K3KDAKernel()
    if phases.decode:
        self.decode_kernel = kernel
        self.supports_packed_decode = False
        self.supports_packed_decode_safe_gate = False
    if phases.prefill:
        self.extend_kernel = kernel
    if phases.verify:
        self.verify_kernel = kernel


def _dispatcher_lower_bound_decode(original, self, *args, lower_bound=None, **kwargs):
    """SGLang's dispatcher accepts K3's safe gate in decode only for its TritonKDAKernel; ours has it too."""
    if lower_bound is not None and isinstance(self.decode_kernel, K3KDAKernel):
        return self.decode_kernel.decode(*args, lower_bound=lower_bound, **kwargs)
    return original(self, *args, lower_bound=lower_bound, **kwargs)


_done = False


def register() -> None:
    global _done
    if _done:
        return
    from sglang.srt.arg_groups.choices import LINEAR_ATTN_KERNEL_BACKEND_CHOICES, add_linear_attn_kernel_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in LINEAR_ATTN_KERNEL_BACKEND_CHOICES:
        add_linear_attn_kernel_backend_choices([BACKEND_NAME])
    HookRegistry.register(DISPATCHER_INIT, _dispatcher_init, HookType.AROUND)
    HookRegistry.register(DISPATCHER_INIT.replace("__init__", "decode"), _dispatcher_lower_bound_decode,
                          HookType.AROUND)
    _done = True
