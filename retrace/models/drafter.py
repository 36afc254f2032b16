"""DFlash block-diffusion drafter (z-lab checkpoint format).

N Qwen3 decoder layers of the target's width, no embedding or LM head of their own (the target's are
shared, frozen). Context = target hidden states at `target_layer_ids`, concatenated, projected by `fc` and
normalised by `hidden_norm`; the context is never run through the layers: in every layer its K/V are
k_norm(k_proj(ctx)) and v_proj(ctx) (KV injection). The block [anchor, MASK x (B-1)] attends to all context
before the anchor and to itself bidirectionally; slot k predicts the token at anchor position + k.
With a draft vocabulary (retrace.models.draft_vocab, files in the drafter directory) the head scores only
its subset rows of the target's table, and the logits come back at target ids (-inf outside the subset).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from retrace.models.checkpoint import (
    CheckpointTensors,
    atomic_save_tensors,
    atomic_write_text,
    load_into,
    weight_files,
    weights_location,
)
from retrace.models.conditioner import ReTraceConditioner
from retrace.models.config import DrafterConfig, Qwen3Config, read_json
from retrace.models.draft_vocab import TENSORS as DRAFT_VOCAB_TENSORS
from retrace.models.draft_vocab import DraftVocab
from retrace.models.layers import DecoderLayer, RMSNorm, past_mask, rope_cos_sin
from retrace.models.target import Qwen3Target


@dataclass
class SuffixInputs:
    """The previous round's rejected suffix, aligned to this block's slots (see runtime.suffix_memory)."""

    memory: torch.Tensor  # [N, B, d] drafter hidden states of the rejected drafts (zeros where invalid)
    features: torch.Tensor  # [N, B, F] reliability features
    valid: torch.Tensor  # [N, B] float 0/1; slot 0 (the anchor) is never valid
    corr_index: torch.Tensor  # [N, B] int64 index into this call's ctx_taps: the verify taps that scored d_j


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, target: Qwen3Target | None = None,
                 conditioner: ReTraceConditioner | None = None):
        super().__init__()
        c = config.layers
        self.config = config
        self.fc = nn.Linear(config.num_taps * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        # Shared with the target, not saved with the drafter (kept out of state_dict).
        self._target = [target]
        self.conditioner = conditioner
        self.directory: Path | None = None
        self.draft_vocab: DraftVocab | None = None  # None: the full head
        self._subset_weight: torch.Tensor | None = None  # the subset's rows of the target's table (a cache)

    @property
    def target(self) -> Qwen3Target:
        if self._target[0] is None:
            raise RuntimeError("drafter has no target attached (embedding and LM head are the target's)")
        return self._target[0]

    def drafter_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("conditioner.")}

    # -- checkpoint I/O -------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, directory: str | Path, target: Qwen3Target, load_conditioner: bool = True,
                        dtype: torch.dtype | None = None, draft_vocab: bool = True) -> DFlashDrafter:
        """draft_vocab=False: the full head even where the directory has a draft vocabulary."""
        d = Path(directory)
        config = DrafterConfig.from_dir(d)
        config.check_fits(target.config, d / "config.json")
        dtype, device = dtype or target.lm_head.weight.dtype, target.lm_head.weight.device
        with torch.device("meta"):  # made in dtype on the target's device, filled one tensor at a time
            model = cls(config, target)
        model = model.to(dtype).to_empty(device=device)
        if draft_vocab:
            model.draft_vocab = DraftVocab.load(d, target.config.vocab_size)
        files = _drafter_files(d)
        load_into(model, CheckpointTensors(files), weights_location(d, files), config_path=d / "config.json")
        if load_conditioner and ReTraceConditioner.exists(d):
            model.conditioner = ReTraceConditioner.from_dir(d, config.hidden_size)
        model.directory = d
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)

    def save_pretrained(self, directory: str | Path, save_conditioner: bool = True,
                        tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Write the z-lab format; `tensors`: the full weights by state-dict name to write instead of this
        module's own (a sharded trainer gathers them)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        own = self.drafter_state_dict()
        sd = own if tensors is None else {k: tensors[k] for k in own}
        atomic_save_tensors(sd, d / "model.safetensors", metadata={"format": "pt"})
        atomic_write_text(d / "config.json", json.dumps(self.config.to_zlab_dict(), indent=2) + "\n")
        if save_conditioner and self.conditioner is not None:
            pre = "conditioner."
            self.conditioner.save(d, None if tensors is None else
                                  {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)})

    # -- forward ---------------------------------------------------------------------------------------
    def project(self, taps: torch.Tensor) -> torch.Tensor:
        """Target taps [N, C, k*d] -> context features [N, C, d] (fc + hidden_norm)."""
        return self.hidden_norm(self.fc(taps))

    def block_states(self, ctx: torch.Tensor, block_ids: torch.Tensor, suffix: SuffixInputs | None) -> torch.Tensor:
        """The block's input states [N, B, d]: the target's embedding of block_ids, corrected by the
        conditioner from the rejected suffix (ctx: this call's projected context, the corrections' source)."""
        x = self.target.embed(block_ids)
        if suffix is not None and self.conditioner is not None:
            correction = torch.gather(ctx, 1, suffix.corr_index.unsqueeze(-1).expand(-1, -1, ctx.shape[-1]))
            x = self.conditioner(x, suffix.memory, correction, suffix.features, suffix.valid)
        return x

    def forward(
        self,
        ctx_taps: torch.Tensor,
        ctx_positions: torch.Tensor,
        past_k: list[torch.Tensor],
        past_v: list[torch.Tensor],
        past_len: torch.Tensor,
        block_ids: torch.Tensor,
        block_positions: torch.Tensor,
        suffix: SuffixInputs | None = None,
    ):
        """Draft one block. Returns (hidden [N,B,d] after the final norm, logits [N,B-1,V] for slots
        1..B-1, new_k, new_v: per-layer K/V [N,Hkv,C,hd] of the C new context tokens)."""
        lc = self.config.layers
        N, B = block_ids.shape
        C = ctx_taps.shape[1]
        P = past_k[0].shape[2]
        ctx = self.project(ctx_taps)
        x = self.block_states(ctx, block_ids, suffix)
        cos_c, sin_c = rope_cos_sin(ctx_positions, lc.head_dim, lc.rope_theta, x.dtype)
        cos_b, sin_b = rope_cos_sin(block_positions, lc.head_dim, lc.rope_theta, x.dtype)
        # Block queries see: cached context < past_len, new context before the anchor, the whole block.
        ctx_ok = (ctx_positions < block_positions[:, :1])[:, None, None, :].expand(N, 1, B, C)
        block_ok = torch.ones(N, 1, B, B, dtype=torch.bool, device=x.device)
        mask = torch.cat([past_mask(past_len, P, B), ctx_ok, block_ok], dim=-1)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            kc, vc = layer.self_attn.key_value(ctx, cos_c, sin_c)
            x, _, _ = layer(x, cos_b, sin_b, past_k[i], past_v[i], mask, extra_kv=(kc, vc))
            new_k.append(kc)
            new_v.append(vc)
        h = self.norm(x)
        return h, self.logits(h[:, 1:]), new_k, new_v

    def logits(self, h_normed: torch.Tensor, expand: bool = True) -> torch.Tensor:
        """The draft logits [..., V] float32 at target ids: the target's head, or its draft-vocabulary rows
        with -inf outside the subset; expand=False: a draft vocabulary's logits [..., Vd] as they are (the
        runtime's draft space, runtime/draft_space.py)."""
        if self.draft_vocab is None:
            return self.target.logits(h_normed)
        table = self.target.lm_head.weight
        w = self._subset_weight
        if w is None or w.dtype != table.dtype or w.device != table.device:
            w = self._subset_weight = table.index_select(0, self.draft_vocab.ids.to(table.device))
        sub = torch.nn.functional.linear(h_normed, w)
        return self.draft_vocab.expand(sub) if expand else sub

    def empty_past(self, n: int, length: int = 0, dtype: torch.dtype | None = None):
        c = self.config.layers
        dtype = dtype or self.fc.weight.dtype
        shape = (n, c.num_key_value_heads, length, c.head_dim)
        return ([torch.zeros(shape, dtype=dtype) for _ in range(c.num_hidden_layers)],
                [torch.zeros(shape, dtype=dtype) for _ in range(c.num_hidden_layers)])


def _drafter_files(d: Path) -> list[Path]:
    """The drafter's own weight files (the conditioner's retrace.safetensors and a draft vocabulary's map
    live beside them)."""
    return weight_files(d, exclude=("retrace.safetensors", DRAFT_VOCAB_TENSORS), what="drafter ")


def new_drafter_config(target: Qwen3Target, num_layers: int = 1, block_size: int = 16,
                       mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                       intermediate_size: int | None = None) -> DrafterConfig:
    """A z-lab style config for a fresh drafter of the target's width (used by tests and training)."""
    tc = target.config
    lc = tc.layers
    n_target = tc.num_hidden_layers
    raw = {
        "hidden_size": lc.hidden_size,
        "intermediate_size": intermediate_size or lc.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": lc.num_attention_heads,
        "num_key_value_heads": lc.num_key_value_heads,
        "head_dim": lc.head_dim,
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta,
        "vocab_size": tc.vocab_size,
        "num_target_layers": n_target,
        "block_size": block_size,
        "dflash_config": {"mask_token_id": tc.vocab_size - 1 if mask_token_id is None else mask_token_id},
        "max_position_embeddings": tc.max_position_embeddings,
    }
    if target_layer_ids is not None:
        raw["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    cfg = DrafterConfig.from_dict(raw, Path("<new drafter>"))
    return DrafterConfig.from_dict(cfg.to_zlab_dict(), Path("<new drafter>"))


def load_pair(target_dir: str | Path, drafter_dir: str | Path | None, dtype: torch.dtype = torch.float32,
              load_conditioner: bool = True, draft_vocab: bool = True,
              device: torch.device | str = "cpu") -> tuple[Qwen3Target, DFlashDrafter | None]:
    """Load a target with the taps its drafter needs, and the drafter (with its conditioner and draft
    vocabulary if present; draft_vocab=False: the full head), both in `dtype` on `device`, read straight
    into their parameters."""
    taps: tuple[int, ...] = ()
    if drafter_dir is not None:
        dcfg = DrafterConfig.from_dir(drafter_dir)
        # Check the pair before reading any weights: the message then names the drafter's config.
        dcfg.check_fits(Qwen3Config.from_dir(target_dir), Path(drafter_dir) / "config.json")
        taps = dcfg.target_layer_ids
    target = Qwen3Target.from_pretrained(target_dir, tap_layers=taps, dtype=dtype, device=device)
    drafter = None
    if drafter_dir is not None:
        drafter = DFlashDrafter.from_pretrained(drafter_dir, target, load_conditioner=load_conditioner, dtype=dtype,
                                                draft_vocab=draft_vocab)
    return target, drafter


__all__ = ["DFlashDrafter", "SuffixInputs", "new_drafter_config", "load_pair", "read_json"]
