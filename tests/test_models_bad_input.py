"""Bad checkpoints fail at load with one CheckpointError that names the file and the mismatch."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from helpers import patch_json, write_conditioner, write_drafter

import retrace
from retrace.errors import CheckpointError
from retrace.models.convert import hf_assistant_to_zlab, zlab_to_hf_assistant
from retrace.models.drafter import DFlashDrafter, load_pair
from retrace.models.target import Qwen3Target


@pytest.fixture
def target_dir(tiny_pair):
    return tiny_pair().target_dir  # 4 layers, hidden 64, vocab 128, heads 4 / kv 2, head_dim 16


@pytest.fixture
def target(target_dir):
    return Qwen3Target.from_pretrained(target_dir)


def load_error(fn, *args) -> str:
    with pytest.raises(CheckpointError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg, msg  # one line: the CLIs print it as is
    return msg


# -- drafter does not fit its target -------------------------------------------------------------------

MISFITS = {
    "hidden": (dict(hidden=32, heads=2), "hidden_size 32 != target hidden_size 64"),
    "vocab": (dict(vocab=100), "vocab_size 100 != target vocab_size 128"),
    "layer-id": (dict(target_layer_ids=[1, 4]), "target_layer_ids [4] do not exist in a 4-layer target"),
    "mask-id": (dict(mask_token_id=128), "mask_token_id 128 is outside the target vocab (size 128)"),
    "num-target-layers": (dict(target_layer_ids=[2], config_overrides={"num_target_layers": 36}),
                          "num_target_layers 36 != target's 4"),
}


@pytest.mark.parametrize("case", list(MISFITS))
def test_drafter_misfit(case, target_dir, target, tmp_path):
    kw, needle = MISFITS[case]
    d = write_drafter(tmp_path / "d", target_dir, **kw)
    for fn, args in ((DFlashDrafter.from_pretrained, (d, target)), (load_pair, (target_dir, d)),
                     (zlab_to_hf_assistant, (d, target_dir, tmp_path / "hf"))):
        msg = load_error(fn, *args)
        assert msg.startswith(f"{d / 'config.json'}: drafter does not fit the target: ") and needle in msg, msg
        assert msg.count("!=") + msg.count("outside") + msg.count("do not exist") == 1, msg
    assert not (tmp_path / "hf").exists()


def test_drafter_head_dim_mismatch(target_dir, target, tmp_path):
    d = write_drafter(tmp_path / "d", target_dir, head_dim=32)  # weights shaped for head_dim 32
    patch_json(d / "config.json", head_dim=16)
    msg = load_error(DFlashDrafter.from_pretrained, d, target)
    assert msg.startswith(f"{d / 'model.safetensors'}: weights do not match the config ({d / 'config.json'})"), msg
    assert "layers.0.self_attn.q_proj.weight: file (128, 64) vs expected (64, 64)" in msg
    assert "layers.0.self_attn.q_norm.weight: file (32,) vs expected (16,)" in msg


def test_target_head_dim_mismatch(target_dir, tmp_path):
    t = tmp_path / "t"
    shutil.copytree(target_dir, t)
    patch_json(t / "config.json", head_dim=32)
    msg = load_error(Qwen3Target.from_pretrained, t)
    assert msg.startswith(f"{t / 'model.safetensors'}: weights do not match the config ({t / 'config.json'})"), msg
    assert "model.layers.0.self_attn.q_proj.weight: file (64, 64) vs expected (128, 64)" in msg


def test_drafter_fc_for_wrong_number_of_taps(target_dir, target, tmp_path):
    d = write_drafter(tmp_path / "d", target_dir, target_layer_ids=[1, 2])
    patch_json(d / "config.json", dflash_config={"mask_token_id": 127, "target_layer_ids": [1, 2, 3]})
    msg = load_error(DFlashDrafter.from_pretrained, d, target)
    assert "fc.weight: file (64, 128) vs expected (64, 192)" in msg and str(d / "model.safetensors") in msg


def test_target_tap_layer_out_of_range(target_dir):
    msg = load_error(Qwen3Target.from_pretrained, target_dir, (1, 9))
    assert "tap layers [9] do not exist in a 4-layer target" in msg and str(target_dir) in msg


# -- broken files, for the target and the drafter ---------------------------------------------------------


def _model_dir(which, target_dir, tmp_path):
    if which == "target":
        d = tmp_path / "t"
        shutil.copytree(target_dir, d)
        return d
    return write_drafter(tmp_path / "d", target_dir)


def _loader(which, target):
    if which == "target":
        return lambda d: Qwen3Target.from_pretrained(d)
    return lambda d: DFlashDrafter.from_pretrained(d, target)


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_missing_safetensors(which, target_dir, target, tmp_path):
    d = _model_dir(which, target_dir, tmp_path)
    (d / "model.safetensors").unlink()
    msg = load_error(_loader(which, target), d)
    assert msg.startswith(f"{d}: no ") and ".safetensors weight files" in msg and "pickle" not in msg, msg


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_truncated_safetensors(which, target_dir, target, tmp_path):
    d = _model_dir(which, target_dir, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    msg = load_error(_loader(which, target), d)
    assert msg.startswith(f"{f}: cannot read safetensors file") and "truncated or corrupt" in msg, msg


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_config_missing_required_keys(which, target_dir, target, tmp_path):
    d = _model_dir(which, target_dir, tmp_path)
    patch_json(d / "config.json", drop=("hidden_size", "num_attention_heads"))
    msg = load_error(_loader(which, target), d)
    assert msg == f"{d / 'config.json'}: missing required config keys ['hidden_size', 'num_attention_heads']", msg


def test_drafter_config_missing_dflash_keys(target_dir, target, tmp_path):
    d = write_drafter(tmp_path / "d", target_dir)
    patch_json(d / "config.json", drop=("dflash_config",))
    msg = load_error(DFlashDrafter.from_pretrained, d, target)
    assert msg == f"{d / 'config.json'}: missing dflash_config.mask_token_id", msg
    patch_json(d / "config.json", drop=("block_size",), dflash_config={"mask_token_id": 127})
    msg = load_error(DFlashDrafter.from_pretrained, d, target)
    assert msg == f"{d / 'config.json'}: missing required config keys ['block_size']", msg


@pytest.mark.parametrize("which", ["target", "drafter"])
@pytest.mark.parametrize("text", ['{"hidden_size": 64,', "[1, 2]", '{"hidden_size": "wide"}'])
def test_invalid_config_json(which, text, target_dir, target, tmp_path):
    d = _model_dir(which, target_dir, tmp_path)
    if text.startswith('{"hidden_size": "'):
        patch_json(d / "config.json", hidden_size="wide")
    else:
        (d / "config.json").write_text(text)
    msg = load_error(_loader(which, target), d)
    assert msg.startswith(f"{d / 'config.json'}: "), msg
    expected = {"[": "expected a JSON object, found list", "{": "not valid JSON"}[text[0]]
    if "wide" in text:
        expected = "hidden_size='wide' must be a positive integer"
    assert expected in msg, msg


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_pickle_only_directory_is_refused(which, target_dir, target, tmp_path):
    d = _model_dir(which, target_dir, tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    msg = load_error(_loader(which, target), d)
    assert "['pytorch_model.bin']" in msg and "pickle checkpoints are not loaded" in msg, msg
    if which == "drafter":  # the converter refuses too, instead of writing an empty checkpoint
        out = tmp_path / "hf"
        msg = load_error(zlab_to_hf_assistant, d, target_dir, out)
        assert "pickle checkpoints are not loaded" in msg
        assert not (out / "model.safetensors").exists()


def test_conditioner_wrong_hidden_size(target_dir, target, tmp_path):
    d = write_drafter(tmp_path / "d", target_dir)
    write_conditioner(d, 32)
    msg = load_error(DFlashDrafter.from_pretrained, d, target)
    assert msg == f"{d / 'retrace_config.json'}: hidden_size 32 != drafter hidden_size 64", msg
    # config edited to claim the right size: the weights still give it away
    patch_json(d / "retrace_config.json", hidden_size=64)
    msg = load_error(DFlashDrafter.from_pretrained, d, target)
    assert msg.startswith(f"{d / 'retrace.safetensors'}: weights do not match the config"), msg
    assert "value.weight: file (32, 32) vs expected (64, 64)" in msg
    # a DFlash-only load ignores the conditioner
    assert DFlashDrafter.from_pretrained(d, target, load_conditioner=False).conditioner is None


def test_conditioner_weights_missing(target_dir, target, tmp_path):
    d = write_drafter(tmp_path / "d", target_dir, conditioner="zero")
    (d / "retrace.safetensors").unlink()
    msg = load_error(DFlashDrafter.from_pretrained, d, target)
    assert msg == f"{d / 'retrace.safetensors'}: file not found (but retrace_config.json is present)", msg


def test_hf_assistant_dir_with_conditioner_file(target_dir, tmp_path):
    """The conditioner's tensors never leak into the drafter's model.safetensors when converting."""
    d = write_drafter(tmp_path / "d", target_dir)
    hf = zlab_to_hf_assistant(d, target_dir, tmp_path / "hf")
    write_conditioner(hf, 64, init="random")
    back = hf_assistant_to_zlab(hf, tmp_path / "back", num_target_layers=4)
    t = Qwen3Target.from_pretrained(target_dir)
    drafter = DFlashDrafter.from_pretrained(back, t)
    assert drafter.conditioner is not None


def test_no_pickle_loading_in_package():
    root = Path(retrace.__file__).parent
    pattern = re.compile(
        r"torch\.load\b|torch\.jit\.load|\bimport\s+(c?pickle|dill|joblib|cloudpickle)\b"
        r"|\bfrom\s+(c?pickle|dill|joblib|cloudpickle)\b|pickle\.loads?\b|allow_pickle\s*=\s*True"
        r"|weights_only\s*=\s*False|use_safetensors\s*=\s*False"
    )
    hits = []
    for f in sorted(root.rglob("*.py")):
        for n, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{f.relative_to(root.parent)}:{n}: {line.strip()}")
    assert not hits, "pickle loading found:\n" + "\n".join(hits)
