"""The previous round's rejected suffix per batch slot, preallocated, one round deep, in two views: what the
ReTrace conditioner reads (the memory) and what a draft tree reads (the rejected trajectory). One
alignment (`align`) serves both; admission, release and a round without a draft call clear both at once.

After the verify of round r (anchor at p, a drafts accepted) the next anchor is p' = p + a + 1. The draft
at old block slot j (absolute p + j) lines up with new slot k = j - a - 1 (same absolute position, so RoPE
already matches); slot 0 is the new anchor, never fused.

The memory (retrace mode). Valid new slots: k = 1 .. B-2-a; it is empty after prefill and when a >= B-2.
For slot k we keep:
  memory      = the drafter's final hidden state at old slot j,
  correction  = the verify-pass taps at old slot j-1 (the target state that scored d_j); they are part of
                the next draft call's context taps, so we keep their index there (a + k), not a copy,
  features    = [target argmax at j-1 == d_j, target prob of d_j at j-1, drafter prob of d_j at j].
When the verify policy sent only K < B-1 drafts to the target, the drafts after d_{K+1} were drafted but
never scored: no target taps (correction) or target probabilities exist for them. They are left out of the
memory (valid = 0), as if the block had ended at slot K+1: old slots j = a+2 .. min(K+1, B-1) are kept
(d_{K+1} was scored by the target at slot K, the position of the bonus, so its features and correction
exist).

The rejected trajectory (tree rounds: the `suffix` and `target` sources of runtime/draft_tree.py), for new
slots k >= 1, stored as [slots, B-1] token ids at index k - 1 (-1 = none):
  suffix[k] = old d_j, the round's block token at old slot j: the round path's token (runtime/tree_accept.py:
              the accepted path continued by each node's best child as far as the tree goes), then the
              drafter's top-1 token (drafted-but-unverified slots included);
  target[k] = the target's argmax at old slot j - 1 of the round path, -1 where the path did not reach
              old slot j - 1.
"""

from __future__ import annotations

import functools

import torch

from retrace.models.conditioner import FEATURES
from retrace.models.drafter import SuffixInputs
from retrace.runtime.backend import contiguous_range
from retrace.runtime.device import host_values, to_device
from retrace.runtime.draft_space import DraftSpace


def align(accepted: torch.Tensor, block_size: int,
          verified: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """accepted [N] (verified [N]: drafts the target judged, default B-1) -> (old slot j [N,B], valid [N,B]
    bool, correction index [N,B]) for new slots k=0..B-1. Valid: old slots j = k+a+1 <= min(K+1, B-1)."""
    k, j = shift(accepted, block_size)
    last = block_size - 1 if verified is None else (verified.unsqueeze(1) + 1).clamp_max(block_size - 1)
    valid = (k >= 1) & (j <= last)
    old_slot = torch.where(valid, j, 0)
    corr_index = torch.where(valid, j - 1, 0)
    return old_slot, valid, corr_index


def shift(accepted: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted [N] -> (new slot k [1, B], the old slot j = k + a + 1 at the same absolute position [N, B])."""
    k = _slots(block_size, accepted.device)
    return k, k + (accepted.unsqueeze(1) + 1)


@functools.lru_cache(maxsize=16)
def _slots(block_size: int, device: torch.device) -> torch.Tensor:
    """[[0, 1, .., B-1]], built once per block size and device (read-only)."""
    return torch.arange(block_size, device=device).unsqueeze(0)


def suffix_features(block_tokens: torch.Tensor, verify_logits: torch.Tensor,
                    draft_logits: torch.Tensor, target_argmax: torch.Tensor | None = None) -> torch.Tensor:
    """Reliability of each draft d_j as [N, B, 3] at old slot j (slot 0 zero): whether the target's argmax
    at j-1 is d_j, the target's probability of d_j at j-1, the drafter's own probability of d_j at j.
    Temperature-1 softmaxes, whatever the sampling parameters, so training and serving see the same.
    target_argmax [N, B]: verify_logits.argmax(-1) when the caller has it already (greedy acceptance).
    verify_logits and target_argmax may be longer than B - 1 slots; the first B - 1 are used."""
    N, B = block_tokens.shape
    d = block_tokens[:, 1:].unsqueeze(-1)
    verify_logits = verify_logits[:, : B - 1]
    target_argmax = verify_logits.argmax(-1) if target_argmax is None else target_argmax[:, : B - 1]
    feats = verify_logits.new_zeros(N, B, len(FEATURES))
    feats[:, 1:, 0] = (target_argmax == block_tokens[:, 1:]).float()
    feats[:, 1:, 1] = verify_logits.float().softmax(-1).gather(2, d).squeeze(-1)
    feats[:, 1:, 2] = draft_logits.float().softmax(-1).gather(2, d).squeeze(-1)
    return feats


def kept_features(block_tokens: torch.Tensor, verify_logits: torch.Tensor, draft_logits: torch.Tensor,
                  target_argmax: torch.Tensor, old: torch.Tensor, corr: torch.Tensor, rows: range,
                  space: DraftSpace | None = None) -> torch.Tensor:
    """`suffix_features` gathered at the memory's new slots, [N, B, 3] (the same bits at the valid slots;
    the others hold whatever their clamped index reads, the caller zeroes them): old / corr [N, B] the old
    slot j and j - 1 per new slot (`align`); rows: the verify / draft-logit rows t = j - 1 the valid slots
    use. The two temperature-1 softmaxes run over those rows only (row by row as in `suffix_features`; at a
    batch of rows, the span some row keeps: at the Qwen3-0.6B shape, batch 4, fp32, a retrace round's
    features 3.8 -> 2.4 ms). draft_logits over a draft vocabulary (`space`, runtime/draft_space.py):
    the drafter's probability of d_j over the subset, 0 for a token outside it (what the -inf of the
    expanded logits gave)."""
    N = block_tokens.shape[0]
    tok = block_tokens.gather(1, old)  # d_j at each new slot
    start = rows.start
    at = corr if start == 0 else (corr - start).clamp_min(0)
    feats = [(target_argmax.gather(1, corr) == tok).float()]
    dtok = tok if space is None or space.full else space.index_of(tok)
    for logits, t in ((verify_logits, tok), (draft_logits, dtok if dtok is tok else dtok.clamp_min(0))):
        probs = _fp32(logits[:, start: rows.stop]).softmax(-1)
        feats.append(probs.view(N, -1).gather(1, torch.add(t, at, alpha=logits.shape[-1])))
    if dtok is not tok:
        feats[-1] = torch.where(dtok >= 0, feats[-1], 0.0)
    return torch.stack(feats, -1)


def _fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


class SuffixMemory:
    def __init__(self, slots: int, block_size: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", trajectory: bool = True):
        """trajectory: keep the rejected-trajectory view (the round writes it for trees only)."""
        B, d, F = block_size, hidden_size, len(FEATURES)
        self.block_size = B
        self.keeps_trajectory = trajectory
        with torch.device(device):
            self.suffix = torch.full((slots, B - 1), -1, dtype=torch.int64)  # the trajectory view
            self.target = torch.full((slots, B - 1), -1, dtype=torch.int64)
            self.memory = torch.zeros(slots, B, d, dtype=dtype)
            self.features = torch.zeros(slots, B, F, dtype=torch.float32)
            self.valid = torch.zeros(slots, B, dtype=torch.float32)
            self.corr_index = torch.zeros(slots, B, dtype=torch.int64)
        self.filled: set[int] = set()  # slots holding a memory (kept on the host: no read to know it)
        self._position = [-1] * slots  # absolute position of each slot's new slot 0 (-1: none), on the host
        self._device = torch.device(device)
        # `align` for every (accepted a, verified K) pair, row a * B + K: a round looks its rows up (two
        # index ops) instead of recomputing the alignment (a dozen small ones); the same integers
        a = torch.arange(B, device=device).repeat_interleave(B)
        old, valid, corr = align(a, B, torch.arange(B, device=device).repeat(B))
        self._aligned = torch.stack([old, corr], 1)  # [B*B, 2, B]: old slot j, correction index
        self._old = old.unsqueeze(-1)  # [B*B, B, 1]: old slot j, to gather hidden states with
        self._on = valid.unsqueeze(-1)  # [B*B, B, 1] bool
        self._valid = valid.float()  # [B*B, B]
        self._keep = valid.unsqueeze(-1).to(dtype)  # [B*B, B, 1] in the memory's dtype
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # one table row's lookups, as views (`_lookup`)
        self._count_host = [max(0, min(k, B - 2) - a) for a in range(B) for k in range(B)]  # the same, on the host

    def clear(self, slot: int) -> None:
        # corr_index too: the drafter gathers with it even where valid == 0, and a stale index from the
        # slot's previous request can point past a new request's (shorter) context
        self.memory[slot] = 0
        self.features[slot] = 0
        self.corr_index[slot] = 0
        self.valid[slot] = 0
        self._position[slot] = -1
        self.suffix[slot] = -1
        self.target[slot] = -1
        self.filled.discard(slot)

    def observe(self, outcome) -> None:
        """After a round (runtime/round_outcome.py): remember its rejected suffix; a round without a drafter
        call empties the rows' memory (it would be stale)."""
        o, p = outcome, outcome.proposal
        if not p.drafted:
            self.forget(o.batch.slots)
            return
        if self.keeps_trajectory:
            self.write_trajectory(o.batch.slots, o.block[:, 1:], o.target_argmax, o.path_len, o.accepted)
        if o.batch.mode == "retrace":
            self.write(o.batch.slots, p.hidden, o.block, o.path_logits(), p.draft_logits, o.accepted,
                       o.batch.anchor_pos, o.target_argmax, o.path_len, o.host_accepted, p.space)

    def forget(self, slots: torch.Tensor) -> None:
        """Clear the rows of `slots` that hold anything (known on the host: no read)."""
        for s in self.filled.intersection(host_values(slots)):
            self.clear(s)

    def write(self, slots: torch.Tensor, hidden: torch.Tensor | None, block_tokens: torch.Tensor,
              verify_logits: torch.Tensor, draft_logits: torch.Tensor | None, accepted: torch.Tensor,
              anchor_pos: torch.Tensor, target_argmax: torch.Tensor | None = None,
              verified: torch.Tensor | None = None, host_accepted: list[int] | None = None,
              space: DraftSpace | None = None) -> None:
        """After a verify. hidden [N,B,d] drafter states (None: no draft call this round, the memory is
        emptied); block_tokens [N,1+S] = [anchor, d_1..d_S]; draft_logits [N,S,V] (slots 1..S);
        verify_logits [N,K+1,V] (K+1 <= B) at slots 0..K; accepted [N]; anchor_pos [N] = p;
        target_argmax [N,K+1] optional (verify_logits.argmax(-1), if the caller has it); verified [N]: the
        drafts each row sent to the target (default: all K). Only scored drafts are remembered.
        host_accepted: `accepted` on the host (the round's read), with `verified`'s host copy: the features'
        softmaxes then run over the rows some row keeps only (the same values: each row's softmax is its own).
        space: the index space of draft_logits (runtime/draft_space.py; None: the target's vocabulary)."""
        if hidden is None:
            self.forget(slots)
            return
        self.filled.update(host_values(slots))
        rows = self._rows(slots)
        S = block_tokens.shape[1] - 1
        K = verify_logits.shape[1] - 1
        if verified is None:
            verified = torch.full_like(accepted, K)
        host_verified = getattr(verified, "host_values", None)
        key = self._key(accepted, verified, S, host_accepted, host_verified)  # align(accepted, B, that), looked up
        old, corr, old_d, keep, on, valid = self._lookup(key)
        if target_argmax is None:
            target_argmax = verify_logits.argmax(-1)
        scored = self._scored(host_accepted, host_verified, S, K)
        self.memory[rows] = torch.gather(hidden, 1, old_d.expand(-1, -1, hidden.shape[-1])) * keep  # memory's dtype
        if scored is None:  # no row keeps a slot
            self.features[rows] = 0
        else:
            feats = kept_features(block_tokens, verify_logits, draft_logits, target_argmax, old, corr, scored, space)
            self.features[rows] = torch.where(on, feats, 0)
        self.valid[rows] = valid
        self.corr_index[rows] = corr
        accepted_host = host_accepted if host_accepted is not None else host_values(accepted)
        for s, p, a in zip(host_values(slots), host_values(anchor_pos), accepted_host, strict=True):
            self._position[s] = p + a + 1

    @property
    def count(self) -> torch.Tensor:
        """[slots] int64 valid slots per batch slot (they are new slots 1..count)."""
        return self.valid.sum(1).to(torch.int64)

    @property
    def position(self) -> torch.Tensor:
        """[slots] int64 the absolute position of each slot's new slot 0 (-1: no memory)."""
        return to_device(self._position, self._device, torch.int64)

    def _lookup(self, key: torch.Tensor | slice) -> tuple[torch.Tensor, ...]:
        """The alignment tables' rows for `key`: (old, corr, old [.., 1], keep, on, valid). A one-row key (a
        slice) is looked up once per table row and kept as views: a batch-1 round indexes no table."""
        if isinstance(key, slice) and key.start in self._views:
            return self._views[key.start]
        old, corr = self._aligned[key].unbind(1)
        found = (old, corr, self._old[key], self._keep[key], self._on[key], self._valid[key])
        if isinstance(key, slice):
            self._views[key.start] = found
        return found

    def _key(self, accepted: torch.Tensor, verified: torch.Tensor, S: int, host_accepted: list[int] | None,
             host_verified: list[int] | None) -> torch.Tensor | slice:
        """The rows of the alignment tables for (accepted, min(verified, S-1)): from the host values when
        they are known (one batch row: a slice, so the lookups are views), else computed on the device."""
        B = self.block_size
        if host_accepted is None or host_verified is None:
            return accepted * B + verified.clamp_max(S - 1)
        keys = [a * B + min(k, S - 1) for a, k in zip(host_accepted, host_verified, strict=True)]
        return slice(keys[0], keys[0] + 1) if len(keys) == 1 else to_device(keys, accepted.device)

    def _scored(self, accepted: list[int] | None, verified: list[int] | None, S: int, K: int) -> range | None:
        """The verify (and draft-logit) rows t = j - 1 whose features some row keeps, as one range (from the
        host values: rows a+1 .. a+count of each row; all of 0..min(K, S-1) when they are not known), or None
        when no row keeps a slot."""
        if accepted is None or verified is None:
            return range(min(K, S - 1) + 1)
        B = self.block_size
        spans = [(a + 1, a + c) for a, k in zip(accepted, verified, strict=True)
                 if (c := self._count_host[a * B + min(k, S - 1)]) > 0]
        if not spans:
            return None
        return range(min(lo for lo, _ in spans), max(hi for _, hi in spans) + 1)

    def read(self, slots: torch.Tensor, width: int | None = None) -> SuffixInputs:
        """The memory of `slots` (a contiguous range: views of the buffers, no copy; the next write comes
        after the drafter call that reads them); width: its first `width` new slots, for a block that
        narrow (a dense copy where the slice is not one piece of memory)."""
        rows = self._rows(slots)
        parts = (self.memory[rows], self.features[rows], self.valid[rows], self.corr_index[rows])
        if width is not None and width < self.block_size:
            parts = tuple(t[:, :width].contiguous() for t in parts)
        return SuffixInputs(*parts)

    @staticmethod
    def _rows(slots: torch.Tensor) -> slice | torch.Tensor:
        """A contiguous slot range as a slice (row writes are copies, reads are views), else the slots."""
        rows = contiguous_range(slots) if getattr(slots, "host_values", None) is not None else None
        return slots if rows is None else rows

    def write_trajectory(self, slots: torch.Tensor, top1: torch.Tensor, path_argmax: torch.Tensor,
                         path_len: torch.Tensor, accepted: torch.Tensor) -> None:
        """top1 [N, S]: the round's block tokens at old slots 1..S; path_argmax [N, L+1]: the target's argmax
        at the round path's nodes (old slots 0..L, padded); path_len [N]: each row's L; accepted [N]."""
        self.filled.update(host_values(slots))
        S, L = top1.shape[1], path_argmax.shape[1] - 1
        k, j = shift(accepted, self.block_size)
        j, ok = j[:, 1:], j[:, 1:] <= S  # new slots k = 1..B-1; d_j exists up to the block's end
        self.suffix[slots] = torch.where(ok, top1.gather(1, (j - 1).clamp(0, S - 1)), -1)
        ok = (j - 1) <= path_len.unsqueeze(1)  # the target's argmax at old slot j - 1, where the path reached it
        self.target[slots] = torch.where(ok, path_argmax.gather(1, (j - 1).clamp(0, L)), -1)

    def trajectory(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tree sources' chains at new slots 1..B-1 ([N, B-1] each, -1 = none)."""
        return {"suffix": self.suffix[slots], "target": self.target[slots]}
