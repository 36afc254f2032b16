"""The torch backend's static-shape steps: a call placed at its own slots (views of the caches) against the
same call gathered (a copy of every layer's window), interleaved in one process (not a test).

    python benchmarks/placed_slots.py --target DIR [--batch 4] [--pasts 256,1024] [--widths 1,4] [--calls 6]

The backend runs its padded steps eagerly (`static_shapes=True`: what a CUDA graph replays on a GPU; on the
CPU it is an option, not the default). Every slot is prefilled to the longest past; then each (past, T) call
over slots 0..batch-1 alternates between the placed step (runtime/step_buckets.py `slot_order`) and the
gathered one (`place_rows` off, as before the placed steps existed). Prints the median ms per call of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import retrace.runtime.torch_backend as tb
from retrace.runtime.device import index_tensor


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="a Qwen3 directory")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--pasts", default="256,1024")
    ap.add_argument("--widths", default="1,4")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    pasts, widths = [int(x) for x in a.pasts.split(",")], [int(x) for x in a.widths.split(",")]
    be = tb.TorchBackend.from_dirs(a.target, None, max_batch=a.batch, max_seq_len=max(pasts) + 32,
                                   threads=a.threads, static_shapes=True)
    slots = index_tensor(list(range(a.batch)), be.device)
    for s in range(a.batch):  # a prefill wider than every bucket runs the window steps (no order involved)
        be.target(index_tensor([s], be.device), torch.zeros(1, max(pasts), dtype=torch.int64),
                  index_tensor([list(range(max(pasts)))], be.device), index_tensor([[max(pasts) - 1]], be.device))
    def call(past: int, T: int, gathered: bool) -> float:
        be.place_rows = not gathered
        t0 = time.perf_counter()
        be.target(slots, torch.zeros(a.batch, T, dtype=torch.int64),
                  index_tensor([list(range(past, past + T))] * a.batch, be.device),
                  index_tensor([list(range(T))] * a.batch, be.device))
        return (time.perf_counter() - t0) * 1e3

    print(f"batch {a.batch}, {a.threads} threads, ms per target call (median of {a.calls})")
    for past in pasts:
        for T in widths:
            call(past, T, False), call(past, T, True)  # warm-up
            times = {False: [], True: []}
            for _ in range(a.calls):
                for gathered in (False, True):
                    times[gathered].append(call(past, T, gathered))
            p, g = statistics.median(times[False]), statistics.median(times[True])
            print(f"past {past:5d} T={T:2d}: placed {p:8.1f}  gathered {g:8.1f}  gathered/placed {g / p:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
