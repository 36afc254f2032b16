"""The target's and the drafter's steps over a static K/V cache written in place (the torch backend's path).

`Qwen3Target.forward` / `DFlashDrafter.forward` (training, the ONNX export) take the past as tensors and
return the new K/V. These steps instead take, per layer, the cache rows of the call's slots, [N, Hkv, L, hd]
(a view of the preallocated cache for a contiguous slot range: nothing is copied) and a window width W:
each layer writes the new tokens' K/V into the rows at their absolute positions (an index write, in place)
and attends over columns [0, W) under a boolean mask built on the device from the positions. W is the
caller's choice (a bucket of max_seq_len), so a step's shapes do not follow every token. RoPE comes from a
table precomputed for every position (`RopeTable`: the same values `layers.rope_cos_sin` computes, bit for
bit); the target's LM head runs on the `logits_index` rows only, in the model's dtype.

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


def write_rows(k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, k, v,
               ctx_index: torch.Tensor | None = None, ctx=None) -> None:
    """One layer's new K/V [N, Hkv, T, hd] (and ctx = (k, v) of the drafter's context, at ctx_index) written
    into the caches at (rows [N, 1], columns index [N, T]), in place: one index write per tensor."""
    for cache, new, ctx_new in ((k_cache, k, ctx and ctx[0]), (v_cache, v, ctx and ctx[1])):
        if ctx_new is not None:
            cache[rows, :, ctx_index] = ctx_new.transpose(1, 2).to(cache.dtype)
        cache[rows, :, index] = new.transpose(1, 2).to(cache.dtype)  # [N, T, Hkv, hd] at (row, col)


class ViewWindows:
    """K/V access of a call over the caches of its rows, [N, Hkv, L, hd] per layer (a contiguous slot range's
    rows of the cache, a view; or gathered copies): the new K/V (and the drafter's context) are written at
    their columns (an index write into the rows, in place), then columns [0, width) are attended over (a
    view). The rows are passed whole, not as a [:, :, :width] view: under torch.compile a write into a
    window view (not one piece of memory) made inductor copy the whole window back per call (0.6B width,
    1088 columns: ~2 ms per layer against ~0.5 ms for the write and the attention; docs/static-cache.md)."""

    def __init__(self, k_rows: list[torch.Tensor], v_rows: list[torch.Tensor], index: torch.Tensor, width: int,
                 ctx_index: torch.Tensor | None = None):
        self.k, self.v, self.index, self.width, self.ctx_index = k_rows, v_rows, index, width, ctx_index
        self.rows = torch.arange(index.shape[0], device=index.device)[:, None]  # [N, 1], once for every layer

    def __call__(self, i: int, k, v, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
        write_rows(self.k[i], self.v[i], self.rows, self.index, k, v, self.ctx_index, ctx)
        return self.k[i].narrow(2, 0, self.width), self.v[i].narrow(2, 0, self.width)


class SlotWindows:
    """K/V access of a call over whole caches [S, Hkv, L, hd] (the static-shape steps, docs/static-cache.md):
    the new K/V go into the rows `slots` at columns `index` (and `ctx_index`) in place, then columns [0, width)
    of those rows are gathered and attended over. Every tensor has a fixed shape and storage per (rows,
    width, window): what a CUDA graph needs. Padded rows sit in a scratch slot, padded columns write to
    scratch columns >= width, so no real row ever sees them."""

    def __init__(self, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slots: torch.Tensor, width: int,
                 index: torch.Tensor, ctx_index: torch.Tensor | None = None):
        self.k, self.v, self.slots, self.width = k_cache, v_cache, slots, width
        self.index, self.ctx_index = index, ctx_index

    def __call__(self, i: int, k, v, ctx=None) -> tuple[torch.Tensor, torch.Tensor]:
        write_rows(self.k[i], self.v[i], self.slots[:, None], self.index, k, v, self.ctx_index, ctx)
        return (torch.index_select(self.k[i][:, :, :self.width], 0, self.slots),
                torch.index_select(self.v[i][:, :, :self.width], 0, self.slots))


def slot_windows(k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], slots: torch.Tensor | None, rows: int,
                 width: int, index: torch.Tensor, ctx_index: torch.Tensor | None = None):
    """The K/V access of a static-shape step: rows `slots` of the whole caches, gathered (`SlotWindows`), or
    with slots None the caches' first `rows` rows, row r = slot r (`ViewWindows` over views: nothing copied;
    runtime/step_buckets.py `slot_order` says when a call can be placed so)."""
    if slots is not None:
        return SlotWindows(k_cache, v_cache, slots, width, index, ctx_index)
    return ViewWindows([k.narrow(0, 0, rows) for k in k_cache], [v.narrow(0, 0, rows) for v in v_cache], index,
                       width, ctx_index)


def _layer(layer: DecoderLayer, i: int, x, cos, sin, kv, mask, ctx=None):
    """Decoder layer i over new states x [N, T, d]: `kv` writes their K/V (and ctx = (k, v) of the drafter's
    context) and gives the windows, which the queries attend over under mask [N, 1, T|1, W]."""
    h = layer.input_layernorm(x)
    q = layer.self_attn.query(h, cos, sin)
    k, v = layer.self_attn.key_value(h, cos, sin)
    k_window, v_window = kv(i, k, v, ctx)
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
                tree_mask: torch.Tensor | None = None, width: int | None = None):
    """-> (logits [N, K, V] in the model's dtype at logits_index, taps [N, T, len(tap_layers) * d]); the new
    K/V are in the windows (columns as the module docstring says): the rows' caches [N, Hkv, L, hd], of which
    columns [0, width) are attended over (width None: all L)."""
    width = k_window[0].shape[2] if width is None else width
    mask, index = target_mask(positions, width, tree_mask)
    return _target_layers(target, rope, input_ids, positions, ViewWindows(k_window, v_window, index, width), mask,
                          logits_index)


def slot_target_step(target, rope: RopeTable, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                     width: int, input_ids: torch.Tensor, positions: torch.Tensor, write_cols: torch.Tensor,
                     logits_index: torch.Tensor, tree_mask: torch.Tensor | None = None,
                     slots: torch.Tensor | None = None):
    """`target_step` over whole caches (`slot_windows`): the new K/V at columns write_cols [N, T] of rows
    slots [N] (None: row r is slot r), attention over columns [0, width). Same outputs for the real rows and
    columns."""
    mask, _ = target_mask(positions, width, tree_mask)
    kv = slot_windows(k_cache, v_cache, slots, input_ids.shape[0], width, write_cols)
    return _target_layers(target, rope, input_ids, positions, kv, mask, logits_index)


def _target_layers(target, rope: RopeTable, input_ids, positions, kv, mask, logits_index):
    x = target.embed(input_ids)
    cos, sin = rope.at(positions)
    tapped = {}
    for i, layer in enumerate(target.model.layers):
        x = _layer(layer, i, x, cos, sin, kv, mask)
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
    """The target's LM head on the gathered rows h [N, K, d], in the model's dtype. Compiled for the CPU, one
    row (plain decoding at batch 1) is a multiply-and-sum that inductor fuses into one pass over the table:
    a streaming read, ~2x faster there than the BLAS matrix-vector product (docs/static-cache.md)."""
    weight = target.lm_head.weight
    if torch.compiler.is_compiling() and h.device.type == "cpu" and h.shape[0] * h.shape[1] == 1:
        return (h.unsqueeze(-2) * weight).sum(-1)
    return torch.nn.functional.linear(h, weight)


def draft_step(drafter, rope: RopeTable, ctx_taps: torch.Tensor, ctx_positions: torch.Tensor,
               k_window: list[torch.Tensor], v_window: list[torch.Tensor], block_ids: torch.Tensor,
               block_positions: torch.Tensor, offset: int, suffix=None, width: int | None = None):
    """-> (hidden [N, B, d] after the final norm, logits [N, B-1, Vd] for slots 1..B-1, over the drafter's draft
    vocabulary when it has one (Vd = V without; runtime/draft_space.py); the context
    K/V are in the windows at columns offset + ctx_positions (offset >= B; see the module docstring); columns
    [0, width) attended over (None: all)."""
    N, B = block_ids.shape
    width = k_window[0].shape[2] if width is None else width
    kv = ViewWindows(k_window, v_window, torch.arange(B, device=block_ids.device).expand(N, B), width,
                     ctx_positions + offset)
    return _draft_layers(drafter, rope, ctx_taps, ctx_positions, kv, width, block_ids, block_positions, offset,
                         suffix)


def slot_draft_step(drafter, rope: RopeTable, k_cache: list[torch.Tensor], v_cache: list[torch.Tensor],
                    width: int, ctx_taps: torch.Tensor, ctx_positions: torch.Tensor, ctx_cols: torch.Tensor,
                    block_ids: torch.Tensor, block_positions: torch.Tensor, offset: int, suffix=None,
                    slots: torch.Tensor | None = None):
    """`draft_step` over whole caches (`slot_windows`): the context K/V at columns ctx_cols [N, C] of rows
    slots [N] (None: row r is slot r; offset + ctx_positions for real entries), attention over columns
    [0, width)."""
    N, B = block_ids.shape
    kv = slot_windows(k_cache, v_cache, slots, N, width, torch.arange(B, device=block_ids.device).expand(N, B),
                      ctx_cols)
    return _draft_layers(drafter, rope, ctx_taps, ctx_positions, kv, width, block_ids, block_positions, offset,
                         suffix)


def _draft_layers(drafter, rope, ctx_taps, ctx_positions, kv, width: int, block_ids, block_positions, offset,
                  suffix):
    B, C = block_ids.shape[1], ctx_taps.shape[1]
    ctx = drafter.project(ctx_taps)
    x = drafter.block_states(ctx, block_ids, suffix)
    cos_c, sin_c = rope.at(ctx_positions)
    cos_b, sin_b = rope.at(block_positions)
    # visible context: the cached past (< past) and this call's context (consecutive from past) before the anchor
    past, anchor = ctx_positions[:, :1], block_positions[:, :1]
    limit = torch.maximum(past, torch.minimum(past + C, anchor))
    cols = torch.arange(width, device=x.device)
    mask = ((cols < B) | ((cols >= offset) & (cols - offset < limit)))[:, None, None, :]  # [N, 1, 1, W]
    for i, layer in enumerate(drafter.layers):
        kc, vc = layer.self_attn.key_value(ctx, cos_c, sin_c)
        x = _layer(layer, i, x, cos_b, sin_b, kv, mask, ctx=(kc, vc))
    h = drafter.norm(x)
    return h, drafter.logits(h[:, 1:], expand=False)
