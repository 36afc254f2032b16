"""Static shapes for the torch backend's steps: the buckets a call is padded to, and the padding itself.

A CUDA graph replays fixed shapes and fixed storage, so a captured step must see a handful of shapes, not
one per (batch, verify width, past length). Every call of the static-shape path is padded to a bucket
(docs/static-cache.md, "Captured steps"):
- rows N: up to the next of 1, 2, 4, then the multiples of 8, and max_batch itself (vLLM's capture sizes);
- the target's verify width T: up to the next of VERIFY_WIDTHS (1: plain decoding, 2-16: a chain of K + 1
  or a tree); wider calls (prefill) run unpadded, eagerly;
- the drafter's context C: up to the block size B (a round's context is 1 + accepted <= B; more after
  rounds without a draft or at the first call, which run unpadded);
- the attention window: `window_width`'s power-of-two buckets (the backend's `window_step` None).
Padded columns write their K/V to scratch columns past max_seq_len (beyond every window, so no real row
reads them), at positions of their own row (finite values: their outputs are dropped).
Where every slot of a call is below its row bucket (`slot_order`: slot 0 alone, slots 0..3 of a batch of 4,
any slots of a full batch), the rows are placed at their own slots (`place`: row r is slot r) and the step
attends over views of the caches' first rows; otherwise padded rows use a scratch slot, one cache row past the
real ones, and the step gathers its rows' windows. Pure tensors here; runtime/cuda_graphs.py captures one
graph per bucket.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

VERIFY_WIDTHS = (1, 2, 4, 8, 16)  # the target's padded verify widths (K + 1 for K in 0..15, trees <= 16 nodes)
SMALL_BATCHES, BATCH_STEP = (1, 2, 4), 8  # padded row counts: these, then multiples of 8 (and max_batch)
SCRATCH_COLUMNS = VERIFY_WIDTHS[-1]  # target cache columns past max_seq_len that padded columns write to


class Bucket(NamedTuple):
    """The fixed shape of one padded call: rows, the padded width (T or C), the attention window, and the
    variant (tree mask or not / conditioner inputs or not, the drafter's block size)."""

    step: str
    rows: int
    width: int
    window: int
    variant: tuple = ()


def verify_width(T: int) -> int | None:
    """The padded verify width for T new tokens, None when wider than every bucket (run unpadded)."""
    return next((w for w in VERIFY_WIDTHS if w >= T), None)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    sizes = {*SMALL_BATCHES, *range(BATCH_STEP, max_batch, BATCH_STEP)}
    return tuple(sorted({b for b in sizes if b < max_batch} | {max_batch}))


def batch_bucket(N: int, max_batch: int) -> int:
    return next(b for b in batch_buckets(max_batch) if b >= N)


def _pad(t: torch.Tensor, rows: int, cols: int | None, row_fill, col_fill=None) -> torch.Tensor:
    """t [N, T, ...] -> [rows, cols, ...]: padded columns from col_fill [N, 1, ...] (default: row_fill),
    padded rows from row_fill [1 | cols, ...] (a scalar is broadcast)."""
    N = t.shape[0]
    if cols is not None and cols > t.shape[1]:
        fill = t.new_full((N, cols - t.shape[1], *t.shape[2:]), row_fill) if col_fill is None else \
            col_fill.expand(N, cols - t.shape[1], *t.shape[2:])
        t = torch.cat([t, fill], dim=1)
    if rows > N:
        t = torch.cat([t, t.new_full((rows - N, *t.shape[1:]), row_fill) if not torch.is_tensor(row_fill)
                       else row_fill.expand(rows - N, *t.shape[1:])], dim=0)
    return t


def scratch_cols(rows: int, width: int, start: int, device) -> torch.Tensor:
    """[rows, width] scratch columns start + j (a padded column's K/V go there)."""
    return (start + torch.arange(width, device=device)).expand(rows, width)


def pad_target(slots, input_ids, positions, logits_index, tree_mask, rows: int, width: int, scratch_slot: int,
               scratch_col: int) -> dict[str, torch.Tensor]:
    """A target call padded to (rows, width): the inputs of `slot_target_step` (logits at `width` rows)."""
    N, T = input_ids.shape
    dev = input_ids.device
    cols = torch.arange(width, device=dev)
    real = (torch.arange(rows, device=dev) < N)[:, None] & (cols < T)[None, :]
    if tree_mask is None:
        written = positions
    else:  # node m sits at the scratch column past + m (the cache invariant, docs/INTERFACES.md)
        written = positions[:, :1] + torch.arange(T, device=dev)
    written = _pad(written, rows, width, 0)
    out = {
        "slots": _pad(slots, rows, None, scratch_slot),
        "input_ids": _pad(input_ids, rows, width, 0),
        "positions": _pad(positions, rows, width, 0, positions[:, :1]),  # padded columns: the row's first
        "write_cols": torch.where(real, written, scratch_cols(rows, width, scratch_col, dev)),
        "logits_index": _pad(logits_index, rows, width, 0),
    }
    if tree_mask is not None:  # padded nodes see the root only; real nodes never see a padded one
        mask = torch.zeros(rows, width, width, dtype=torch.bool, device=dev)
        mask[:, :, 0] = True
        mask[:N, :T, :T] = tree_mask
        out["tree_mask"] = mask
    return out


def pad_draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix, rows: int, width: int,
              scratch_slot: int, offset: int, scratch_col: int) -> dict:
    """A drafter call padded to (rows, context width): the inputs of `slot_draft_step` (suffix: a tuple)."""
    N, C = ctx_positions.shape
    B = block_ids.shape[1]
    dev = block_ids.device
    real = (torch.arange(rows, device=dev) < N)[:, None] & (torch.arange(width, device=dev) < C)[None, :]
    out = {
        "slots": _pad(slots, rows, None, scratch_slot),
        "ctx_taps": _pad(ctx_taps, rows, width, 0),
        "ctx_positions": _pad(ctx_positions, rows, width, 0, ctx_positions[:, :1]),
        "ctx_cols": torch.where(real, _pad(ctx_positions + offset, rows, width, 0),
                                scratch_cols(rows, width, scratch_col, dev)),
        "block_ids": _pad(block_ids, rows, None, 0),
        "block_positions": _pad(block_positions, rows, None, torch.arange(B, device=dev)[None]),
    }
    if suffix is not None:
        out["suffix"] = tuple(_pad(t, rows, None, 0) for t in suffix)
    return out


def slot_order(slots: list[int], rows: int) -> list[int] | None:
    """A call's rows placed at their own slots (row r of the padded call is slot r, for r < rows): for each r,
    the index of the padded call's row that goes there (the real row of slot r, or one of the padded rows);
    None when a slot is >= rows (the call gathers its rows' windows instead, padded rows in the scratch slot).
    A placed call attends over views of the caches' first `rows` rows: no copy of the window per layer."""
    if max(slots) >= rows:
        return None
    where = {s: i for i, s in enumerate(slots)}
    padding = iter(range(len(slots), rows))
    return [where[r] if r in where else next(padding) for r in range(rows)]


def place(inputs: dict, order: torch.Tensor) -> dict:
    """Padded step inputs with their rows in `order` (`slot_order` as a device tensor), without "slots": the
    placed steps take row r as slot r. A padded row lands in a slot outside the call (free, or a request that
    is not in it): it writes only that slot's scratch columns (the drafter: also the block columns, which every
    call rewrites before it reads them), so nothing any request reads changes."""
    return {k: tuple(t[order] for t in v) if isinstance(v, tuple) else v[order]
            for k, v in inputs.items() if k != "slots"}
