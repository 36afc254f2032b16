"""Conversions between the z-lab DFlash format and transformers' own DFlash assistant format
(`muse_glimmer_assistant`, run by `target.generate(assistant_model=..., speculation_type="dflash")`).

Weight names are equal except `fc.weight` <-> `encoder.fc.weight` and `hidden_norm.weight` <->
`encoder.output_norm_enc.weight`. transformers' config defaults are not Qwen3's (sliding window, rope theta
5e5, eps 1e-5), so every one of them is written explicitly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from retrace.errors import CheckpointError, UnsupportedConfigError
from retrace.models.checkpoint import atomic_save_tensors, atomic_write_text, read_dir_tensors, weight_files
from retrace.models.config import DrafterConfig, Qwen3Config, read_json

HF_RENAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def _drafter_files(d: Path) -> list[Path]:
    # Never the conditioner's file, and an error (naming any pickles) rather than an empty output.
    return weight_files(d, exclude=("retrace.safetensors",), what="drafter ")


def zlab_to_hf_assistant(drafter_dir: str | Path, target_dir: str | Path, out_dir: str | Path) -> Path:
    src, out = Path(drafter_dir), Path(out_dir)
    cfg = DrafterConfig.from_dir(src)
    tcfg = Qwen3Config.from_dir(target_dir)
    cfg.check_fits(tcfg, src / "config.json")
    lc = cfg.layers
    target_raw = read_json(Path(target_dir) / "config.json")
    hf = {
        "architectures": ["MuseGlimmerAssistantModel"],
        "model_type": "muse_glimmer_assistant",
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_hidden_layers": lc.num_hidden_layers,
        "num_attention_heads": lc.num_attention_heads,
        "num_key_value_heads": lc.num_key_value_heads,
        "head_dim": lc.head_dim,
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": lc.rope_theta},
        "layer_types": ["full_attention"] * lc.num_hidden_layers,
        "max_position_embeddings": tcfg.max_position_embeddings,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": list(cfg.target_layer_ids),
        "bos_token_id": target_raw.get("bos_token_id"),
        "eos_token_id": target_raw.get("eos_token_id"),
        "pad_token_id": target_raw.get("pad_token_id"),
        "torch_dtype": "float32",
    }
    tensors = read_dir_tensors(src, _drafter_files(src))
    tensors = {HF_RENAMES.get(k, k): v for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    atomic_save_tensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(hf, indent=2) + "\n")
    return out


def hf_assistant_to_zlab(hf_dir: str | Path, out_dir: str | Path, num_target_layers: int) -> Path:
    src, out = Path(hf_dir), Path(out_dir)
    hf = read_json(src / "config.json")
    if hf.get("model_type") != "muse_glimmer_assistant":
        raise CheckpointError(f"{src / 'config.json'}: model_type {hf.get('model_type')!r} is not "
                              "muse_glimmer_assistant")
    # transformers' defaults for these belong to another model family: insist on explicit values.
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "block_size",
                           "mask_token_id", "target_layer_ids")
               if hf.get(k) is None]
    if missing:
        raise CheckpointError(f"{src / 'config.json'}: missing required config keys {missing}")
    raw = {k: hf[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size", "block_size") if k in hf}
    # transformers' own defaults for this config class (not Qwen3's): rope theta 5e5, sliding-window layers.
    if hf.get("rope_parameters"):
        raw["rope_parameters"] = hf["rope_parameters"]
    elif hf.get("rope_theta") is not None:  # older form; transformers 5 reads it into rope_parameters
        raw["rope_theta"] = hf["rope_theta"]
        raw["rope_scaling"] = hf.get("rope_scaling")
    else:
        raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    if not hf.get("layer_types"):
        raise UnsupportedConfigError(
            f"{src / 'config.json'}: no layer_types, so transformers runs every layer with sliding-window "
            f"attention (window {hf.get('sliding_window', 2048)}); only full_attention is supported")
    raw["layer_types"] = hf["layer_types"]
    raw["num_target_layers"] = num_target_layers
    raw["dflash_config"] = {"mask_token_id": hf["mask_token_id"], "target_layer_ids": hf["target_layer_ids"]}
    cfg = DrafterConfig.from_dict(raw, src / "config.json")
    back = {v: k for k, v in HF_RENAMES.items()}
    tensors = {back.get(k, k): v for k, v in read_dir_tensors(src, _drafter_files(src)).items()}
    out.mkdir(parents=True, exist_ok=True)
    atomic_save_tensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
    atomic_write_text(out / "config.json", json.dumps(cfg.to_zlab_dict(), indent=2) + "\n")
    for extra in ("retrace_config.json", "retrace.safetensors"):
        if (src / extra).is_file():
            shutil.copy2(src / extra, out / extra)
    return out
