"""A target call on scattered slots, gathered against covered (runtime/slot_cover.py) (not a test).

    python benchmarks/scattered_slots.py --engine BUNDLE [--past 200] [--calls 4] [--threads 2]

Every slot of a bundle with max_batch >= 4 is prefilled to `past` positions; then each slot set below is called
`calls` times at T = 1 and 2 (ms per call): contiguous, scattered while the gap holds a live cache (gathered),
and the same set once the gap's slot is released (covered: a dummy row there).
"""

from __future__ import annotations

import argparse
import time

import torch

from retrace.runtime import Runtime
from retrace.runtime.device import index_tensor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--past", type=int, default=200)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    be = Runtime.from_bundle(a.engine, max_batch=4, threads=a.threads).backend
    for s in range(4):
        be.target(index_tensor([s], "cpu"), torch.zeros(1, a.past, dtype=torch.int64),
                  torch.arange(a.past).unsqueeze(0), index_tensor([[a.past - 1]], "cpu"))

    def call(slots: list[int], T: int) -> float:
        N = len(slots)
        t0 = time.perf_counter()
        be.target(index_tensor(slots, "cpu"), torch.zeros(N, T, dtype=torch.int64),
                  (a.past + torch.arange(T)).repeat(N, 1), torch.full((N, 1), T - 1))
        return time.perf_counter() - t0

    for label, slots, release in (("contiguous", [0, 1, 2], None), ("gathered", [0, 1, 3], None),
                                  ("covered", [0, 1, 3], 2), ("contiguous", [0, 1, 2, 3], None),
                                  ("gathered", [0, 2], None), ("covered", [0, 2], 1)):
        if release is not None:
            be.release(release)
        for T in (1, 2):
            ms = " ".join(f"{call(slots, T) * 1e3:.0f}" for _ in range(a.calls))
            print(f"{label:10s} {str(slots):13s} T={T}: {ms} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
