"""What a round costs on this machine and backend: t_verify(rows, tokens) and t_draft(rows), in seconds.

Learned from the rounds' own timings: an exponential moving average per (rows, tokens) bucket. A bucket
not measured yet is read off the measured ones of the same row count (piecewise-linear between them; past
the last one, or when only one exists, with the prior slope), or, for a row count never seen, from the
nearest measured one (a row count's first round uses its neighbour's). The prior slope is relative to a one-token
verify: `rel_slope` extra per added token
and row (on a 2-core CPU at the Qwen3-0.6B shape a verify of T tokens costs 1 + 0.06 (T - 1) of T = 1; on
the zoo pair fixed per-call costs dominate and it is ~0). `probe()` measures it on a free slot.
The first call of each (rows, tokens) verify bucket and (rows, slots) draft bucket is not learned: a backend's
first call at a new shape pays one-off costs (ONNX Runtime's memory planning, an inductor compile, a CUDA graph
capture). At the Qwen3-0.6B shape, fp32, batch 4, the first 2-token verify took 278 ms and the later ones 222;
kept as an EMA's seed it priced that verify 20% high for dozens of rounds, and a bucket priced out is never
called again to correct it. `observe_*(..., warm=True)`: a call whose shape ran before (`probe` warms up).
A bucket (verify or draft) is provisional until `confirm` (3) rounds timed it: it is priced at the lowest of
its own timings and what the other buckets of its row count say for it (the interpolation above, without it;
for a draft width, the nearest other width scaled), and then seeded with the median of those timings. With a
single timing as its seed, one slow round (another process, a page fault, a collection) priced a width high
for good: a bucket priced out is never called again, so nothing corrected it. A width that really costs
more is tried at most `confirm` times. Warm timings (`probe`) are trusted at once.
The timings come from the loop's stopwatch (runtime/stopwatch.py): host timers on the CPU, CUDA events on
CUDA, so the costs stay the device's once the round runs asynchronously.
"""

from __future__ import annotations

from bisect import bisect_left

import torch

from retrace.runtime.device import device_of, index_tensor
from retrace.runtime.stopwatch import stopwatch_for

# A draft call's cost per block width w (slots + 1) goes as DRAFT_WIDTH_BASE + w, for widths not timed yet:
# measured at the Qwen3-0.6B shape, int4, batch 1, 2 threads, blocks 4 / 8 / 16: 3.8-4.1 / 5.0 / 7.7-8.0 ms
DRAFT_WIDTH_BASE = 8


class CostModel:
    def __init__(self, rel_slope: float = 0.06, draft_rel: float = 0.5, alpha: float = 0.2,
                 base_s: float = 1e-3, min_rel_slope: float = 0.01, block_size: int = 16, confirm: int = 3):
        self.rel_slope = rel_slope  # prior: extra verify cost per added token and row, relative to T=1
        # floor of a measured slope: timing noise can make a longer verify look free, and then every
        # hopeless draft would be verified "for nothing"
        self.min_rel_slope = min_rel_slope
        self.draft_rel = draft_rel  # prior: a whole-block draft call relative to a one-token verify
        self.block_size = block_size  # the whole block: a narrower one's prior scales by its width
        self.alpha = alpha
        self.base_s = base_s  # prior: seconds of a one-row one-token verify, until one is measured
        self.verify_s: dict[int, dict[int, float]] = {}  # rows -> tokens -> EMA seconds
        self.draft_s: dict[int, dict[int, float]] = {}  # rows -> draft slots S (0: not said) -> EMA seconds
        self._called: set[tuple[str, int, int]] = set()  # buckets whose first call was seen (and not learned)
        if confirm < 1:
            raise ValueError(f"confirm: timings that confirm a bucket, >= 1 (got {confirm})")
        self.confirm = confirm
        self._provisional: dict[tuple[str, int, int], list[float]] = {}  # bucket -> its timings, until confirmed

    # -- measurements ----------------------------------------------------------------------------------
    def observe_verify(self, rows: int, tokens: int, seconds: float, warm: bool = False) -> None:
        self._learn(self.verify_s, ("verify", rows, tokens), seconds, warm)

    def observe_draft(self, rows: int, seconds: float, slots: int = 0, warm: bool = False) -> None:
        """A draft call of `slots` draft slots (the block [anchor, MASK x slots]; 0: a width not said)."""
        self._learn(self.draft_s, ("draft", rows, slots), seconds, warm)

    def _learn(self, tables: dict[int, dict[int, float]], bucket: tuple[str, int, int], seconds: float,
               warm: bool) -> None:
        if warm:
            self._provisional.pop(bucket, None)
        elif bucket not in self._called:  # a shape's first call: one-off costs
            self._called.add(bucket)
            return
        _, rows, key = bucket
        table = tables.setdefault(rows, {})
        if not warm and (bucket in self._provisional or key not in table):  # its first timings (module docstring)
            times = self._provisional.setdefault(bucket, [])
            times.append(seconds)
            confirmed = len(times) >= self.confirm
            table[key] = sorted(times)[len(times) // 2] if confirmed else min(times)
            if confirmed:
                del self._provisional[bucket]
            return
        old = table.get(key)
        table[key] = seconds if old is None else old + self.alpha * (seconds - old)

    # -- predictions -----------------------------------------------------------------------------------
    def _table_rows(self, rows: int) -> int | None:
        """The row count whose measured verifies stand for this one: itself, else the nearest measured."""
        if rows in self.verify_s:
            return rows
        if not self.verify_s:
            return None
        return min(self.verify_s, key=lambda n: (abs(n - rows), n))

    def verify(self, rows: int, tokens: int) -> float:
        src = self._table_rows(rows)
        table = None if src is None else self.verify_s[src]
        if table and tokens in table:
            return self._priced(("verify", src, tokens), table, lambda others: self._read(others, rows, tokens))
        return self._read(table, rows, tokens)

    def _priced(self, bucket: tuple[str, int, int], table: dict[int, float], read) -> float:
        """A timed bucket's price: its table entry, or while provisional the lower of that and `read` of the
        row count's other entries (none: nothing else to judge it by)."""
        key = bucket[2]
        if bucket not in self._provisional or len(table) == 1:
            return table[key]
        return min(table[key], read({k: v for k, v in table.items() if k != key}))

    def _read(self, table: dict[int, float] | None, rows: int, tokens: int) -> float:
        """`tokens` read off the measured token counts of `table` (not among them), or the prior."""
        rel = self.rel_slope * rows
        if not table:
            return self.base_s * (1 + rel * (tokens - 1))
        ts = sorted(table)
        i = bisect_left(ts, tokens)
        if 0 < i < len(ts):  # between two measured token counts
            lo, hi = ts[i - 1], ts[i]
            return table[lo] + (tokens - lo) / (hi - lo) * (table[hi] - table[lo])
        if len(ts) >= 2:
            floor = self.min_rel_slope * rows * table[ts[0]] / (1 + self.min_rel_slope * rows * (ts[0] - 1))
            slope = max(floor, (table[ts[-1]] - table[ts[0]]) / (ts[-1] - ts[0]))
        else:  # the prior's relative slope, scaled to the one measurement
            slope = rel * table[ts[0]] / (1 + rel * (ts[0] - 1))
        edge = ts[0] if i == 0 else ts[-1]
        return max(table[edge] + slope * (tokens - edge), 1e-9)

    def draft(self, rows: int, slots: int = 0) -> float:
        """A draft call of `slots` draft slots (0: any width, the widest timed). A width not timed for this
        row count: the nearest timed one's, scaled by (DRAFT_WIDTH_BASE + width) per block width (slots + 1;
        no scaling where either width is not said); a row count not timed: the nearest one's, scaled as its
        one-token verify; nothing timed: the prior, `draft_rel` of a one-token verify for the whole block,
        scaled by width the same way (at fp32, batch 4, the 0.6B shape a 3-slot draft took 0.26 of a decode,
        the unscaled prior said 0.5; a draft after a pause is not timed, runtime/round_outcome.py, so the
        prior can be all the policy has for a width)."""
        if rows not in self.draft_s:
            if self.draft_s:
                near = min(self.draft_s, key=lambda n: (abs(n - rows), n))
                return self.draft(near, slots) * self.verify(rows, 1) / self.verify(near, 1)
            return self.draft_rel * self.verify(rows, 1) * self._width_scale(slots, self.block_size - 1)
        table = self.draft_s[rows]
        if slots not in table:
            return self._draft_read(table, slots)
        return self._priced(("draft", rows, slots), table, lambda others: self._draft_read(others, slots))

    def _draft_read(self, table: dict[int, float], slots: int) -> float:
        """A width not in `table` (one row count's timed widths) read off the nearest timed one."""
        have = max(table) if not slots else min(table, key=lambda s: (abs(s - slots), -s))
        if not slots or not have:
            return table[have]
        return table[have] * self._width_scale(slots, have)

    @staticmethod
    def _width_scale(slots: int, have: int) -> float:
        """A draft of `slots` slots against one of `have` (0: not said, no scaling)."""
        return (DRAFT_WIDTH_BASE + slots + 1) / (DRAFT_WIDTH_BASE + have + 1) if slots and have else 1.0

    def to_dict(self) -> dict:
        return {"verify_s": {str(n): {str(t): s for t, s in sorted(tab.items())}
                             for n, tab in sorted(self.verify_s.items())},
                "draft_s": {str(n): {str(w): s for w, s in sorted(tab.items())}
                            for n, tab in sorted(self.draft_s.items())}}


def probe(backend, block_size: int, repeats: int = 2) -> CostModel:
    """A prior from a few calls on a free slot (slot 0, before any request: the prefill of the first
    request there overwrites positions 0.., and positions beyond a request's anchor are masked): one-token
    and full-block verifies and one draft, each timed `repeats` times after a warm-up; keeps the fastest.
    Optional (make_policy(..., probe=True), benchmarks/verify_policy.py): the rounds' own timings replace
    it within a few rounds, and a wrapped backend (tests' oracle drafters) may not accept such calls."""
    model = CostModel(block_size=block_size)
    dev = device_of(backend)
    clock = stopwatch_for(dev)  # CUDA events on CUDA: the device's time, not the launch's
    slot = index_tensor([0], dev)
    tc = backend.target_config
    ids = torch.zeros(1, block_size, dtype=torch.int64, device=dev)
    pos1, pos = index_tensor([[0]], dev), index_tensor([list(range(block_size))], dev)

    def best(fn) -> float:
        fn()  # warm-up (first-call allocations)
        times = []
        for _ in range(repeats):
            t0 = clock.mark()
            fn()
            times.append(clock.seconds(t0, clock.mark()))
        return min(times)

    t1 = best(lambda: backend.target(slot, ids[:, :1], pos1, torch.zeros(1, 1, dtype=torch.int64, device=dev)))
    tB = best(lambda: backend.target(slot, ids, pos, torch.arange(block_size, device=dev).unsqueeze(0)))
    model.base_s = t1
    model.rel_slope = max(0.0, (tB - t1) / ((block_size - 1) * t1))
    model.observe_verify(1, 1, t1, warm=True)
    model.observe_verify(1, block_size, tB, warm=True)
    dc = backend.drafter_config
    if dc is not None:
        taps = torch.zeros(1, block_size, tc.hidden_size * dc.num_taps, device=dev)
        block = torch.full((1, block_size), dc.mask_token_id, dtype=torch.int64, device=dev)
        model.observe_draft(1, best(lambda: backend.draft(slot, taps, pos, block, pos, None)), block_size - 1,
                            warm=True)
    return model
