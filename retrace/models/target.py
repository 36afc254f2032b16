"""Qwen3 target adapter: a functional forward over HF Qwen3 weights with explicit K/V tensors.

`forward` takes B rows x T new tokens at absolute positions on top of a past K/V of length P per layer
(entries at or beyond `past_len[n]` are masked), and returns logits only at `logits_index`, the hidden
states after each tap layer (HF `hidden_states[i + 1]`), and the new tokens' K/V for the caller's cache.
No transformers cache object is involved, so it exports to ONNX as is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from retrace.errors import CheckpointError
from retrace.models.checkpoint import CheckpointTensors, load_into, weight_files, weights_location
from retrace.models.config import Qwen3Config
from retrace.models.layers import DecoderLayer, RMSNorm, lm_head, past_mask, rope_cos_sin


def _tie_as_transformers(config: Qwen3Config, tensors: Mapping[str, torch.Tensor]) -> Qwen3Config:
    """transformers' rule: `tie_word_embeddings: true` ties the LM head to the embedding unless the checkpoint
    carries an lm_head.weight that differs from it; then that lm_head is used (untied), as here."""
    head, emb = "lm_head.weight", "model.embed_tokens.weight"
    if not (config.tie_word_embeddings and head in tensors and emb in tensors):
        return config  # nothing to compare: the two tables are read only when they are compared
    if torch.equal(tensors[head], tensors[emb]):
        return config
    return dataclasses.replace(config, tie_word_embeddings=False)


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        c = config.layers
        self.embed_tokens = nn.Embedding(config.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3Target(nn.Module):
    def __init__(self, config: Qwen3Config, tap_layers: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tap_layers = tuple(tap_layers)
        self.directory: Path | None = None

    @classmethod
    def from_pretrained(cls, directory: str | Path, tap_layers: tuple[int, ...] = (),
                        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Qwen3Target:
        """The parameters are made in `dtype` on `device` and filled from the checkpoint one tensor at a time
        (models/checkpoint.py `CheckpointTensors`): no other copy of the weights is ever in memory."""
        d = Path(directory)
        config = Qwen3Config.from_dir(d)
        bad = [i for i in tap_layers if not 0 <= int(i) < config.num_hidden_layers]
        if bad:
            raise CheckpointError(f"{d}: tap layers {bad} do not exist in a {config.num_hidden_layers}-layer target")
        files = weight_files(d)
        tensors = CheckpointTensors(files)
        config = _tie_as_transformers(config, tensors)
        with torch.device("meta"):
            model = cls(config, tap_layers)
        model = model.to(dtype).to_empty(device=device)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        # Tied checkpoints may or may not carry lm_head.weight (a copy of the embedding); an untied one must.
        tied = ("lm_head.weight",) if config.tie_word_embeddings else ()
        if not tied and "lm_head.weight" not in tensors:
            raise CheckpointError(
                f"{weights_location(d, files)}: tie_word_embeddings is false in {d / 'config.json'} "
                "but lm_head.weight is missing")
        load_into(model, tensors, weights_location(d, files), optional=tied, ignore_prefixes=tied,
                  config_path=d / "config.json")
        model.directory = d
        return model.eval().requires_grad_(False)

    # Pieces the drafter shares.
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def logits(self, h_normed: torch.Tensor) -> torch.Tensor:
        return lm_head(h_normed, self.lm_head.weight).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_k: list[torch.Tensor],
        past_v: list[torch.Tensor],
        past_len: torch.Tensor,
        logits_index: torch.Tensor | None = None,
        input_valid: torch.Tensor | None = None,
        past_valid: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
    ):
        """tree_mask [N, T, T] bool (optional): which new tokens each new token attends to (a draft tree's
        ancestor-or-self mask, runtime/draft_tree.py) instead of the causal triangle; positions then give
        each node its depth."""
        N, T = input_ids.shape
        P = past_k[0].shape[2]
        x = self.embed(input_ids)
        cos, sin = rope_cos_sin(position_ids, self.config.layers.head_dim, self.config.layers.rope_theta, x.dtype)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        new = causal.expand(N, 1, T, T) if tree_mask is None else tree_mask.unsqueeze(1)
        if input_valid is not None:  # left/right padding inside the new tokens: pads are never keys
            eye = torch.eye(T, dtype=torch.bool, device=x.device)
            new = new & (input_valid[:, None, None, :] | eye)
        mask = torch.cat([past_mask(past_len, P, T, past_valid), new], dim=-1)
        tapped, new_k, new_v = {}, [], []
        for i, layer in enumerate(self.model.layers):
            x, k, v = layer(x, cos, sin, past_k[i], past_v[i], mask)
            new_k.append(k)
            new_v.append(v)
            if i in self.tap_layers:
                tapped[i] = x
        h = self.model.norm(x)
        last = len(self.model.layers) - 1
        if last in tapped:  # HF's last hidden_states entry is already after the final norm
            tapped[last] = h
        taps = torch.cat([tapped[i] for i in self.tap_layers], dim=-1) if tapped else x.new_zeros(N, T, 0)
        if logits_index is not None:
            h = torch.gather(h, 1, logits_index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        return self.logits(h), taps, new_k, new_v

    def empty_past(self, n: int, length: int = 0, dtype: torch.dtype | None = None):
        c = self.config.layers
        dtype = dtype or self.lm_head.weight.dtype
        shape = (n, c.num_key_value_heads, length, c.head_dim)
        return ([torch.zeros(shape, dtype=dtype) for _ in range(c.num_hidden_layers)],
                [torch.zeros(shape, dtype=dtype) for _ in range(c.num_hidden_layers)])
