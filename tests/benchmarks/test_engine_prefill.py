"""benchmarks/engine_prefill.py compares prefill_batch 1 with P on prompts arriving at once: batched prefill must
run fewer forwards and keep each prompt's completion bitwise the same alone and among the others, or the figure it
reports (the serverless service's merged sample rounds) would be bought with cross-talk."""
from benchmarks.engine_prefill import PrefillConfig, run
from k3.config import K3Config
from k3.model import K3ForCausalLM


def test_batched_prefill_runs_fewer_forwards_and_stays_batch_invariant():
    model = K3ForCausalLM(K3Config.preset("tiny")).eval()
    res = run(model, PrefillConfig(prompts=4, system_len=40, task_len=10, samples=2, max_tokens=3, prefill_batch=4,
                                   decode_batch=8, repeats=1))
    one, batched = res["rows"]["prefill_batch_1"], res["rows"]["prefill_batch_4"]
    assert batched["forwards"] < one["forwards"]
    assert one["alone_equals_mixed_bitwise"] and batched["alone_equals_mixed_bitwise"]
