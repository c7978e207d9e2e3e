"""benchmarks/spec_decode.py's step phases (`--profile`: where a speculative step's time goes, the figure the
batch-8 work on the H200 is steered by): the phases must add up to the step, be attributed to the phases that ran,
and leave the engine's functions as they were; the CPU section stays wired to `--cpu`."""
import pytest
import torch

import benchmarks.spec_decode as bench
import k3.rollout.spec.decode as decode_module
from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.rollout import SamplingParams
from k3.rollout.spec import SpecConfig


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny")).eval()


def test_step_phases_add_up_and_restore_the_engine(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 40, (12,), generator=g).tolist() * 2 for _ in range(3)]
    originals = (decode_module.verify_batched, decode_module.commit, decode_module.next_logits,
                 decode_module.SpecDecoder._propose_group)
    seen = []
    phases = bench.step_phases(model, prompts, SamplingParams(temperature=0.0, max_tokens=6),
                               SpecConfig(draft_len=3, verify="batched"), 2, None, setup=seen.append)
    assert len(seen) == 1 and seen[0].spec is not None   # setup(engine) ran on the engine it measured
    assert phases["steps"] > 0 and {"propose", "verify_batched", "commit"} <= set(phases)
    parts = [v for k, v in phases.items() if k not in ("steps", "step_ms", "rest_ms")]
    assert all(v >= 0 for v in parts) and phases["verify_batched"] > 0
    assert sum(parts) + phases["rest_ms"] == pytest.approx(phases["step_ms"], abs=0.01)
    assert (decode_module.verify_batched, decode_module.commit, decode_module.next_logits,
            decode_module.SpecDecoder._propose_group) == originals


def test_cpu_section_is_the_cpu_flag():
    assert callable(bench.cpu_section) and callable(bench.gpu_section) and callable(bench.memory_table)


def test_job_rollouts_row_compares_like_with_like(model, tmp_path):
    """`--episodes`: the main job's rollouts (temperature 1, MATCH acceptance) through plain decoding, the n-gram
    and a trained-format drafter (a random head here): the same episodes, bitwise, so the speedup compares like
    with like."""
    from k3.envs import CalculatorEnv
    from k3.rollout.spec.drafter import DraftHead, save_drafter
    save_drafter(DraftHead(model.config.hidden_size), tmp_path / "drafter", {"draft_vocab": list(range(3, 60))})
    row = bench.gpu_job_rollouts(model, CalculatorEnv(), tmp_path / "drafter",
                                 bench.GpuSettings(repeats=1, episodes_tasks=1), batch=4)
    assert row["tasks"] == 1 and row["plain"]["decode_tokens"] > 0
    for name in ("ngram_batched_match", "drafter_batched_match"):
        assert row[name]["bitwise_equal_to_plain"], name
        assert row[name]["verifies"] > 0


def test_step_trace_summarises_steps_and_phases(model, tmp_path):
    """benchmarks/step_trace.py (the H200 timeline the batch-8 work reads): on CPU the same run with a random
    head, its phases found inside each step, host time within the step, no device time, and the engine's functions
    restored afterwards."""
    import benchmarks.step_trace as trace
    originals = (decode_module.verify_batched, decode_module.commit, decode_module.next_logits,
                 decode_module.SpecDecoder._propose_group, decode_module.SpecDecoder.step)
    head = trace.random_head(model, tmp_path)
    spec = SpecConfig(method="drafter", draft_len=3, verify="batched", drafter_path=str(head), lookup=0)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 40, (10,), generator=g).tolist() for _ in range(2)]
    summary = trace.trace_run(model, 2, 8, spec, False, tmp_path, "t", prompts=prompts)
    assert (tmp_path / "t.json.gz").exists() and summary["steps"] > 0
    host = [summary[f"{p}_host_ms"] for p in trace.PHASES if f"{p}_host_ms" in summary]
    assert len(host) == len(trace.PHASES) and 0 < sum(host) <= summary["step_ms"]
    assert summary["device_busy_ms"] == 0.0
    assert (decode_module.verify_batched, decode_module.commit, decode_module.next_logits,
            decode_module.SpecDecoder._propose_group, decode_module.SpecDecoder.step) == originals


def test_step_trace_union_counts_overlaps_once():
    import benchmarks.step_trace as trace
    assert trace._union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert trace._busy_within([(0, 10), (12, 14)], 5, 13) == 6
    # two streams: [2, 5) shared by two kernels, [4, 5) by three (still counted once); clipped to the window
    assert trace._concurrent([(0, 5), (2, 8), (4, 5), (9, 10)], 0, 10) == 3
    assert trace._concurrent([(0, 5), (2, 8)], 3, 4) == 1 and trace._concurrent([(0, 1), (1, 2)], 0, 2) == 0


def test_sft_target_with_frozen_routed_experts_trains_the_rest_only():
    """`--sft-freeze-routed-experts` (the GPU target meant for an 80 GB H100): the routed experts keep their random
    init through the SFT steps, the shared experts and the rest train, and the figures say how many were trained."""
    from benchmarks.k3_width import sft_k3_width_model
    config = K3Config.preset("tiny")
    torch.manual_seed(0)
    init = dict(K3ForCausalLM(config).named_parameters())   # the function's own init (seed 0)
    model, fig = sft_k3_width_model(2, 1e-3, 60.0, batch=2, config=config, device="cpu",
                                    freeze_routed_experts=True)
    routed = [n for n in init if ".experts." in n and ".shared_experts." not in n]
    assert routed and fig["routed_experts_frozen"] and fig["steps"] == 2
    trained = dict(model.named_parameters())
    for name in routed:
        assert torch.equal(trained[name], init[name].detach().bfloat16()), name
    moved = [n for n in init if n not in routed and "embed_tokens" not in n and "lm_head" not in n
             and not torch.equal(trained[n], init[n].detach().bfloat16())]
    assert any(".shared_experts." in n for n in moved) and any("self_attn" in n for n in moved)
    assert fig["trained_parameters"] == sum(p.numel() for n, p in init.items() if n not in routed and p.requires_grad
                                            and "embed_tokens" not in n and "lm_head" not in n)


def test_replay_kernel_rows_time_every_kernel_and_its_reference(monkeypatch):
    """benchmarks.spec_kernels (the GPU section's kernel rows) on CPU at small dims, the kernels in the interpreter:
    every kernel and reference it times runs on inputs they accept, and each row's speed-up is reference / kernel."""
    import triton.testing

    from benchmarks.spec_kernels import replay_kernel_rows
    ran = []

    def once(fn, return_mode):   # do_bench needs CUDA: run each timed callable once, a distinct time per call
        fn()
        ran.append(fn)
        return float(len(ran))
    monkeypatch.setattr(triton.testing, "do_bench", once)
    rows = replay_kernel_rows(B=2, H=2, K=16, device="cpu")
    assert len(ran) == 6
    commit, tree = rows["replay_commit"], rows["tree_verify"]
    assert commit["speedup"] == commit["torch_fold_ms_median"] / commit["triton_ms_median"] == 2.0
    assert commit["pool_3_layers"]["speedup"] == 3.0 / 4.0 and tree["speedup"] == 6.0 / 5.0
    assert "H=2 K=V=16" in commit["shape"] and "14 nodes" in tree["shape"]


def test_sft_target_within_an_h100_trains_everything_with_bf16_tables():
    """`--sft-micro-batch` with `--sft-bf16-frozen-tables`: every parameter but the frozen embedding and lm_head
    trains, those keep their (bf16-rounded) init, the step's loss stays close to the fp32 tables' (only the tables'
    rounding differs), the hooks are gone from the served bf16 model, and a bad micro batch is refused first."""
    from benchmarks.k3_width import sft_k3_width_model
    config = K3Config.preset("tiny")
    torch.manual_seed(0)
    init = dict(K3ForCausalLM(config).named_parameters())   # the function's own init (seed 0)
    model, fig = sft_k3_width_model(2, 1e-3, 60.0, batch=4, config=config, device="cpu", micro_batch=3,
                                    bf16_frozen_tables=True)
    ref, ref_fig = sft_k3_width_model(2, 1e-3, 60.0, batch=4, config=config, device="cpu")
    assert fig["micro_batch"] == 3 and fig["bf16_frozen_tables"] and fig["steps"] == 2
    assert fig["trained_parameters"] == ref_fig["trained_parameters"]
    assert abs(fig["loss_first"] - ref_fig["loss_first"]) <= 1e-2 * ref_fig["loss_first"]
    trained = dict(model.named_parameters())
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(trained[name], init[name].detach().bfloat16()), name
    assert any(not torch.equal(trained[n], init[n].detach().bfloat16()) for n in init if "self_attn" in n)
    for module in (model.model.embed_tokens, model.lm_head):
        assert not module._forward_hooks and not module._forward_pre_hooks
    ids = torch.tensor([[1, 2, 3]])
    assert model(ids).logits.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="micro_batch"):
        sft_k3_width_model(1, 1e-3, 60.0, batch=2, config=config, device="cpu", micro_batch=0)
