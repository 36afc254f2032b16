"""MatMulNBits' throughput against its row count M (not a test): int4, block 256, accuracy_level 4 (what
`retrace-export build --weights int4` makes), at the shapes of a Qwen3-0.6B-shaped drafter layer (the merged
gate/up projection, the down projection) and of an 8192-id draft-vocabulary head.

    python benchmarks/nbits_kernel_rows.py [--threads 2] [--reps 200]
    python benchmarks/nbits_kernel_rows.py --shapes 3072x8192 --rows 1,2,3,4,6,8,16 --float \
        --kernels int4:32:1,int4:256:1,int4:32:4,int4:128:4,int4:256:4,int8:256:4 --reps 40

The second form (a 12.5 MB int4 table: past this CPU's caches, like a whole model's layers) compares the
kernels and accuracy levels a bundle could use, beside fp32 SGEMM (`--float`), on what a verify of M rows
costs relative to a decode (docs/quantization.md, "The verify rows' cost on AVX2").

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

from retrace.runtime.nbits_probe import float_matmul, matmul_nbits

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
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN, comma-separated")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--kernels", default="int4:256:4", help="intBITS:BLOCK:ACCURACY_LEVEL, comma-separated")
    ap.add_argument("--float", action="store_true", help="also the float MatMul (MLAS SGEMM)")
    args = ap.parse_args()
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as our sessions run
    rng = np.random.default_rng(0)
    rows = [int(m) for m in args.rows.split(",")]
    for shape in args.shapes.split(","):
        k, n = (int(x) for x in shape.split("x"))
        models = {"fp32": float_matmul(k, n, k + n).SerializeToString()} if args.float else {}
        for spec in args.kernels.split(","):
            bits, block, level = (int(x) for x in spec.removeprefix("int").split(":"))
            models[f"int{bits} block {block} acc {level}"] = matmul_nbits(k, n, bits, block, level, seed=k + n)
        for name, model in models.items():
            sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            one = None
            for m in rows:
                ms = median_ms(sess, rng.standard_normal((m, k)).astype(np.float32), args.reps)
                one = one or ms
                print(f"K={k} N={n} {name}: M={m:2d} {ms:.3f} ms  {m * k * n / ms / 1e6:6.1f} GMAC/s  "
                      f"x M=1 {ms / one:.2f}", flush=True)


if __name__ == "__main__":
    main()
