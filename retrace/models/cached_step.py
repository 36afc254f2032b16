"""The target's and the drafter's steps over a static K/V cache written in place (the torch backend's path).

`Qwen3Target.forward` / `DFlashDrafter.forward` (training, the ONNX export) take the past as tensors and
return the new K/V. These steps instead take, per layer, a window of the per-slot cache, [N, Hkv, W, hd]
(a view of the preallocated cache for a contiguous slot range: nothing is copied): each layer writes the
new tokens' K/V into it at their absolute positions (`scatter_`, in place) and attends over the whole
window under a boolean mask built on the device from the positions. W is the caller's choice (a bucket of
max_seq_len), so a step's shapes do not depend on the past length. RoPE comes from a table precomputed for
every position (`RopeTable`: the same values `layers.rope_cos_sin` computes, bit for bit); the target's
LM head runs on the `logits_index` rows only, in the model's dtype.

Window layouts (see docs/INTERFACES.md for the cache invariant both keep):
- target: column j = position j. A chain's query at position p sees columns <= p (the past and the new
  tokens before it); a tree's node m is written at the scratch column past + m and sees the past and the
  columns of the nodes `tree_mask` allows.
- drafter: columns 0..B-1 hold this call's block (written each call, never read by the next), column
  `offset` + j = context position j (offset: the drafter's largest block). The block sees itself and the
  context before the anchor.
"""

from __future__ import annotations

import torch

from retrace.models.layers import DecoderLayer, rope_cos_sin


class RopeTable:
    """cos/sin [L, head_dim] for positions 0..L-1 in `dtype` (indexed by positions instead of recomputed)."""

    def __init__(self, length: int, head_dim: int, theta: float, dtype: torch.dtype, device=None):
        positions = torch.arange(length, device=device).unsqueeze(0)
        cos, sin = rope_cos_sin(positions, head_dim, theta, dtype)
        self.cos, self.sin = cos[0], sin[0]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, T, head_dim] at positions [N, T]."""
        return self.cos[positions], self.sin[positions]


def write_at(window: torch.Tensor, index: torch.Tensor, new: torch.Tensor) -> None:
    """Write new [N, Hkv, T, hd] at columns index [N, T] of window [N, Hkv, W, hd], in place."""
    n, h, _, d = new.shape
    window.scatter_(2, index[:, None, :, None].expand(n, h, -1, d), new.to(window.dtype))


def _layer(layer: DecoderLayer, x, cos, sin, k_window, v_window, index, mask, ctx=None):
    """One decoder layer over new states x [N, T, d]: their K/V (and ctx = (k, v, index) of the drafter's
    context) are written into the windows, then the queries attend over the windows under mask [N,1,T|1,W]."""
    h = layer.input_layernorm(x)
    q = layer.self_attn.query(h, cos, sin)
    k, v = layer.self_attn.key_value(h, cos, sin)
    if ctx is not None:
        write_at(k_window, ctx[2], ctx[0])
        write_at(v_window, ctx[2], ctx[1])
    write_at(k_window, index, k)
    write_at(v_window, index, v)
    x = x + layer.self_attn.output(q, k_window, v_window, mask)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def target_mask(positions: torch.Tensor, width: int,
                tree_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (mask [N, 1, T, W] bool, the columns [N, T] the new tokens' K/V are written at)."""
    N, T = positions.shape
    cols = torch.arange(width, device=positions.device)
    if tree_mask is None:
        return (cols <= positions.unsqueeze(-1)).unsqueeze(1), positions
    past = positions[:, :1]
    rel = cols - past  # [N, W]: node index of a scratch column
    new = (rel >= 0) & (rel < T)
    allowed = torch.gather(tree_mask, 2, rel.clamp(0, T - 1).unsqueeze(1).expand(N, T, width))
    mask = (rel < 0).unsqueeze(1) | (new.unsqueeze(1) & allowed)
    return mask.unsqueeze(1), past + torch.arange(T, device=positions.device)


def target_step(target, rope: RopeTable, input_ids: torch.Tensor, positions: torch.Tensor,
                k_window: list[torch.Tensor], v_window: list[torch.Tensor], logits_index: torch.Tensor,
                tree_mask: torch.Tensor | None = None):
    """-> (logits [N, K, V] in the model's dtype at logits_index, taps [N, T, len(tap_layers) * d]); the new
    K/V are in the windows (columns as the module docstring says)."""
    x = target.embed(input_ids)
    cos, sin = rope.at(positions)
    mask, index = target_mask(positions, k_window[0].shape[2], tree_mask)
    tapped = {}
    for i, layer in enumerate(target.model.layers):
        x = _layer(layer, x, cos, sin, k_window[i], v_window[i], index, mask)
        if i in target.tap_layers:
            tapped[i] = x
    rows = logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1])
    last = len(target.model.layers) - 1
    if last in tapped:  # HF's last hidden_states entry is already after the final norm
        tapped[last] = target.model.norm(x)
        h = torch.gather(tapped[last], 1, rows)
    else:
        h = target.model.norm(torch.gather(x, 1, rows))
    N, T = input_ids.shape
    taps = torch.cat([tapped[i] for i in target.tap_layers], dim=-1) if tapped else x.new_zeros(N, T, 0)
    return lm_head_rows(target, h), taps


def lm_head_rows(target, h: torch.Tensor) -> torch.Tensor:
    """The target's LM head on the gathered rows h [N, K, d], in the model's dtype."""
    return torch.nn.functional.linear(h, target.lm_head.weight)


def draft_step(drafter, rope: RopeTable, ctx_taps: torch.Tensor, ctx_positions: torch.Tensor,
               k_window: list[torch.Tensor], v_window: list[torch.Tensor], block_ids: torch.Tensor,
               block_positions: torch.Tensor, offset: int, suffix=None):
    """-> (hidden [N, B, d] after the final norm, logits [N, B-1, V] float32 for slots 1..B-1); the context
    K/V are in the windows at columns offset + ctx_positions (offset >= B; see the module docstring)."""
    N, B = block_ids.shape
    C = ctx_taps.shape[1]
    W = k_window[0].shape[2]
    ctx = drafter.project(ctx_taps)
    x = drafter.block_states(ctx, block_ids, suffix)
    cos_c, sin_c = rope.at(ctx_positions)
    cos_b, sin_b = rope.at(block_positions)
    # visible context: the cached past (< past) and this call's context (consecutive from past) before the anchor
    past, anchor = ctx_positions[:, :1], block_positions[:, :1]
    limit = torch.maximum(past, torch.minimum(past + C, anchor))
    cols = torch.arange(W, device=x.device)
    mask = ((cols < B) | ((cols >= offset) & (cols - offset < limit)))[:, None, None, :]  # [N, 1, 1, W]
    ctx_index = ctx_positions + offset
    block_index = torch.arange(B, device=x.device).expand(N, B)
    for i, layer in enumerate(drafter.layers):
        kc, vc = layer.self_attn.key_value(ctx, cos_c, sin_c)
        x = _layer(layer, x, cos_b, sin_b, k_window[i], v_window[i], block_index, mask, ctx=(kc, vc, ctx_index))
    h = drafter.norm(x)
    return h, drafter.logits(h[:, 1:])
