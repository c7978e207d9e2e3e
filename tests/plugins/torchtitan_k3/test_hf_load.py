"""A checkpoint in the published kimi_k3 layout (HF names, per-expert tensors, safetensors) loaded through
TorchTitan's own `--checkpoint.initial_load_in_hf` path (DCP's HuggingFaceStorageReader, our state_dict_adapter's
to_hf / from_hf), on 2 FSDP ranks: the weights the trainer holds give the logits of `k3.model` loaded from the same
file, bit for bit, and its first step's loss is k3.model's cross-entropy on that batch."""
from __future__ import annotations

import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.adapter import load_pretrained
from k3_torchtitan.data import ArithmeticDataLoader, ByteTokenizer
from k3_torchtitan.launch import model_from_dcp, parallel_args, run_trainer


def test_initial_load_in_hf_gives_k3_model_logits(titan_root):
    torch.manual_seed(3)
    written = K3ForCausalLM(K3Config.preset("tiny"))
    with torch.no_grad():  # values the initialisation would not give (zeros there), so a skipped tensor shows
        for name, p in written.named_parameters():
            if name.endswith(("_res_proj.weight", "e_score_correction_bias")):
                p.normal_(0.0, 0.5)
    hf_dir = titan_root / "hf_checkpoint"
    written.save_pretrained(hf_dir)
    root = titan_root / "hf_load"
    # lr 0: the step-1 checkpoint holds exactly what was loaded
    steps = run_trainer(root, "--checkpoint.enable", "--checkpoint.initial_load_path", str(hf_dir),
                        "--checkpoint.initial_load_in_hf", "--checkpoint.interval", "1", "--optimizer.param-groups.0.optimizer-kwargs.lr", "0",
                        *parallel_args(batch=2, dp_shard=2, steps=1), nproc=2)
    assert "Loading from HF safetensors" in (root / "run.log").read_text()
    loaded, reference = model_from_dcp(root / "checkpoint" / "step-1"), load_pretrained(hf_dir).eval()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, reference(ids, use_cache=False).logits)
    loader = ArithmeticDataLoader.Config(corpus_lines=512).build(dp_world_size=1, dp_rank=0, tokenizer=ByteTokenizer(),
                                                                 seq_len=32, local_batch_size=4)
    inputs, labels = next(iter(loader))  # the 2 ranks' first batches together
    with torch.no_grad():
        logits = reference(inputs["input"], use_cache=False).logits
    ce = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()))
    assert abs(steps[0].loss - ce) <= 1.5e-5, (steps, ce)
