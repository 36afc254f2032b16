"""The torch backend: the models of `retrace.models` over preallocated per-slot K/V caches, on any device.

The caches are static (models/cached_step.py, docs/static-cache.md): a call writes the new K/V into them
in place and attends over a window of `window_width` columns of the longest past: a power-of-two bucket
where the shapes are captured (static shapes, CUDA graphs), the next multiple of WINDOW_STEP otherwise.
Tensors in and out live on `device` (the models' device); index inputs the loop built with
`device.index_tensor` carry their host values, so the window and whether the slots are one range are read
on the host, never from the device. bfloat16 / float16 / float32 weights: `from_dirs(dtype=...)`.

Static shapes (`static_shapes`, on whenever CUDA graphs are): calls whose verify width and context fit a
bucket (runtime/step_buckets.py) are padded to it and run the slot-index steps over the whole caches (placed
at their own slots where every slot is below the row bucket: attention over views of the caches; otherwise
gathered, padded rows in a scratch slot; padded columns in scratch columns past max_seq_len), through
runtime/cuda_graphs.py: one CUDA graph per bucket on CUDA (`cuda_graphs`, default on there), eagerly elsewhere.
Prefill and wider calls run the window steps as before.

Row invariance (`row_invariant`, default on CUDA): every target call of up to 16 tokens is padded to the
widest verify bucket (16 columns; its rows to their batch bucket as always), and a wider call (a prefill)
runs row by row over each row's tokens up to its last logits row. A matmul's kernel is chosen by its shape,
and kernels of different shapes round differently, so without it a verify row and the decode step of the
same token can differ in the last bits: on CPU fp32 (MKL) a T=1 row differs from the same row of every
T >= 3 call, and on an H200 in bf16 speculative output parted from plain decoding's at near ties
(docs/gpu/gpu-bench-2026-12-04.md). With one width per call a row's bits depend on its own inputs and the
call's batch bucket only, so greedy speculative decoding reproduces plain decoding bit for bit at the same
batch bucket (runtime/row_invariance.py `rows_matching_decodes` checks it on any backend), and a prompt's
K/V do not depend on the prompts prefilled beside it. Rows are not padded to max_batch as well: that would
make every batch-1 step compute max_batch x 16 rows (vLLM's batch-invariant mode uses kernels of its own).
The cost is the columns a call computes: small where a step is bound by reading the weights (a GPU at batch 1: T=16
measured 1.16x T=1 at the Qwen3-8B shape), large on a CPU (fp32 T=16 1.6-1.9x T=1), so it is off on the CPU
unless asked for.
"""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path

import torch

from retrace.errors import RetraceError
from retrace.models.cached_step import RopeTable, draft_step, slot_draft_step, slot_target_step, target_step
from retrace.models.drafter import DFlashDrafter, SuffixInputs, load_pair
from retrace.models.target import Qwen3Target
from retrace.runtime.backend import contiguous_range
from retrace.runtime.compiled_step import CompiledStep, TwoRowDecode
from retrace.runtime.cuda_graphs import CUDAGraphSteps, steps_runner
from retrace.runtime.device import host_values, index_tensor, resolve_device, resolve_dtype
from retrace.runtime.step_buckets import (
    SCRATCH_COLUMNS,
    VERIFY_WIDTHS,
    Bucket,
    batch_bucket,
    pad_draft,
    pad_target,
    place,
    slot_order,
    verify_width,
)


class KVCache:
    """Per-layer K/V [S, Hkv, L, hd] for S slots; rows are written at absolute positions."""

    def __init__(self, layers: int, slots: int, kv_heads: int, length: int, head_dim: int, dtype: torch.dtype):
        shape = (slots, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(layers)]

    def past(self, slots: torch.Tensor, length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        rows = contiguous_range(slots)
        if rows is not None:  # the common case: a view, nothing copied
            return [k[rows, :, :length] for k in self.k], [v[rows, :, :length] for v in self.v]
        return [k[slots, :, :length] for k in self.k], [v[slots, :, :length] for v in self.v]

    def window(self, slots: torch.Tensor, width: int) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        """Per layer, the slots' rows to be written in place, of which the step attends over columns [0, width)
        -> (k, v, is_view). For a contiguous slot range the rows of the cache, whole (views); otherwise gathered
        copies of their columns [0, width) (`write_back` them)."""
        rows = contiguous_range(slots)
        if rows is not None:
            return [k[rows] for k in self.k], [v[rows] for v in self.v], True
        return [k[slots, :, :width] for k in self.k], [v[slots, :, :width] for v in self.v], False

    def write_back(self, slots: torch.Tensor, index: torch.Tensor, k_window: list[torch.Tensor],
                   v_window: list[torch.Tensor]) -> None:
        """Copy columns index [N, C] of gathered windows (see `window`) back to the slots' rows."""
        rows, local = slots[:, None], torch.arange(len(slots), device=slots.device)[:, None]
        for cache, win in zip(self.k + self.v, k_window + v_window, strict=True):
            cache[rows, :, index] = win[local, :, index]

    def write(self, slots: torch.Tensor, positions: torch.Tensor, new_k: list[torch.Tensor],
              new_v: list[torch.Tensor]) -> None:
        rows = slots[:, None]
        for cache, new in zip(self.k + self.v, new_k + new_v, strict=True):
            cache[rows, :, positions] = new.transpose(1, 2).to(cache.dtype)  # [N, T, Hkv, hd] at (slot, position)

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V at indices src [N, L] to dst [N, L] of each slot (all read before any is written)."""
        rows = slots[:, None]
        for cache in self.k + self.v:
            cache[rows, :, dst] = cache[rows, :, src]


MIN_WIDTH = 64  # the narrowest attention window (columns of the cache) a step attends over
# the eager and torch.compile'd (dynamic-shape) steps' window granularity: a power-of-two window reads up to
# twice the K/V the past needs (0.6B width, 4 layers, compiled, one thread, past 1500: 37.8 ms per call over
# 2048 columns against 24.7 over 1536; no extra recompile: docs/static-cache.md)
WINDOW_STEP = 64


def window_width(need: int, length: int, step: int | None = None) -> int:
    """The cache columns a call attends over, at least MIN_WIDTH and at most `length`: the next power of two
    >= need (step None: a handful of widths whatever the past, one captured graph each), or the next
    multiple of `step`."""
    wide = 1 << (need - 1).bit_length() if step is None else -(-need // step) * step
    return min(length, max(MIN_WIDTH, wide))


class TorchBackend:
    name = "torch"
    padded_steps = True  # the slot-index steps exist (runtime/step_buckets.py); a subclass without them: False
    subset_draft_logits = True  # a draft vocabulary's logits over the subset only (draft_ids says which ids)

    def __init__(self, target: Qwen3Target, drafter: DFlashDrafter | None, max_batch: int = 8,
                 max_seq_len: int = 2048, threads: int | None = None, device: torch.device | str | None = None,
                 compile: bool | str = False, cuda_graphs: bool | None = None, static_shapes: bool | None = None,
                 row_invariant: bool | None = None):
        """device: where the caches and every tensor in and out live (default: the target's); the models
        must be there already (`from_dirs` puts them there). compile: run the target's and the drafter's
        steps under torch.compile(fullgraph=True) (True = inductor; or a compiler name of
        runtime/compiled_step.py; False: eager). cuda_graphs: capture the padded steps as CUDA graphs (None:
        on CUDA only; True elsewhere: an error). static_shapes: pad calls to the step buckets (None: when
        CUDA graphs are on; True on the CPU runs the same padded steps eagerly). row_invariant: every target
        call at one width (see above; None: on CUDA where the padded steps run; True needs them)."""
        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(device) if device is not None else target.lm_head.weight.device
        self.target_model = target
        self.drafter_model = drafter
        self.target_config = target.config
        self.drafter_config = drafter.config if drafter is not None else None
        self.has_conditioner = drafter is not None and drafter.conditioner is not None
        vocab = drafter.draft_vocab if drafter is not None and self.subset_draft_logits else None
        # [Vd] the target ids of the draft logits (runtime/draft_space.py); None: the whole vocabulary
        self.draft_ids = None if vocab is None else vocab.ids.to(self.device)
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.dtype = target.lm_head.weight.dtype
        self.compiled = compile
        if not self.padded_steps and (cuda_graphs or static_shapes):
            raise RetraceError(f"{type(self).__name__} has no padded steps (no static shapes, no CUDA graphs)")
        self.runner = steps_runner(self.device, cuda_graphs if self.padded_steps else False)
        default = self.device.type == "cuda" and self.padded_steps and static_shapes is not False
        self.row_invariant = default if row_invariant is None else bool(row_invariant)
        if self.row_invariant and (static_shapes is False or not self.padded_steps):
            raise RetraceError("row invariance pads every target call to one width: it needs the padded steps "
                               "(static_shapes); turn one of the two off")
        self.static_shapes = (isinstance(self.runner, CUDAGraphSteps) or self.row_invariant
                              if static_shapes is None else static_shapes)
        self.window_step = None if self.static_shapes else WINDOW_STEP  # buckets of captured shapes: powers of two
        # static shapes: one scratch slot (row max_batch) for padded rows, scratch columns for padded columns
        slots, extra = (max_batch + 1, SCRATCH_COLUMNS) if self.static_shapes else (max_batch, 0)
        with self.device:
            self.target_step, self.draft_step, self.block_scratch = self._steps(target, drafter)
            tc = target.config.layers
            self.tcache = KVCache(tc.num_hidden_layers, slots, tc.num_key_value_heads, max_seq_len + extra,
                                  tc.head_dim, self.dtype)
            self.dcache = None
            if drafter is not None:
                dc = drafter.config.layers
                self.dcache = KVCache(dc.num_hidden_layers, slots, dc.num_key_value_heads,
                                      self.block_scratch * (2 if self.static_shapes else 1) + max_seq_len,
                                      dc.head_dim, drafter.fc.weight.dtype)
        self.slot_target_step = self.slot_draft_step = None
        self._orders: dict[tuple, torch.Tensor] = {}  # step_buckets.slot_order's orders, on the device
        self.place_rows = True  # place calls at their slots where they fit (False: always gather; benchmarks)
        if self.static_shapes:
            self.slot_target_step = partial(slot_target_step, target, self.target_step.args[1], self.tcache.k,
                                            self.tcache.v)
            if drafter is not None:
                self.slot_draft_step = partial(_slot_draft, drafter, self.draft_step.args[1], self.dcache.k,
                                               self.dcache.v, offset=self.block_scratch)
        if compile:
            compiler = "inductor" if compile is True else compile
            for name, what in (("target_step", "target"), ("draft_step", "drafter"),
                               ("slot_target_step", "padded target"), ("slot_draft_step", "padded drafter")):
                if getattr(self, name) is not None:
                    kind = TwoRowDecode if name == "target_step" else CompiledStep  # pads only when frozen (CPU)
                    setattr(self, name, kind(getattr(self, name), what, compiler, freeze=self.device.type == "cpu"))

    def _steps(self, target: Qwen3Target, drafter: DFlashDrafter | None):
        """-> (the target's step, the drafter's step, drafter cache columns before context position 0: the
        block's scratch columns, see models/cached_step.py)."""
        tc = target.config.layers
        t_step = partial(target_step, target, RopeTable(self.max_seq_len, tc.head_dim, tc.rope_theta, self.dtype))
        if drafter is None:
            return t_step, None, 0
        dc = drafter.config.layers
        # RoPE in the dtype of the block's states (the target's embedding), as DFlashDrafter.forward
        rope = RopeTable(self.max_seq_len, dc.head_dim, dc.rope_theta, self.dtype)
        return t_step, partial(draft_step, drafter, rope), drafter.config.block_size

    @classmethod
    def from_dirs(cls, target_dir: str | Path, drafter_dir: str | Path | None,
                  dtype: torch.dtype | str | None = torch.float32, device: torch.device | str | None = None,
                  **kwargs) -> TorchBackend:
        dev = resolve_device(device)  # before reading any weights: an absent CUDA fails fast
        target, drafter = load_pair(target_dir, drafter_dir, dtype=resolve_dtype(dtype), device=dev)
        return cls(target, drafter, device=dev, **kwargs)

    def _autocast(self):
        """A target and a drafter of different dtypes (a trainer's bf16 target with its fp32 drafter) share
        the embedding and the LM head: autocast to the target's dtype."""
        if self.drafter_model is not None and self.drafter_model.fc.weight.dtype != self.dtype:
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    def _on_device(self, *tensors: torch.Tensor | None):
        return [t if t is None else t.to(self.device, non_blocking=True) for t in tensors]

    def _suffix_on_device(self, suffix: SuffixInputs | None, dtype: torch.dtype) -> SuffixInputs | None:
        """The suffix inputs on the device, in the drafter's dtype (the loop keeps the memory in fp32)."""
        if suffix is None:
            return None
        memory, features, valid, corr = self._on_device(suffix.memory, suffix.features, suffix.valid,
                                                        suffix.corr_index)
        return SuffixInputs(memory.to(dtype), features.to(dtype), valid.to(dtype), corr)

    @torch.inference_mode()
    def target(self, slots, input_ids, positions, logits_index, tree_mask=None):
        T = input_ids.shape[1]
        if self.row_invariant and T > VERIFY_WIDTHS[-1] and tree_mask is None and _ragged(logits_index, T):
            return self._rows_alone(slots, input_ids, positions, logits_index)
        width = window_width(max(row[0] for row in host_values(positions)) + T, self.max_seq_len, self.window_step)
        padded = verify_width(T) if self.static_shapes else None
        if padded is not None and self.row_invariant:  # every call of up to 16 tokens at the widest bucket
            padded = VERIFY_WIDTHS[-1]
        if padded is not None:
            return self._padded_target(width, padded, slots, input_ids, positions, logits_index, tree_mask)
        kw, vw, is_view = self.tcache.window(slots, width)
        slots, input_ids, positions, logits_index, tree_mask = self._on_device(slots, input_ids, positions,
                                                                               logits_index, tree_mask)
        with self._autocast():
            logits, taps = self.target_step(input_ids, positions, kw, vw, logits_index.contiguous(), tree_mask,
                                            width)
        if not is_view:  # node m of a tree sits at the scratch column positions[:, 0] + m (see commit_path)
            written = positions if tree_mask is None else positions[:, :1] + torch.arange(T, device=self.device)
            self.tcache.write_back(slots, written, kw, vw)
        return logits.float(), taps

    def _rows_alone(self, slots, input_ids, positions, logits_index):
        """Row invariance for a call wider than every bucket (a prefill): each row alone, over its tokens up to
        its last logits row (a batched prefill's pad tokens are not run: their K/V lie past the row's length,
        where nothing reads), so a row's bits do not depend on the prompts prefilled beside it."""
        slot_ids, pos, index = host_values(slots), host_values(positions), host_values(logits_index)
        logits, taps = [], None
        for i, row in enumerate(index):
            end = max(row) + 1
            out = self.target(index_tensor([slot_ids[i]], self.device), input_ids[i:i + 1, :end],
                              index_tensor([pos[i][:end]], self.device), index_tensor([row], self.device))
            logits.append(out[0])
            if taps is None:
                taps = out[1].new_zeros(len(index), input_ids.shape[1], *out[1].shape[2:])
            taps[i, :end] = out[1][0]
        return torch.cat(logits), taps

    def _padded_target(self, window, width, slots, input_ids, positions, logits_index, tree_mask):
        """A target call padded to its bucket, run by the runner (a CUDA graph per bucket on CUDA)."""
        N, K = len(slots), logits_index.shape[1]
        rows = batch_bucket(N, self.max_batch)
        order = self._order(slots, rows)
        slots, input_ids, positions, logits_index, tree_mask = self._on_device(slots, input_ids, positions,
                                                                               logits_index, tree_mask)
        inputs = pad_target(slots, input_ids, positions, logits_index, tree_mask, rows, width,
                            scratch_slot=self.max_batch, scratch_col=self.max_seq_len)
        bucket = Bucket("target", rows, width, window, (tree_mask is not None, order is not None))
        with self._autocast():
            logits, taps = self.runner(bucket, self.slot_target_step, self._placed(inputs, order))
        real = slots if order is not None else slice(N)  # a placed call's real rows sit at their slots
        return _own(logits[real, :K], order, torch.float32), _own(taps[real, :input_ids.shape[1]], order)

    def _order(self, slots, rows: int) -> list[int] | None:
        return slot_order(host_values(slots), rows) if self.place_rows else None

    def _placed(self, inputs: dict, order: list[int] | None) -> dict:
        """The padded inputs with each row at its own slot (step_buckets.place), where `order` says so."""
        if order is None:
            return inputs
        key = tuple(order)
        if key not in self._orders:  # a handful per run ([0], [0, 1, 2, 3], ...): one host-to-device copy each
            self._orders[key] = index_tensor(order, self.device)
        return place(inputs, self._orders[key])

    @torch.inference_mode()
    def commit_path(self, slots, src_index, dst_pos):
        self.tcache.move(*self._on_device(slots, src_index, dst_pos))

    @torch.inference_mode()
    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix: SuffixInputs | None):
        width = self.block_scratch + window_width(max(max(row) for row in host_values(ctx_positions)) + 1,
                                                  self.max_seq_len, self.window_step)
        if self.static_shapes and ctx_taps.shape[1] <= block_ids.shape[1]:
            return self._padded_draft(width, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)
        kw, vw, is_view = self.dcache.window(slots, width)
        slots, ctx_taps, ctx_positions, block_ids, block_positions = self._on_device(
            slots, ctx_taps, ctx_positions, block_ids, block_positions)
        dt = self.drafter_model.fc.weight.dtype
        suffix = self._suffix_on_device(suffix, dt)
        with self._autocast():
            hidden, logits = self.draft_step(ctx_taps.to(dt), ctx_positions, kw, vw, block_ids, block_positions,
                                             self.block_scratch, suffix, width)
        if not is_view:
            self.dcache.write_back(slots, ctx_positions + self.block_scratch, kw, vw)
        return hidden.float(), logits.float()

    def _padded_draft(self, window, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        """A drafter call with its context padded to the block size and its rows to their bucket."""
        N, B = block_ids.shape
        rows = batch_bucket(N, self.max_batch)
        order = self._order(slots, rows)
        slots, ctx_taps, ctx_positions, block_ids, block_positions = self._on_device(
            slots, ctx_taps, ctx_positions, block_ids, block_positions)
        dt = self.drafter_model.fc.weight.dtype
        suffix = self._suffix_on_device(suffix, dt)
        parts = None if suffix is None else (suffix.memory, suffix.features, suffix.valid, suffix.corr_index)
        inputs = pad_draft(slots, ctx_taps.to(dt), ctx_positions, block_ids, block_positions, parts, rows, B,
                           scratch_slot=self.max_batch, offset=self.block_scratch,
                           scratch_col=self.block_scratch + self.max_seq_len)
        bucket = Bucket("drafter", rows, B, window, (suffix is not None, order is not None))
        with self._autocast():
            hidden, logits = self.runner(bucket, self.slot_draft_step, self._placed(inputs, order))
        real = slots if order is not None else slice(N)
        return _own(hidden[real], order, torch.float32), _own(logits[real], order, torch.float32)

    def release(self, slot: int) -> None:
        pass


def _own(rows: torch.Tensor, order: list[int] | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Output rows of a padded step as a tensor of their own (in `dtype`): a CUDA graph's outputs are its
    buffers, which its next replay overwrites. A placed call's rows were gathered (a copy already); the slice of
    an unplaced call's rows is copied."""
    return rows.to(dtype or rows.dtype, copy=order is None)


def _ragged(logits_index: torch.Tensor, T: int) -> bool:
    """Whether a call is more than one row whose every token is real (rows, or tokens past the last logits row)."""
    index = host_values(logits_index)
    return len(index) > 1 or max(index[0]) + 1 < T


def _slot_draft(drafter, rope, k_cache, v_cache, *, width, offset, suffix=None, **inputs):
    """slot_draft_step with the suffix inputs as a tuple (runtime/cuda_graphs.py keeps flat tensors)."""
    return slot_draft_step(drafter, rope, k_cache, v_cache, width=width, offset=offset,
                           suffix=None if suffix is None else SuffixInputs(*suffix), **inputs)
