"""retrace.export.tensorrt_llm on a tiny random Qwen3 written by transformers: the TensorRT-LLM >= 1.3
DFlash deployment files, and the <= 1.2 checkpoint converter (names, shapes, the q/k/v concat and
the up/gate swap checked against the HF tensors, tied and untied embeddings)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from retrace.errors import CheckpointError, RetraceError
from retrace.export import tensorrt_llm as tl

transformers = pytest.importorskip("transformers")


def _hf_qwen3(path, tie: bool, seed: int = 0):
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, intermediate_size=128, vocab_size=256, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


def _drafter(path, block_size=8, mask=255, layer_ids=(0, 1), hidden=64, **extra):
    path.mkdir(parents=True)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "vocab_size": 256,
           "block_size": block_size, "num_target_layers": 2,
           "dflash_config": {"mask_token_id": mask, "target_layer_ids": list(layer_ids)}, **extra}
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({"fc.weight": torch.zeros(hidden, hidden * len(layer_ids))}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("tie", [False, True])
def test_convert_qwen3_checkpoint(tmp_path, tie, capsys):
    hf = _hf_qwen3(tmp_path / "hf", tie)
    assert ("lm_head.weight" in hf) is not tie  # transformers omits the tied head from the file
    res = tl.convert_qwen3_checkpoint(tmp_path / "hf", tmp_path / "ckpt", dtype="auto", max_batch_size=4)
    assert res["command"] in capsys.readouterr().out
    assert res["command"].startswith("trtllm-build --checkpoint_dir") and "--max_batch_size 4" in res["command"]
    w = load_file(str(res["weights"]))
    names = {"transformer.vocab_embedding.weight", "transformer.ln_f.weight", "lm_head.weight"}
    for i in range(2):
        names |= {f"transformer.layers.{i}.{n}.weight" for n in (
            "attention.qkv", "attention.dense", "attention.q_layernorm", "attention.k_layernorm", "mlp.gate",
            "mlp.fc", "mlp.proj", "input_layernorm", "post_layernorm")}
    assert set(w) == names
    for i in range(2):
        h, t = f"model.layers.{i}.", f"transformer.layers.{i}."
        qkv = w[t + "attention.qkv.weight"]
        assert qkv.shape == (4 * 16 + 2 * 2 * 16, 64)  # q (64) + k (32) + v (32) rows
        assert torch.equal(qkv[:64], hf[h + "self_attn.q_proj.weight"])
        assert torch.equal(qkv[64:96], hf[h + "self_attn.k_proj.weight"])
        assert torch.equal(qkv[96:], hf[h + "self_attn.v_proj.weight"])
        assert torch.equal(w[t + "mlp.gate.weight"], hf[h + "mlp.up_proj.weight"])  # gate <- up_proj
        assert torch.equal(w[t + "mlp.fc.weight"], hf[h + "mlp.gate_proj.weight"])  # fc <- gate_proj
        assert torch.equal(w[t + "mlp.proj.weight"], hf[h + "mlp.down_proj.weight"])
        assert not torch.equal(w[t + "mlp.gate.weight"], w[t + "mlp.fc.weight"])
        assert torch.equal(w[t + "attention.dense.weight"], hf[h + "self_attn.o_proj.weight"])
        assert torch.equal(w[t + "attention.q_layernorm.weight"], hf[h + "self_attn.q_norm.weight"])
        assert torch.equal(w[t + "attention.k_layernorm.weight"], hf[h + "self_attn.k_norm.weight"])
        assert torch.equal(w[t + "input_layernorm.weight"], hf[h + "input_layernorm.weight"])
        assert torch.equal(w[t + "post_layernorm.weight"], hf[h + "post_attention_layernorm.weight"])
        assert w[t + "mlp.fc.weight"].shape == (128, 64) and w[t + "mlp.proj.weight"].shape == (64, 128)
    assert torch.equal(w["transformer.vocab_embedding.weight"], hf["model.embed_tokens.weight"])
    assert torch.equal(w["transformer.ln_f.weight"], hf["model.norm.weight"])
    head = hf["model.embed_tokens.weight"] if tie else hf["lm_head.weight"]
    assert torch.equal(w["lm_head.weight"], head)
    if not tie:
        assert not torch.equal(w["lm_head.weight"], w["transformer.vocab_embedding.weight"])
    cfg = json.loads(res["config"].read_text())
    assert (cfg["architecture"], cfg["qwen_type"], cfg["dtype"]) == ("Qwen3ForCausalLM", "qwen3", "float32")
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_size"], cfg["intermediate_size"], cfg["vocab_size"]) == (64, 2, 4, 2, 16, 128, 256)
    assert cfg["tie_word_embeddings"] is tie and cfg["mapping"]["world_size"] == 1
    assert cfg["position_embedding_type"] == "rope_gpt_neox" and cfg["attn_bias"] is False


def test_convert_dtype_and_refusals(tmp_path):
    _hf_qwen3(tmp_path / "hf", tie=False)
    res = tl.convert_qwen3_checkpoint(tmp_path / "hf", tmp_path / "ckpt16", dtype="fp16", print_command=False)
    w = load_file(str(res["weights"]))
    assert all(t.dtype == torch.float16 for t in w.values())
    assert json.loads(res["config"].read_text())["dtype"] == "float16"
    with pytest.raises(RetraceError, match="dtype"):
        tl.convert_qwen3_checkpoint(tmp_path / "hf", tmp_path / "x", dtype="int8", print_command=False)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickle"):
        tl.convert_qwen3_checkpoint(pickled, tmp_path / "y", print_command=False)


def test_trtllm_build_command_for_external_drafts():
    cmd = tl.trtllm_build_command("/c", "/e", max_draft_len=15)
    assert "--speculative_decoding_mode draft_tokens_external" in cmd and "--max_draft_len 15" in cmd


def test_write_trtllm_deployment(tmp_path):
    _hf_qwen3(tmp_path / "target", tie=True)
    drafter = _drafter(tmp_path / "drafter", block_size=8, mask=255, layer_ids=(0, 1))
    (drafter / "retrace_config.json").write_text("{}")
    res = tl.write_trtllm_deployment(tmp_path / "target", drafter, tmp_path / "out", max_batch_size=2,
                                     max_seq_len=512)
    out = tmp_path / "out"
    assert (out / "target").is_symlink() and (out / "target" / "config.json").is_file()
    assert (out / "drafter" / "config.json").is_file()
    spec = res["speculative_config"]
    assert spec == {"decoding_type": "DFlash", "max_draft_len": 7,
                    "speculative_model": str((out / "drafter").absolute()),
                    "mask_token_id": 255, "target_layer_ids": [0, 1], "attention_backend": "TRTLLM"}
    serve = res["serve"].read_text()
    assert res["serve"].stat().st_mode & 0o111
    assert ('trtllm-serve "$HERE/target"' in serve
            and '--extra_llm_api_options "$HERE/extra_llm_api_options.yaml"' in serve)
    assert "--max_batch_size 2 --max_seq_len 512" in serve
    assert subprocess.run(["bash", "-n", str(res["serve"])]).returncode == 0
    src = res["python"].read_text()
    compile(src, "run_llm.py", "exec")
    assert "DFlashDecodingConfig(speculative_model=str(HERE / \"drafter\"), max_draft_len=7, mask_token_id=255, " \
           "target_layer_ids=[0, 1], attention_backend='TRTLLM')" in src
    assert res["notes"] and "conditioner" in res["notes"][0] and "conditioner" in res["readme"].read_text()
    # copies instead of links, and a shorter draft
    res = tl.write_trtllm_deployment(tmp_path / "target", drafter, tmp_path / "out", link="copy", max_draft_len=3)
    assert not (out / "target").is_symlink() and (out / "target" / "model.safetensors").is_file()
    assert res["speculative_config"]["max_draft_len"] == 3
    yaml = pytest.importorskip("yaml")  # the hand-written YAML parses to the same mapping
    assert yaml.safe_load(res["yaml"].read_text()) == {"speculative_config": res["speculative_config"]}


def test_deployment_refuses_mismatched_drafter(tmp_path):
    _hf_qwen3(tmp_path / "target", tie=False)
    with pytest.raises(CheckpointError, match="does not fit"):
        tl.write_trtllm_deployment(tmp_path / "target", _drafter(tmp_path / "d1", hidden=32), tmp_path / "o")
    with pytest.raises(CheckpointError, match="target_layer_ids"):
        tl.write_trtllm_deployment(tmp_path / "target", _drafter(tmp_path / "d2", layer_ids=(0, 5)), tmp_path / "o")
    with pytest.raises(RetraceError, match="max_draft_len"):
        tl.write_trtllm_deployment(tmp_path / "target", _drafter(tmp_path / "d3"), tmp_path / "o", max_draft_len=8)
    with pytest.raises(RetraceError, match="link mode"):
        tl.write_trtllm_deployment(tmp_path / "target", _drafter(tmp_path / "d4"), tmp_path / "o", link="move")
    assert not (tmp_path / "o").exists()  # refused before anything was written


# DFlashDecodingConfig's fields (TensorRT-LLM 1.3 LLM API reference, tensorrt_llm.llmapi.DFlashDecodingConfig)
DFLASH_FIELDS = {"max_draft_len", "max_total_draft_tokens", "speculative_model", "max_concurrency",
                 "draft_len_schedule", "load_format", "acceptance_rate_window_size", "acceptance_rate_threshold",
                 "use_rejection_sampling", "allow_advanced_sampling", "advanced_sampling_mode", "enable_penalty",
                 "mask_token_id", "target_layer_ids", "decoding_type", "attention_backend"}


@pytest.mark.parametrize("link", ["symlink", "copy", "hardlink"])
def test_deployment_files_and_yaml_keys(tmp_path, link):
    """The drafter directory holds only what TensorRT-LLM loads (its HF loader reads every *.safetensors
    there: the conditioner's tensors would be unknown keys); the YAML parses to documented keys only."""
    yaml = pytest.importorskip("yaml")
    _hf_qwen3(tmp_path / "target", tie=True)
    drafter = _drafter(tmp_path / "drafter")
    (drafter / "retrace_config.json").write_text("{}")
    save_file({"refine.weight": torch.zeros(2, 2)}, str(drafter / "retrace.safetensors"))
    (drafter / "tokenizer_dir").mkdir()
    (drafter / "tokenizer_dir" / "vocab.json").write_text("{}")
    out = tmp_path / "out"
    tl.write_trtllm_deployment(tmp_path / "target", drafter, out, link=link, attention_backend="VANILLA")
    files = sorted((Path(d) / f).relative_to(out).as_posix() for d, _, names in os.walk(out, followlinks=True)
                   for f in names if not Path(d).relative_to(out).as_posix().startswith("target"))
    assert files == ["DEPLOYMENT.md", "drafter/config.json", "drafter/model.safetensors",
                     "drafter/tokenizer_dir/vocab.json", "extra_llm_api_options.yaml", "run_llm.py", "serve.sh"]
    assert not (out / "drafter").is_symlink()
    assert (out / "drafter" / "model.safetensors").read_bytes() == (drafter / "model.safetensors").read_bytes()
    options = yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())
    assert set(options) == {"speculative_config"}
    spec = options["speculative_config"]
    assert set(spec) <= DFLASH_FIELDS and spec["decoding_type"] == "DFlash" and spec["attention_backend"] == "VANILLA"
    assert (drafter / "retrace.safetensors").is_file()  # the source is untouched
    with pytest.raises(RetraceError, match="attention_backend must be one of TRTLLM, VANILLA, FA4"):
        tl.write_trtllm_deployment(tmp_path / "target", drafter, tmp_path / "o2", attention_backend="flash")
