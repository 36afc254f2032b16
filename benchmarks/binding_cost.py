"""What binding a target call's inputs and outputs costs on the host: a fresh IOBinding with every name bound
(what each call did before retrace.runtime.ort_io_binding.BoundSession) against the kept binding's checks
(what a call does now when only the small per-call feeds moved), on the feeds of one real decode call of a
loaded bundle (not a test):

    python benchmarks/binding_cost.py --engine BUNDLE [--reps 300] [--threads 2]

Prints the number of inputs and outputs of the call and both costs in microseconds per call.
"""

from __future__ import annotations

import argparse
import time

import torch

from retrace.runtime import ort_io_binding as io
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    be = OnnxRuntimeBackend.from_bundle(a.engine, max_batch=1, threads=a.threads, verify=False)
    slots = torch.arange(1)
    be.target(slots, torch.randint(0, 500, (1, 8)), torch.arange(8)[None], torch.full((1, 1), 7))
    be.target(slots, torch.randint(0, 500, (1, 1)), torch.tensor([[8]]), torch.zeros(1, 1, dtype=torch.int64))
    bound = be.tgraph.bound  # what the decode call above left bound: its tensors, by name
    feeds, outputs = ({k: t for k, (t, _) in side.items()} for side in bound._bound)

    t0 = time.perf_counter()
    for _ in range(a.reps):
        b = bound.sess.io_binding()
        for name, t in feeds.items():
            io.bind_input(b, name, t)
        for name, t in outputs.items():
            io.bind_output(b, name, t)
    fresh = (time.perf_counter() - t0) / a.reps * 1e6

    t0 = time.perf_counter()
    for _ in range(a.reps):
        for tensors, side in ((feeds, bound._bound[0]), (outputs, bound._bound[1])):
            for name, t in tensors.items():
                last = side[name]
                if last[0] is not t and last[1] != io._key(t):
                    raise SystemExit(f"{name} moved between two identical checks")
    kept = (time.perf_counter() - t0) / a.reps * 1e6
    print(f"{a.engine}: {len(feeds)} inputs, {len(outputs)} outputs per decode call; fresh binding "
          f"{fresh:.0f} us per call, kept binding's checks {kept:.0f} us")


if __name__ == "__main__":
    main()
