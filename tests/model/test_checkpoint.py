"""Checkpoint loading fails loudly and by name: bad files name the file, bad tensors name the tensor and both shapes,
and K3's one A_log quirk (128 values stored for 96 KDA heads) is the only A_log length accepted beyond the model's.
Routed experts stored as MXFP4 (the published checkpoint's format) load as the exact bf16 values they encode."""
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3.config import ConfigError, K3Config
from k3.model import K3ForCausalLM
from k3.model.adapter import A_LOG_STORED_LENGTHS, WEIGHTS_FILE, CheckpointError, from_hf, load_pretrained

from _mxfp4_checkpoints import store_experts_as_mxfp4

A_LOG = "model.layers.0.self_attn.A_log"  # layer 1 (1-based) is KDA in every preset


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset("tiny")).eval()


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_ckpt")
    tiny.save_pretrained(path)
    return path


def _copy(saved, tmp_path):
    for f in saved.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    return tmp_path


def _assert_same_weights(a: K3ForCausalLM, b: K3ForCausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_round_trip_still_loads(tiny, saved):
    _assert_same_weights(tiny, load_pretrained(saved))


@pytest.mark.parametrize("four_d", [False, True])
def test_published_a_log_quirk_loads_the_first_96_values(tmp_path, four_d):
    """The published K3 checkpoint stores A_log as F32[128] for 96 heads; a 96-head model takes the first 96."""
    assert A_LOG_STORED_LENGTHS == {96: 128}
    cfg = K3Config.preset("tiny")
    cfg = cfg.replace(linear_attn_config={**cfg.linear_attn_config, "num_heads": 96, "head_dim": 4})
    torch.manual_seed(1)
    model = K3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".A_log"):
                p.uniform_(-1, 1)  # zeros at init would hide a wrong slice
    model.save_pretrained(tmp_path)
    hf = load_file(str(tmp_path / WEIGHTS_FILE))
    quirky = [k for k in hf if k.endswith(".A_log")]
    assert len(quirky) == len(cfg.linear_attn_config["kda_layers"])
    for k in quirky:
        stored = torch.cat([hf[k], torch.full((32,), 7.0)])
        hf[k] = stored.view(1, 1, 128, 1) if four_d else stored
    save_file(hf, str(tmp_path / WEIGHTS_FILE))
    _assert_same_weights(model, load_pretrained(tmp_path))


@pytest.mark.parametrize("stored_shape", [(7,), (128,), (1,), (1, 1, 7, 1), (1, 1, 2, 2), (2, 1)])
def test_other_a_log_lengths_are_rejected_with_both_shapes(tiny, stored_shape):
    """Tiny has 2 KDA heads: 2 + 5 extra values, or 128 (the quirk is for 96 heads only), is a mismatch, not a
    silent truncation; the message names the tensor, the checkpoint's shape and the model's."""
    state = tiny.state_dict()
    hf = dict(state)
    hf[A_LOG] = torch.zeros(stored_shape)
    with pytest.raises(CheckpointError, match=re.escape(
            f"shape mismatch: {A_LOG}: checkpoint {stored_shape}, model (2,)")) as e:
        from_hf(hf, state)
    assert "128 values for 96 heads" in str(e.value)


def test_a_log_of_96_heads_must_be_96_or_128():
    expected = {A_LOG: torch.empty(96, device="meta")}
    assert torch.equal(from_hf({A_LOG: torch.arange(128.0)}, expected)[A_LOG], torch.arange(96.0))
    assert torch.equal(from_hf({A_LOG: torch.arange(96.0)}, expected)[A_LOG], torch.arange(96.0))
    for n in (97, 133, 256):
        with pytest.raises(CheckpointError, match=re.escape(f"{A_LOG}: checkpoint ({n},), model (96,)")):
            from_hf({A_LOG: torch.zeros(n)}, expected)


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage"])
def test_corrupt_safetensors_names_the_file(saved, tmp_path, damage):
    ckpt = _copy(saved, tmp_path)
    f = ckpt / WEIGHTS_FILE
    data = f.read_bytes()
    f.write_bytes({"truncate": data[: len(data) // 2], "empty": b"", "garbage": b"not a safetensors file" * 4}[damage])
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint file {f}: not a readable safetensors file")):
        load_pretrained(ckpt)


def test_tensor_stored_in_two_files_is_rejected(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    save_file({"model.norm.weight": torch.ones(128)}, str(ckpt / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape(
            f"model.norm.weight: stored in both {ckpt / 'extra.safetensors'} and {ckpt / WEIGHTS_FILE}")):
        load_pretrained(ckpt)


@pytest.mark.parametrize("config_text, message", [
    (None, "does not exist"),
    ('{"model_type": "kimi_linear",', "is not valid JSON"),
    (json.dumps({"model_type": "kimi_linear"}), "vocab_size, hidden_size"),
])
def test_bad_config_json_names_the_file(saved, tmp_path, config_text, message):
    ckpt = _copy(saved, tmp_path)
    if config_text is None:
        (ckpt / "config.json").unlink()
    else:
        (ckpt / "config.json").write_text(config_text)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        K3ForCausalLM.from_pretrained(ckpt)
    assert str(ckpt / "config.json") in str(e.value)


def test_config_that_does_not_match_the_weights_names_the_checkpoint(saved, tmp_path):
    ckpt = _copy(saved, tmp_path)
    d = json.loads((ckpt / "config.json").read_text())
    d["vocab_size"] = 640
    (ckpt / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=re.escape(
            f"{ckpt}: checkpoint does not match the model:\n  shape mismatch: lm_head.weight: checkpoint (512, 128), "
            "model (640, 128)")):
        load_pretrained(ckpt)


def test_no_weights_is_an_error_naming_the_directory(saved, tmp_path):
    (tmp_path / "config.json").write_bytes((saved / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match=re.escape(f"no *.safetensors files in {tmp_path}")):
        load_pretrained(tmp_path)


def _mxfp4_checkpoint(tiny, tmp_path):
    """tiny's checkpoint with every routed expert stored as the published one stores them (MXFP4 codes + E8M0
    scales, random, up to 2^3 so large exponents occur too); returns the path and the bf16 values they mean."""
    tiny.save_pretrained(tmp_path)
    return tmp_path, store_experts_as_mxfp4(tmp_path, exponents=(120, 130))


def test_mxfp4_routed_experts_load_as_their_exact_bf16_values(tiny, tmp_path):
    """The published checkpoint's routed experts are MXFP4 (compressed-tensors pack format); loading expands each
    to the bf16 values it encodes, exactly, and every other tensor loads unchanged."""
    from k3.model.adapter import to_hf
    path, meant = _mxfp4_checkpoint(tiny, tmp_path)
    loaded = to_hf(load_pretrained(path).state_dict())
    assert meant and set(meant) <= set(loaded)
    for name, want in meant.items():
        assert torch.equal(loaded[name], want.float()), name
    for name, t in to_hf(tiny.state_dict()).items():
        if name not in meant:
            assert torch.equal(loaded[name], t), name


def test_mxfp4_scales_as_float8_e8m0_load_the_same(tiny, tmp_path):
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    path, meant = _mxfp4_checkpoint(tiny, tmp_path)
    hf = load_file(str(path / WEIGHTS_FILE))
    hf = {n: (t.view(torch.float8_e8m0fnu) if n.endswith(".weight_scale") else t) for n, t in hf.items()}
    save_file(hf, str(path / WEIGHTS_FILE))
    from k3.model.adapter import to_hf
    name = next(iter(meant))
    assert torch.equal(to_hf(load_pretrained(path).state_dict())[name], meant[name].float())


EXPERT = "model.layers.1.block_sparse_moe.experts.0.w1"


@pytest.mark.parametrize("damage, message", [
    (lambda hf: hf.pop(EXPERT + ".weight_scale"), f"{EXPERT}.weight_packed: MXFP4 weight without its scales"),
    (lambda hf: hf.pop(EXPERT + ".weight_packed"), f"{EXPERT}.weight_scale: MXFP4 scales without a packed weight"),
    (lambda hf: hf.__setitem__(EXPERT + ".weight_scale", hf[EXPERT + ".weight_scale"][:, :1].contiguous()),
     f"{EXPERT}.weight_scale: shape (64, 1) does not fit {EXPERT}.weight_packed (64, 32)"),
    (lambda hf: hf.__setitem__(EXPERT + ".weight_packed", hf[EXPERT + ".weight_packed"].to(torch.int16)),
     "MXFP4 expects uint8 codes and E8M0 scales, got torch.int16"),
    (lambda hf: hf.__setitem__(EXPERT + ".weight", torch.zeros(64, 64)),
     f"{EXPERT}.weight: stored both as bf16 and as MXFP4"),
])
def test_broken_mxfp4_tensors_are_named_before_anything_loads(tiny, tmp_path, damage, message):
    path, _ = _mxfp4_checkpoint(tiny, tmp_path)
    hf = load_file(str(path / WEIGHTS_FILE))
    damage(hf)
    save_file(hf, str(path / WEIGHTS_FILE))
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_pretrained(path)
