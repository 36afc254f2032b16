"""TensorRT-LLM deployments of a Qwen3 target with its DFlash drafter.

(a) TensorRT-LLM >= 1.3 (PyTorch backend, the only one since the TensorRT engine backend was removed):
    DFlash is built in (`DFlashDecodingConfig`, one-model speculative decoding). `write_trtllm_deployment`
    lays out the target and drafter checkpoints side by side, `extra_llm_api_options.yaml` with
    `speculative_config: {decoding_type: DFlash, max_draft_len, speculative_model, mask_token_id,
    target_layer_ids, attention_backend}` (field names as in tensorrt_llm.llmapi.DFlashDecodingConfig;
    `speculative_model` was `speculative_model_dir` before TensorRT-LLM 1.2, which still accepts the old
    name as an alias; the drafter's `attention_backend` defaults to VANILLA, the reference kernels, so
    the deployment asks for TRTLLM, the optimised one), `serve.sh` (trtllm-serve) and `run_llm.py` (the
    LLM API). TensorRT-LLM runs the DFlash drafter: a ReTrace conditioner beside it is not used there
    (the deployment notes say so), and its files are left out of the drafter directory, since
    TensorRT-LLM's HF weight loader reads every `*.safetensors` file it finds there.

(b) TensorRT-LLM <= 1.2 (TensorRT engines): `convert_qwen3_checkpoint` writes the TensorRT-LLM checkpoint
    of the target (config.json + rank0.safetensors, tp=pp=1) for `trtllm-build`; those versions have no
    DFlash, so this serves the target alone (or as the verifier of external draft tokens).

Only JSON and safetensors are read (never pickles); nothing here imports tensorrt_llm.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import torch

from retrace.errors import CheckpointError, RetraceError
from retrace.models.checkpoint import atomic_save_tensors, atomic_write_text, read_tensors, weight_files
from retrace.models.config import DrafterConfig, Qwen3Config, read_json

LINK_MODES = ("symlink", "copy", "hardlink")
CONDITIONER_FILES = ("retrace_config.json", "retrace.safetensors")
# DFlashDecodingConfig.attention_backend (the drafter's attention): TRTLLM the optimised kernels, VANILLA
# TensorRT-LLM's default reference path, FA4 FlashAttention-4 (TensorRT-LLM 1.3.0rc27 and later)
ATTENTION_BACKENDS = ("TRTLLM", "VANILLA", "FA4")


# ---- (a) TensorRT-LLM >= 1.3: DFlash through the LLM API ------------------------------------------------


def speculative_config(drafter: DrafterConfig, speculative_model: str, max_draft_len: int | None = None,
                       attention_backend: str = "TRTLLM") -> dict:
    """The `speculative_config` mapping of TensorRT-LLM's DFlashDecodingConfig for this drafter."""
    draft_len = drafter.block_size - 1 if max_draft_len is None else int(max_draft_len)
    if not 1 <= draft_len <= drafter.block_size - 1:
        raise RetraceError(f"max_draft_len must be in 1..{drafter.block_size - 1} (block_size - 1), got {draft_len}")
    if attention_backend not in ATTENTION_BACKENDS:
        raise RetraceError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                           f"got {attention_backend!r}")
    return {
        "decoding_type": "DFlash",
        "max_draft_len": draft_len,
        "speculative_model": speculative_model,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
        "attention_backend": attention_backend,
    }


def _yaml_scalar(v) -> str:
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_yaml_scalar(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a valid double-quoted YAML scalar


def to_yaml(mapping: dict, indent: int = 0) -> str:
    """Plain nested mappings of scalars and scalar lists as YAML (no PyYAML needed)."""
    lines = []
    for key, value in mapping.items():
        if isinstance(value, dict):
            lines.append(" " * indent + f"{key}:")
            lines.append(to_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(" " * indent + f"{key}: {_yaml_scalar(value)}")
    return "\n".join(lines) + "\n"


def _clear(dst: Path) -> None:
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.is_dir():
        shutil.rmtree(dst)


def _place(src: Path, dst: Path, mode: str) -> None:
    _clear(dst)
    if mode == "symlink":
        dst.symlink_to(src.resolve(), target_is_directory=True)
    elif mode == "copy":
        shutil.copytree(src, dst)
    else:  # hardlink
        shutil.copytree(src, dst, copy_function=os.link)


def _place_drafter(src: Path, dst: Path, mode: str) -> None:
    """The drafter directory without the ReTrace conditioner's files: a real directory whose entries are
    linked or copied one by one (a link to the whole directory would expose them to TensorRT-LLM)."""
    _clear(dst)
    dst.mkdir(parents=True)
    for entry in sorted(src.iterdir()):
        if entry.name in CONDITIONER_FILES:
            continue
        if entry.is_dir():
            _place(entry, dst / entry.name, mode)
        elif mode == "symlink":
            (dst / entry.name).symlink_to(entry.resolve())
        elif mode == "copy":
            shutil.copy2(entry, dst / entry.name)
        else:
            os.link(entry, dst / entry.name)


def serve_script(max_batch_size: int, max_seq_len: int, host: str = "127.0.0.1", port: int = 8000) -> str:
    return f"""#!/usr/bin/env bash
# trtllm-serve (TensorRT-LLM >= 1.3, PyTorch backend: the default) with DFlash speculative decoding.
# OpenAI-compatible API on http://$HOST:$PORT/v1 ; extra arguments are passed to trtllm-serve.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
exec trtllm-serve "$HERE/target" \\
    --host "${{HOST:-{host}}}" --port "${{PORT:-{port}}}" \\
    --max_batch_size {int(max_batch_size)} --max_seq_len {int(max_seq_len)} \\
    --extra_llm_api_options "$HERE/extra_llm_api_options.yaml" "$@"
"""


def llm_api_snippet(spec: dict, max_batch_size: int, max_seq_len: int) -> str:
    kw = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k not in ("decoding_type", "speculative_model"))
    return f'''"""DFlash speculative decoding through TensorRT-LLM's LLM API (TensorRT-LLM >= 1.3)."""

from pathlib import Path

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import DFlashDecodingConfig

HERE = Path(__file__).resolve().parent


def main():
    spec = DFlashDecodingConfig(speculative_model=str(HERE / "drafter"), {kw})
    llm = LLM(model=str(HERE / "target"), speculative_config=spec, max_batch_size={int(max_batch_size)},
              max_seq_len={int(max_seq_len)})
    prompts = ["def fibonacci(n):"]
    for out in llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0)):
        print(out.outputs[0].text)


if __name__ == "__main__":
    main()
'''


def write_trtllm_deployment(target_dir: str | Path, drafter_dir: str | Path, out: str | Path, *,
                            link: str = "symlink", max_draft_len: int | None = None, max_batch_size: int = 8,
                            max_seq_len: int = 4096, host: str = "127.0.0.1", port: int = 8000,
                            attention_backend: str = "TRTLLM") -> dict:
    """Write a TensorRT-LLM (>= 1.3) DFlash deployment into `out`:

        out/target/   the HF target dir (symlink, copy or hardlinks, per `link`)
        out/drafter/  the z-lab DFlash drafter dir's files (same), without the ReTrace conditioner's
        out/extra_llm_api_options.yaml, out/serve.sh, out/run_llm.py, out/DEPLOYMENT.md

    The drafter must fit the target (hidden size, vocab, mask id, tap layers). Returns a dict with the
    paths, the speculative_config mapping and notes (e.g. a ReTrace conditioner that will not be used)."""
    target_dir, drafter_dir, out = Path(target_dir), Path(drafter_dir), Path(out)
    target = Qwen3Config.from_dir(target_dir)
    drafter = DrafterConfig.from_dir(drafter_dir)
    drafter.check_fits(target, drafter_dir)
    weight_files(target_dir, what="target ")  # refuse pickle-only checkpoints early
    if link not in LINK_MODES:
        raise RetraceError(f"link mode must be one of {LINK_MODES}, got {link!r}")
    spec = speculative_config(drafter, str((out / "drafter").absolute()), max_draft_len, attention_backend)
    out.mkdir(parents=True, exist_ok=True)
    _place(target_dir, out / "target", link)
    _place_drafter(drafter_dir, out / "drafter", link)
    notes = []
    if any((drafter_dir / f).exists() for f in CONDITIONER_FILES):
        notes.append("the drafter has a ReTrace conditioner (retrace_config.json): TensorRT-LLM's DFlash does not "
                     "apply it, so this deployment decodes as plain DFlash (still lossless); its files are left out "
                     "of drafter/")
    yaml_text = ("# TensorRT-LLM >= 1.3 LLM API options (trtllm-serve --extra_llm_api_options)\n"
                 + to_yaml({"speculative_config": spec}))
    paths = {"yaml": out / "extra_llm_api_options.yaml", "serve": out / "serve.sh", "python": out / "run_llm.py",
             "readme": out / "DEPLOYMENT.md"}
    atomic_write_text(paths["yaml"], yaml_text)
    atomic_write_text(paths["serve"], serve_script(max_batch_size, max_seq_len, host, port))
    paths["serve"].chmod(0o755)
    atomic_write_text(paths["python"], llm_api_snippet(spec, max_batch_size, max_seq_len))
    readme = ["# TensorRT-LLM DFlash deployment", "",
              "Needs TensorRT-LLM >= 1.3 (`pip install tensorrt_llm`) on a Linux machine with an NVIDIA GPU.", "",
              "    ./serve.sh            # OpenAI-compatible server (trtllm-serve)",
              "    python run_llm.py     # the same through the LLM API", "",
              f"speculative_config: max_draft_len={spec['max_draft_len']} (block_size - 1), "
              f"mask_token_id={spec['mask_token_id']}, target_layer_ids={spec['target_layer_ids']}, "
              f"attention_backend={spec['attention_backend']} (the drafter's attention kernels)."]
    readme += [f"Note: {n}." for n in notes]
    atomic_write_text(paths["readme"], "\n".join(readme) + "\n")
    return {**paths, "speculative_config": spec, "notes": notes}


# ---- (b) TensorRT-LLM <= 1.2: Qwen3 checkpoint for trtllm-build -------------------------------------------

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}


def _resolve_dtype(dtype: str, raw: dict) -> str:
    if dtype == "auto":
        dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in _DTYPES:
        raise RetraceError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {dtype!r}")
    return dtype


def trtllm_checkpoint_config(target: Qwen3Config, raw: dict, dtype: str) -> dict:
    """config.json of a TensorRT-LLM (<= 1.2) Qwen3 checkpoint, single GPU."""
    lc = target.layers
    return {
        "architecture": "Qwen3ForCausalLM",
        "qwen_type": "qwen3",
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": target.vocab_size,
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_hidden_layers": lc.num_hidden_layers,
        "num_attention_heads": lc.num_attention_heads,
        "num_key_value_heads": lc.num_key_value_heads,
        "head_size": lc.head_dim,
        "max_position_embeddings": target.max_position_embeddings,
        "seq_length": int(raw.get("seq_length", 8192)),
        "hidden_act": "silu",
        "norm_epsilon": lc.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": lc.rope_theta,
        "rotary_scaling": None,
        "rotary_embedding_dim": None,
        "attn_bias": False,
        "mlp_bias": False,
        "use_logn_attn": False,
        "tie_word_embeddings": target.tie_word_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "disable_weight_only_quant_plugin": False,
        "num_labels": 1,
        "moe": {"num_experts": 0, "top_k": 0, "normalization_mode": 0},
        "moe_intermediate_size": 0,
        "moe_shared_expert_intermediate_size": 0,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1, "cp_size": 1, "moe_tp_size": 1,
                    "moe_ep_size": 1, "gpus_per_node": 8},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }


def convert_weights(hf: dict[str, torch.Tensor], target: Qwen3Config, dtype: torch.dtype,
                    where: Path | None = None) -> dict[str, torch.Tensor]:
    """HF Qwen3 tensors -> TensorRT-LLM names. Mind the MLP: TensorRT-LLM's GatedMLP computes
    proj(act(fc(x)) * gate(x)), so its `mlp.fc` is HF's gate_proj (the activated branch) and its
    `mlp.gate` is HF's up_proj. q, k, v are concatenated on dim 0. Tied embeddings get an explicit copy
    as lm_head (safetensors stores no shared tensors)."""
    def take(name: str) -> torch.Tensor:
        try:
            return hf[name]
        except KeyError:
            raise CheckpointError(f"{where}: tensor {name!r} not found in the target weights") from None

    out = {"transformer.vocab_embedding.weight": take("model.embed_tokens.weight"),
           "transformer.ln_f.weight": take("model.norm.weight")}
    for i in range(target.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"transformer.layers.{i}."
        qkv = [take(src + f"self_attn.{p}_proj.weight") for p in "qkv"]
        out[dst + "attention.qkv.weight"] = torch.cat(qkv, dim=0)
        out[dst + "attention.dense.weight"] = take(src + "self_attn.o_proj.weight")
        out[dst + "attention.q_layernorm.weight"] = take(src + "self_attn.q_norm.weight")
        out[dst + "attention.k_layernorm.weight"] = take(src + "self_attn.k_norm.weight")
        out[dst + "mlp.gate.weight"] = take(src + "mlp.up_proj.weight")
        out[dst + "mlp.fc.weight"] = take(src + "mlp.gate_proj.weight")
        out[dst + "mlp.proj.weight"] = take(src + "mlp.down_proj.weight")
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_layernorm.weight"] = take(src + "post_attention_layernorm.weight")
    if "lm_head.weight" not in hf:  # tied; a tied config's own lm_head is used, as transformers does
        out["lm_head.weight"] = out["transformer.vocab_embedding.weight"].clone()
    else:
        out["lm_head.weight"] = hf["lm_head.weight"]
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def trtllm_build_command(checkpoint_dir: str | Path, engine_dir: str | Path, max_batch_size: int = 8,
                         max_input_len: int = 2048, max_seq_len: int = 4096, max_draft_len: int | None = None) -> str:
    """The `trtllm-build` command (TensorRT-LLM <= 1.2) for a converted checkpoint. With `max_draft_len` the
    engine accepts externally drafted tokens (draft/target speculative decoding)."""
    args = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
            "--gemm_plugin", "auto", "--max_batch_size", str(max_batch_size), "--max_input_len", str(max_input_len),
            "--max_seq_len", str(max_seq_len)]
    if max_draft_len:
        args += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(max_draft_len),
                 "--use_paged_context_fmha", "enable", "--gather_generation_logits"]
    return shlex.join(args)


def convert_qwen3_checkpoint(hf_dir: str | Path, out_dir: str | Path, dtype: str = "auto", *,
                             print_command: bool = True, **build_kwargs) -> dict:
    """HF Qwen3 directory -> TensorRT-LLM (<= 1.2) checkpoint: `config.json` + `rank0.safetensors`.
    Returns {"config", "weights", "command"}; prints the trtllm-build command unless told not to."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    target = Qwen3Config.from_dir(hf_dir)
    raw = read_json(hf_dir / "config.json")
    dtype_name = _resolve_dtype(dtype, raw)
    hf: dict[str, torch.Tensor] = {}
    for f in weight_files(hf_dir, what="target "):
        hf.update(read_tensors(f))
    tensors = convert_weights(hf, target, _DTYPES[dtype_name], hf_dir)
    config = trtllm_checkpoint_config(target, raw, dtype_name)
    atomic_save_tensors(tensors, out_dir / "rank0.safetensors")
    atomic_write_text(out_dir / "config.json", json.dumps(config, indent=2) + "\n")
    command = trtllm_build_command(out_dir, out_dir / "engine", **build_kwargs)
    if print_command:
        print(command)
    return {"config": out_dir / "config.json", "weights": out_dir / "rank0.safetensors", "command": command}
