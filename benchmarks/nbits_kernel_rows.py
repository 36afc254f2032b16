"""MatMulNBits' throughput against its row count M (not a test): int4, block 256, accuracy_level 4 (what
`retrace-export build --weights int4` makes), at the shapes of a Qwen3-0.6B-shaped drafter layer (the merged
gate/up projection, the down projection) and of an 8192-id draft-vocabulary head.

    python benchmarks/nbits_kernel_rows.py [--threads 2] [--reps 200]

One quantized MatMul per session, quantized by onnxruntime's own MatMulNBitsQuantizer (weights of a few MB:
cache-resident, so M = 1 here is not the memory-bound decode step of a whole model); prints the median ms, the
GMAC/s and the cost relative to M = 1 per M. It bounds what a 16-slot draft call can cost on this CPU
(docs/quantization.md, "The int4 draft call's floor").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort

from retrace.runtime.nbits_probe import matmul_nbits

SHAPES = ((1024, 6144), (3072, 1024), (1024, 8192))  # (K, N): gate/up merged, down, draft head
ROWS = (1, 2, 4, 8, 16, 20)


def median_ms(sess, x, reps: int) -> float:
    for _ in range(20):
        sess.run(None, {"x": x})
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run(None, {"x": x})
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as our sessions run
    rng = np.random.default_rng(0)
    for k, n in SHAPES:
        sess = ort.InferenceSession(matmul_nbits(k, n, 4, 256, 4, seed=k + n), so,
                                    providers=["CPUExecutionProvider"])
        one = None
        for m in ROWS:
            ms = median_ms(sess, rng.standard_normal((m, k)).astype(np.float32), args.reps)
            one = one or ms
            print(f"K={k} N={n} M={m:2d}: {ms:.3f} ms  {m * k * n / ms / 1e6:6.1f} GMAC/s  x M=1 {ms / one:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
