"""Builders for tiny, random, on-disk checkpoints used across the test suite.

Everything here writes real files in the formats users bring: a transformers `Qwen3ForCausalLM`
directory (written by `save_pretrained`, optionally rewritten to the transformers 4.x config form) and a
z-lab style DFlash drafter directory (`config.json` with `dflash_config`, `model.safetensors`), with an
optional ReTrace conditioner beside it. Weights are random but deterministic (seeded), and norm weights
are perturbed away from 1 so that a missing or misplaced norm shows up in parity tests.
"""

from __future__ import annotations

import contextlib
import http.client
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = [
    "TinyPair",
    "write_target",
    "write_drafter",
    "write_conditioner",
    "load_hf_target",
    "patch_json",
    "randomize_",
    "max_diff",
]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| as a Python float (0.0 for empty tensors)."""
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item()


def patch_json(path: str | Path, drop: tuple[str, ...] = (), **updates) -> dict:
    """Rewrite a JSON file in place: remove the keys in `drop`, then set `updates`. Returns the new dict."""
    p = Path(path)
    cfg = json.loads(p.read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(updates)
    p.write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.08) -> None:
    """Deterministically overwrite every parameter: norm weights ~ 1 + 0.2 N(0,1), the rest ~ std N(0,1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise * 0.25)
            else:
                p.copy_(noise * std)


def write_target(
    directory: str | Path,
    *,
    vocab: int = 128,
    hidden: int = 64,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 96,
    tie: bool = False,
    rope_theta: float = 10000.0,
    rope_form: str = "rope_parameters",
    max_pos: int = 512,
    eos_token_id: int | None = None,
    seed: int = 0,
) -> Path:
    """Write a random Qwen3ForCausalLM HF directory with `save_pretrained` and return its path.

    rope_form: "rope_parameters" keeps what transformers 5 writes (`rope_parameters: {rope_type, rope_theta}`);
    "rope_theta" rewrites config.json to the transformers 4.x form (top-level `rope_theta`, `rope_scaling: null`).
    head_dim defaults to hidden // heads.
    """
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    d = Path(directory)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen3ForCausalLM(cfg)
    randomize_(model, seed)
    model.save_pretrained(d)
    if rope_form == "rope_theta":
        patch_json(d / "config.json", drop=("rope_parameters",), rope_theta=rope_theta, rope_scaling=None)
    elif rope_form != "rope_parameters":
        raise ValueError(f"rope_form must be 'rope_parameters' or 'rope_theta', got {rope_form!r}")
    return d


def load_hf_target(directory: str | Path):
    """transformers' own Qwen3ForCausalLM on a directory (fp32, eager attention, eval mode)."""
    from transformers import Qwen3ForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return Qwen3ForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


def write_drafter(
    directory: str | Path,
    target_dir: str | Path,
    *,
    layers: int = 1,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    mask_token_id: int | None = None,
    intermediate: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    vocab: int | None = None,
    rope_form: str = "rope_theta",
    conditioner: str | None = None,
    seed: int = 1,
    config_overrides: dict | None = None,
) -> Path:
    """Write a random z-lab style DFlash drafter directory for the target in `target_dir`.

    Sizes default to the target's (hidden, heads, kv heads, head_dim, vocab, rope theta, eps);
    target_layer_ids=None omits them (the loader then uses z-lab's default from num_target_layers);
    mask_token_id defaults to vocab - 1; rope_form "rope_theta" (z-lab, transformers 4.x) or
    "rope_parameters" (transformers 5); conditioner: None, "zero" or "random" writes a ReTrace conditioner
    beside it; config_overrides are applied to config.json last (use them to write broken configs).
    """
    t = json.loads((Path(target_dir) / "config.json").read_text())
    theta = t["rope_parameters"]["rope_theta"] if "rope_parameters" in t else t["rope_theta"]
    hidden = hidden or t["hidden_size"]
    heads = heads or t["num_attention_heads"]
    kv_heads = kv_heads or t["num_key_value_heads"]
    head_dim = head_dim or t.get("head_dim") or hidden // heads
    vocab = vocab or t["vocab_size"]
    inter = intermediate or t["intermediate_size"]
    n_target = t["num_hidden_layers"]
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": t["rms_norm_eps"],
        "vocab_size": vocab,
        "max_position_embeddings": t["max_position_embeddings"],
        "num_target_layers": n_target,
        "block_size": block_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "dflash_config": {"mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id},
    }
    if rope_form == "rope_theta":
        cfg["rope_theta"] = theta
        cfg["rope_scaling"] = None
    elif rope_form == "rope_parameters":
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        raise ValueError(f"rope_form must be 'rope_parameters' or 'rope_theta', got {rope_form!r}")
    # z-lab's default (no target_layer_ids in the config) is one tap per drafter layer.
    n_taps = layers if target_layer_ids is None else len(target_layer_ids)
    if target_layer_ids is not None:
        cfg["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    cfg.update(config_overrides or {})

    g = torch.Generator().manual_seed(seed)

    def lin(o: int, i: int) -> torch.Tensor:
        return torch.randn(o, i, generator=g) * 0.08

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    w = {"fc.weight": lin(hidden, n_taps * hidden), "hidden_norm.weight": norm(hidden), "norm.weight": norm(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = lin(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = lin(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = lin(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = lin(hidden, heads * head_dim)
        w[p + "self_attn.q_norm.weight"] = norm(head_dim)
        w[p + "self_attn.k_norm.weight"] = norm(head_dim)
        w[p + "mlp.gate_proj.weight"] = lin(inter, hidden)
        w[p + "mlp.up_proj.weight"] = lin(inter, hidden)
        w[p + "mlp.down_proj.weight"] = lin(hidden, inter)
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if conditioner is not None:
        write_conditioner(d, hidden, init=conditioner, seed=seed)
    return d


def write_conditioner(drafter_dir: str | Path, hidden: int, init: str = "zero", seed: int = 0) -> None:
    """Write a ReTrace conditioner (retrace_config.json + retrace.safetensors) beside a drafter."""
    from retrace.models.conditioner import ReTraceConditioner

    cond = ReTraceConditioner(hidden)
    cond.reset(init=init, seed=seed)
    cond.save(drafter_dir)


@dataclass
class TinyPair:
    """Paths of a freshly written tiny target (HF Qwen3 dir) and drafter (z-lab DFlash dir)."""

    target_dir: Path
    drafter_dir: Path

    def load(self, dtype: torch.dtype = torch.float32, load_conditioner: bool = True):
        """(Qwen3Target with the drafter's taps, DFlashDrafter) via retrace.models.drafter.load_pair."""
        from retrace.models.drafter import load_pair

        return load_pair(self.target_dir, self.drafter_dir, dtype=dtype, load_conditioner=load_conditioner)

    def hf_target(self):
        """transformers' Qwen3ForCausalLM on the same target dir (fp32, eager attention)."""
        return load_hf_target(self.target_dir)


def http_json(port: int, method: str, path: str, body=None, timeout: float = 60.0, parse: bool = True):
    """One HTTP request to 127.0.0.1:port with a JSON body -> (status, parsed JSON, or the raw text when it is
    not JSON or parse is False)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode()
        if not parse:
            return resp.status, raw
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw
    finally:
        conn.close()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(app, server_cls=None):
    """uvicorn serving `app` on a free loopback port in a daemon thread, once it has started -> (server,
    thread, port); stopped and joined on exit (server_cls: a uvicorn.Server subclass, e.g. `retrace serve`'s)."""
    import threading
    import time

    import uvicorn

    port = free_port()
    server = (server_cls or uvicorn.Server)(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started
    try:
        yield server, thread, port
    finally:
        server.should_exit = True
        thread.join(30)
