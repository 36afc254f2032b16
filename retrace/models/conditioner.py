"""ReTrace conditioner: gated residual fusion of the previous round's rejected suffix into the block.

Stored beside the DFlash files as `retrace_config.json` + `retrace.safetensors`, so DFlash-only tools
still load the directory. The value projection starts at zero: an untrained conditioner IS DFlash.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from retrace.errors import CheckpointError
from retrace.models.checkpoint import atomic_save_tensors, atomic_write_text, load_into, read_tensors
from retrace.models.config import read_json
from retrace.plugins.gated_suffix_fusion import gated_suffix_fusion

CONFIG_NAME = "retrace_config.json"
WEIGHTS_NAME = "retrace.safetensors"
FORMAT = "retrace-conditioner"
FORMAT_VERSION = 1
# Reliability features per memory slot, all computed for free by the verify pass that rejected it.
FEATURES = ("agree", "target_prob", "draft_prob")


class ReTraceConditioner(nn.Module):
    def __init__(self, hidden_size: int, num_features: int = len(FEATURES), gate_bias_init: float = -2.0,
                 rms_norm_eps: float = 1e-6):
        super().__init__()
        d = hidden_size
        self.hidden_size = d
        self.num_features = num_features
        self.gate_bias_init = gate_bias_init
        self.eps = rms_norm_eps
        self.refine = nn.Linear(2 * d, d, bias=False)
        self.gate = nn.Linear(2 * d + num_features, d, bias=True)
        self.value_norm = nn.Parameter(torch.ones(d))
        self.value = nn.Linear(d, d, bias=False)
        self.reset(init="zero")

    def reset(self, init: str = "zero", seed: int = 0, scale: float = 0.02) -> None:
        """zero: refine/gate small random, value exactly 0 (identity op). random: every weight non-zero."""
        if init not in ("zero", "random"):
            raise ValueError(f"unknown conditioner init {init!r} (zero|random)")
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for lin in (self.refine, self.gate, self.value):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, device="cpu") * scale)
            self.gate.bias.fill_(self.gate_bias_init)
            self.value_norm.fill_(1.0)
            if init == "zero":
                self.value.weight.zero_()
            else:
                self.value.weight.mul_(10.0)  # strong enough to visibly change drafts
                self.gate.bias.fill_(0.0)

    def forward(self, x, memory, correction, features, valid) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():  # one retrace::GatedSuffixFusion node (body attached after export)
            from retrace.plugins.onnx_symbolic import symbolic_gated_suffix_fusion

            return symbolic_gated_suffix_fusion(
                x, memory, correction, features, valid,
                self.refine.weight, self.gate.weight, self.gate.bias, self.value_norm, self.value.weight, eps=self.eps,
            )
        return gated_suffix_fusion(
            x, memory, correction, features, valid,
            self.refine.weight, self.gate.weight, self.gate.bias, self.value_norm, self.value.weight, eps=self.eps,
        )

    def mean_gate(self, x, memory, correction, features, valid) -> torch.Tensor:
        """Mean gate value over valid slots (a conditioner that switched itself off shows ~0)."""
        refined = self.refine_states(memory, correction)
        g = torch.sigmoid(self.gate(torch.cat([x, refined, features], dim=-1)))
        w = valid.unsqueeze(-1).to(g.dtype)
        return (g * w).sum() / (w.sum() * g.shape[-1]).clamp_min(1)

    def refine_states(self, memory, correction) -> torch.Tensor:
        return memory + self.refine(torch.cat([memory, correction], dim=-1))

    # -- I/O -------------------------------------------------------------------------------------------
    def config_dict(self) -> dict:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "hidden_size": self.hidden_size,
            "features": list(FEATURES[: self.num_features]),
            "num_features": self.num_features,
            "gate_bias_init": self.gate_bias_init,
            "rms_norm_eps": self.eps,
        }

    def save(self, directory: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Write the conditioner; `tensors`: its full weights by name instead of its own (gathered by a sharded
        trainer)."""
        d = Path(directory)
        own = self.state_dict()
        atomic_save_tensors(own if tensors is None else {k: tensors[k] for k in own}, d / WEIGHTS_NAME,
                            metadata={"format": FORMAT})
        atomic_write_text(d / CONFIG_NAME, json.dumps(self.config_dict(), indent=2) + "\n")

    @staticmethod
    def exists(directory: str | Path) -> bool:
        return (Path(directory) / CONFIG_NAME).is_file()

    @classmethod
    def from_dir(cls, directory: str | Path, hidden_size: int) -> ReTraceConditioner:
        d = Path(directory)
        cfg = read_json(d / CONFIG_NAME)
        if cfg.get("format") != FORMAT or cfg.get("format_version") != FORMAT_VERSION:
            raise CheckpointError(
                f"{d / CONFIG_NAME}: unknown conditioner format {cfg.get('format')!r} version "
                f"{cfg.get('format_version')!r} (expected {FORMAT!r} version {FORMAT_VERSION})"
            )
        if int(cfg.get("hidden_size", -1)) != hidden_size:
            raise CheckpointError(f"{d / CONFIG_NAME}: hidden_size {cfg.get('hidden_size')} != drafter hidden_size "
                                  f"{hidden_size}")
        model = cls(hidden_size, int(cfg.get("num_features", len(FEATURES))), float(cfg.get("gate_bias_init", -2.0)),
                    float(cfg.get("rms_norm_eps", 1e-6)))
        if not (d / WEIGHTS_NAME).is_file():
            raise CheckpointError(f"{d / WEIGHTS_NAME}: file not found (but {CONFIG_NAME} is present)")
        load_into(model, read_tensors(d / WEIGHTS_NAME), d / WEIGHTS_NAME, config_path=d / CONFIG_NAME)
        return model
