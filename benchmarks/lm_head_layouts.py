"""ONNX Runtime LM head layouts against rows scored (not a test): the figures behind
retrace.runtime.lm_head_split.

    python benchmarks/lm_head_layouts.py [--vocab 151936 --hidden 1024] [--calls 7] [--threads 0]

Graphs over one random [V, d] table in external data (written once to --dir): P, the prepacked B operand
(MatMul(rows, W^T), as bundles held it before sharing; also what Gemm(rows, W, transB=1) gets); A, the
unpacked A operand (W @ rows^T, the shareable export); F, FusedMatMul(rows, W[1, V, d], transB=1), a 3-D B
that is never prepacked (GEMV for one row). Prints the RSS each session adds and median ms per row count,
the layouts' calls interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

ROWS = (1, 2, 3, 5, 8, 16)


def _rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024
    return 0


def _graphs(out: Path, V: int, d: int) -> dict[str, Path]:
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as H
    from onnx import numpy_helper as nh

    paths = {n: out / f"{n}-{V}x{d}.onnx" for n in "PAF"}
    if all(p.exists() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    W = np.random.default_rng(0).standard_normal((V, d), dtype=np.float32) * 0.02
    spec = {
        "P": ([H.make_node("MatMul", ["h", "WT"], ["y"])], nh.from_array(np.ascontiguousarray(W.T), "WT"), ["R", d]),
        "A": ([H.make_node("Transpose", ["h"], ["hT"], perm=[1, 0]), H.make_node("MatMul", ["W", "hT"], ["yT"]),
               H.make_node("Transpose", ["yT"], ["y"], perm=[1, 0])], nh.from_array(W, "W"), ["R", d]),
        "F": ([H.make_node("FusedMatMul", ["h", "W3"], ["y"], domain="com.microsoft", transB=1)],
              nh.from_array(W.reshape(1, V, d), "W3"), [1, "R", d]),
    }
    for name, (nodes, init, shape) in spec.items():
        g = H.make_graph(nodes, name, [H.make_tensor_value_info("h", T.FLOAT, shape)],
                         [H.make_tensor_value_info("y", T.FLOAT, None)], [init])
        m = H.make_model(g, opset_imports=[H.make_opsetid("", 17), H.make_opsetid("com.microsoft", 1)])
        m.ir_version = 8
        onnx.save(m, str(paths[name]), save_as_external_data=True, location=paths[name].name + ".data",
                  size_threshold=1024)
    return paths


def main(argv=None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--calls", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/retrace-lm-head-layouts"))
    args = ap.parse_args(argv)
    paths = _graphs(args.dir, args.vocab, args.hidden)
    so = ort.SessionOptions()
    so.log_severity_level, so.inter_op_num_threads, so.intra_op_num_threads = 3, 1, args.threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = {}
    for name, path in paths.items():
        before = _rss()
        sess[name] = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        print(f"{name}: session adds {(_rss() - before) / 1e9:.3f} GB RSS")
    rng = np.random.default_rng(1)
    hs = {r: rng.standard_normal((r, args.hidden), dtype=np.float32) for r in ROWS}
    times = {(n, r): [] for n in sess for r in ROWS}
    for _ in range(args.calls):
        for r in ROWS:
            for name, s in sess.items():
                feed = {"h": hs[r][None] if name == "F" else hs[r]}
                t0 = time.perf_counter()
                s.run(None, feed)
                times[(name, r)].append(time.perf_counter() - t0)
    for r in ROWS:
        print(f"rows {r:2d}  " + "  ".join(f"{n} {1000 * statistics.median(times[(n, r)]):8.3f} ms" for n in sess))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
