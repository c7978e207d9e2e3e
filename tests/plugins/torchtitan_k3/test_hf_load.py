"""A checkpoint in the published kimi_k3 layout (HF names, per-expert tensors, safetensors) loaded through
TorchTitan's own `--checkpoint.initial_load_in_hf` path (DCP's HuggingFaceStorageReader, our state_dict_adapter's
to_hf / from_hf), on 2 FSDP ranks: the weights the trainer holds give the logits of `k3.model` loaded from the same
file, bit for bit, and its first step's loss is k3.model's cross-entropy on that batch."""
from __future__ import annotations

import re

import pytest
import torch

from k3.config import K3Config
from k3.model import K3ForCausalLM
from k3.model.adapter import WEIGHTS_FILE, load_pretrained
from k3_torchtitan import K3StateDictAdapter, K3TitanModel
from k3_torchtitan.data import ArithmeticDataLoader, ByteTokenizer
from k3_torchtitan.launch import model_from_dcp, parallel_args, run_trainer

from _mxfp4_checkpoints import store_experts_as_mxfp4


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


def _load_through_titan_reader(hf_dir, from_quantized: bool):
    """TorchTitan's initial_load_in_hf steps in process: to_hf -> DCP load with the adapter's reader -> from_hf."""
    import torch.distributed.checkpoint as dcp
    tcfg = K3TitanModel.Config(k3=K3Config.preset("tiny"))
    model = tcfg.build()
    adapter = K3StateDictAdapter(tcfg, None)
    target = adapter.to_hf(model.state_dict())
    dcp.load(target, storage_reader=adapter.get_hf_storage_reader(str(hf_dir), from_quantized), no_dist=True)
    model.load_state_dict(adapter.from_hf(target))
    return model


def test_mxfp4_experts_load_through_the_quantized_reader(tmp_path):
    """`--checkpoint.initial_load_in_hf_quantized` on an MXFP4 checkpoint: every weight the model gets equals
    k3.model's own loader's (the exact bf16 values the codes encode). Without the flag, the error says to pass it
    (DCP wraps every reader error in its CheckpointException, a BaseException, with the text inside)."""
    torch.manual_seed(4)
    K3ForCausalLM(K3Config.preset("tiny")).save_pretrained(tmp_path)
    store_experts_as_mxfp4(tmp_path, seed=5)
    reference = load_pretrained(tmp_path)
    model = _load_through_titan_reader(tmp_path, from_quantized=True)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())
    with pytest.raises(BaseException, match="stores MXFP4 weights; load it with --checkpoint.initial_load_in_hf_quan"):
        _load_through_titan_reader(tmp_path, from_quantized=False)


def test_mxfp4_weight_without_scales_is_named_before_any_read(tmp_path):
    from safetensors.torch import load_file, save_file
    K3ForCausalLM(K3Config.preset("tiny")).save_pretrained(tmp_path)
    store_experts_as_mxfp4(tmp_path, seed=5)
    hf = load_file(str(tmp_path / WEIGHTS_FILE))
    gone = "model.layers.2.block_sparse_moe.experts.3.w2.weight_scale"
    del hf[gone]
    save_file(hf, str(tmp_path / WEIGHTS_FILE))
    with pytest.raises(BaseException, match=re.escape(f"{gone[:-len('_scale')]}_packed: MXFP4 weight without its "
                                                        f"scales {gone}")):
        _load_through_titan_reader(tmp_path, from_quantized=True)


def test_mxfp4_checkpoint_through_the_trainer_on_two_fsdp_ranks(titan_root):
    """The same through TorchTitan's entry point with `--checkpoint.initial_load_in_hf_quantized` on 2 FSDP ranks
    (each rank's reader decides from the file, as only the coordinator reads metadata): the trainer's weights give
    the logits of k3.model loaded from the same MXFP4 file, bit for bit."""
    torch.manual_seed(6)
    hf_dir = titan_root / "hf_mxfp4_checkpoint"
    K3ForCausalLM(K3Config.preset("tiny")).save_pretrained(hf_dir)
    store_experts_as_mxfp4(hf_dir, seed=5)
    root = titan_root / "hf_mxfp4_load"
    run_trainer(root, "--checkpoint.enable", "--checkpoint.initial_load_path", str(hf_dir),
                "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_in_hf_quantized",
                "--checkpoint.interval", "1", "--optimizer.param-groups.0.optimizer-kwargs.lr", "0",
                *parallel_args(batch=2, dp_shard=2, steps=1), nproc=2)
    loaded, reference = model_from_dcp(root / "checkpoint" / "step-1"), load_pretrained(hf_dir).eval()
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, reference(ids, use_cache=False).logits)


def test_mxfp4_reader_serves_any_slice_of_a_dequantised_expert(tmp_path):
    """A sharded load asks for row/column blocks of a weight: each is that block of the dequantised tensor."""
    from safetensors import safe_open
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    K3ForCausalLM(K3Config.preset("tiny")).save_pretrained(tmp_path)
    store_experts_as_mxfp4(tmp_path, seed=5)
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    full = load_pretrained(tmp_path).state_dict()["model.layers.1.block_sparse_moe.experts.w3"][2]
    adapter = K3StateDictAdapter(K3TitanModel.Config(k3=K3Config.preset("tiny")), None)
    reader = adapter.get_hf_storage_reader(str(tmp_path), from_quantized=True)

    class Planner:   # the two LoadPlanner calls a read request makes
        def resolve_tensor(self, req):
            return torch.empty(*req.lengths)

        def commit_tensor(self, req, tensor):
            self.got = tensor

    for offsets, lengths in [((0, 0), (64, 64)), ((16, 0), (24, 64)), ((5, 33), (7, 20))]:
        req = ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(name), dest_offsets=torch.Size([0, 0]),
                       storage_index=MetadataIndex(name, offsets), storage_offsets=torch.Size(offsets),
                       lengths=torch.Size(lengths))
        planner = Planner()
        with safe_open(str(tmp_path / WEIGHTS_FILE), framework="pt") as f:
            reader._process_read_request(f, req, planner)
        rows, cols = (slice(o, o + n) for o, n in zip(offsets, lengths))
        assert torch.equal(planner.got, full[rows, cols]), offsets
