"""Row-invariant target calls: every row of a call computed by the same kernels whatever the call's width, so
a verify row's logits are bit-identical to the decode step's that `ar` runs and greedy speculative decoding
reproduces `ar` exactly, not only up to near ties.

Measured on ONNX Runtime 1.32, CPU provider (docs/quantization.md, "Row invariance"):
- GroupQueryAttention has a one-token path (AVX-512): a T=1 call's attention output differs in the last bits
  from the same row in any T >= 2 call (widths >= 2 agree bit for bit). The in-place graph therefore gives
  the operator max(T, 2) rows (retrace.runtime.kv_inplace `pad_attention`): one attention row more for a
  one-token call, nothing for wider ones (until 2026-12-03 every call got T + 1).
- float MatMul (MLAS SGEMM) is row-invariant at every M.
- MatMulNBits depends on the CPU as well as on the bits, block size and accuracy level, so the rule is
  probed on this machine when a bundle loads (runtime/nbits_probe.py). Int4, accuracy_level 4: on an
  AVX-512 Intel Xeon every M agrees for blocks <= 32, and at blocks >= 64 a one-row kernel (the decode
  step's) also computes the odd last row of M, so rows agree only when M is even ("pairs"); on an AVX2 AMD
  EPYC only block 16 agrees at every M, and blocks 32-256 need M >= 2 ("two"); int8 there agrees at every M.
  Accuracy levels 0-3: M >= 2.
- int8 activation rounding turns last-bit differences into ~1e-3 of the logits: before this module 3-4 of
  16 prompts x 96 tokens of the int4 0.6B bundle's fixed-policy retrace and prompt-lookup outputs left its
  own `ar` output at near ties.
`RowWidths` pads what the kernels need: the tokens of a call (input_ids, positions and a tree's mask)
and the logits rows (logits_index), each by at most one entry. Rules: "any" (nothing), "two" (M >= 2),
"pairs" (M even). M counts rows over the whole batch (N rows x T tokens, or N x K logits rows). Pad tokens
repeat the last token one position further (a tree's pad node sees the past and itself; nobody sees it);
their K/V land one entry past the call, which the next call overwrites (caches keep `SPARE` entries
beyond max_seq_len). Outputs are cut back to T / K. The ONNX Runtime backend applies all this on the CPU
execution provider only: other providers' kernels were not measured, and their calls are not padded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

SPARE = 1  # cache entries beyond max_seq_len: the pad row of a call that ends at max_seq_len
RULES = ("any", "two", "pairs")


def nbits_rule(block_size: int | None, accuracy_level: int | None, bits: int = 4, ks: tuple[int, ...] = (),
               threads: int | None = 1) -> str:
    """The rows this CPU's MatMulNBits of these settings needs to be row-invariant at each depth K in `ks`
    (probed: runtime/nbits_probe.py); "any" for float weights. A kernel that no padding makes row-invariant
    is reported once (exactness then holds only up to near ties) and padded as "pairs"."""
    if block_size is None:  # float
        return "any"
    from retrace.runtime.nbits_probe import probe_rule

    rules = [probe_rule(k, bits, block_size, accuracy_level or 0, threads) for k in ks]
    if None in rules:
        warnings.warn(f"MatMulNBits ({bits} bits, block {block_size}, accuracy_level {accuracy_level}) computes "
                      "rows differently at every width on this CPU: speculative outputs equal `ar` only up to near "
                      "ties; a bundle built with --weight-block-size 16 is row-invariant on the CPUs measured",
                      RuntimeWarning, stacklevel=2)
        return "pairs"
    return stricter("any", *rules)


def stricter(*rules: str) -> str:
    return max(rules, key=RULES.index)


def _extra(rule: str, n: int, t: int) -> int:
    m = n * t
    return int(rule == "two" and m == 1 or rule == "pairs" and m % 2 == 1)


@dataclass(frozen=True)
class RowWidths:
    tokens: str  # the rule for the graph's body (every linear layer; attention handled in the graph or here)
    rows: str  # the rule for the LM head (the logits rows)

    def pad(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_index: torch.Tensor,
            tree_mask: torch.Tensor | None):
        """-> (input_ids, positions, logits_index, tree_mask), padded where the rules ask (else unchanged)."""
        N, T = input_ids.shape
        if _extra(self.tokens, N, T):
            input_ids = torch.cat([input_ids, input_ids[:, -1:]], 1)
            positions = torch.cat([positions, positions[:, -1:] + 1], 1)
            tree_mask = None if tree_mask is None else pad_tree_mask(tree_mask, T + 1)
        if _extra(self.rows, N, logits_index.shape[1]):
            logits_index = torch.cat([logits_index, logits_index[:, -1:]], 1)
        return input_ids, positions, logits_index, tree_mask


def pad_tree_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """[N, T, T] -> [N, width, width]: each pad node attends to itself only (and the past), none to it."""
    N, T, _ = mask.shape
    if width == T:
        return mask
    grown = torch.zeros(N, width, width, dtype=mask.dtype, device=mask.device)
    grown[:, :T, :T] = mask
    grown[:, range(T, width), range(T, width)] = True
    return grown


def rows_matching_decodes(be, widths=(2, 3, 4, 5, 8, 9), prefill: int = 6, seed: int = 0) -> dict[int, int]:
    """The check behind this module, on any backend: for each width T, how many rows of ONE T-token target call
    are bit-identical to the T one-token calls (the decode steps `ar` runs) over the same random tokens from
    the same past. Writes slots 0 and 1 of the backend's caches (slot 0 only in a one-slot backend: the wide call
    then writes over the decode steps' entries, from the same past)."""
    g = torch.Generator().manual_seed(seed)
    wide = min(1, be.max_batch - 1)
    V = be.target_config.vocab_size
    T = max(widths)
    ids = torch.randint(0, V, (1, prefill + T), generator=g)

    def call(slot: int, start: int, n: int) -> torch.Tensor:
        chunk = ids[:, start:start + n]
        return be.target(torch.tensor([slot]), chunk, torch.arange(start, start + n)[None], torch.arange(n)[None])[0][0]

    for slot in {0, wide}:
        call(slot, 0, prefill)
    decodes = [call(0, prefill + i, 1)[0] for i in range(T)]
    out = {}
    for w in widths:
        rows = call(wide, prefill, w)
        out[w] = sum(torch.equal(rows[i], decodes[i]) for i in range(w))
    return out
