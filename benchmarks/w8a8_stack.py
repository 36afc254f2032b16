"""The linear layers of a stack of Qwen3-0.6B-shaped decoder layers (q, k, v, o, gate, up, down; no attention)
as fp32 MatMul, MatMulNBits int4 and int8 (ONNX Runtime's quantizer, accuracy level 4) and W8A8
(retrace.export.w8a8), each in its own session, called interleaved at 1..16 rows (not a test):

    python benchmarks/w8a8_stack.py [--layers 6] [--rows 1,2,4,8,16] [--threads 2] [--reps 12]

Prints the median ms per call and its ratio to one row, the error against fp32 of the stack's output (random
layers without norms compound it: `--layers 1` for one layer's), and whether row 0 of the widest call equals
the same row alone, bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = (("q", 1024, 2048), ("k", 1024, 1024), ("v", 1024, 1024), ("o", 2048, 1024), ("gate", 1024, 3072),
          ("up", 1024, 3072), ("down", 3072, 1024))


def stack(layers: int, seed: int = 0):
    """fp32 ModelProto: x [M, 1024] -> per layer q/k/v from x, o from [q|k+v] sliced to 2048, gate/up from o's
    output, down from tanh(gate) * up, plus the residual (a norm-free stand-in with the real matmul shapes)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []

    def linear(x, name, k, n):
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, name + ".weight"))
        nodes.append(helper.make_node("MatMul", [x, name + ".weight"], [name], name=name))
        return name

    x = "x"
    for i in range(layers):
        q, k, v = (linear(x, f"l{i}.{n}", 1024, m) for n, _, m in SHAPES[:3])
        nodes.append(helper.make_node("Add", [k, v], [f"l{i}.kv"]))
        nodes.append(helper.make_node("Concat", [f"l{i}.kv", f"l{i}.kv"], [f"l{i}.kv2"], axis=-1))
        nodes.append(helper.make_node("Add", [q, f"l{i}.kv2"], [f"l{i}.attn"]))
        o = linear(f"l{i}.attn", f"l{i}.o", 2048, 1024)
        g, u = linear(o, f"l{i}.gate", 1024, 3072), linear(o, f"l{i}.up", 1024, 3072)
        nodes.append(helper.make_node("Tanh", [g], [f"l{i}.act"]))
        nodes.append(helper.make_node("Mul", [f"l{i}.act", u], [f"l{i}.mlp"]))
        d = linear(f"l{i}.mlp", f"l{i}.down", 3072, 1024)
        nodes.append(helper.make_node("Add", [x, d], [f"l{i}.out"]))  # the residual
        x = f"l{i}.out"
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 1024])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["M", 1024])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def variants(layers: int, out: Path) -> dict[str, Path]:
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from retrace.export.w8a8 import convert

    paths = {}

    def save(name, model):
        paths[name] = out / f"{name}.onnx"
        onnx.save(model, str(paths[name]), save_as_external_data=True, location=f"{name}.data")

    save("fp32", stack(layers))
    for name, bits, block in (("int4 b256", 4, 256), ("int8 b128", 8, 128)):
        q = MatMulNBitsQuantizer(stack(layers), bits=bits, block_size=block, is_symmetric=True, accuracy_level=4)
        q.process()
        save(name.replace(" ", "_"), q.model.model)
    w8 = stack(layers)
    convert(w8)
    save("w8a8", w8)
    return paths


def main() -> None:
    import logging

    import onnxruntime as ort

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    rows = [int(r) for r in args.rows.split(",")]
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")  # interleaved sessions: no spinning
    so.log_severity_level = 3
    with tempfile.TemporaryDirectory() as d:
        sess = {n.replace("_", " "): ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
                for n, p in variants(args.layers, Path(d)).items()}
        rng = np.random.default_rng(1)
        first = {}
        for m in rows:
            x = rng.standard_normal((m, 1024)).astype(np.float32)
            times = {n: [] for n in sess}
            for _ in range(args.reps):
                for n, s in sess.items():
                    t0 = time.perf_counter()
                    s.run(None, {"x": x})
                    times[n].append((time.perf_counter() - t0) * 1e3)
            med = {n: statistics.median(t[2:]) for n, t in times.items()}
            first = first or med
            print(f"rows {m:2d}  " + "  ".join(f"{n} {t:7.2f} ms ({t / first[n]:.2f}x)" for n, t in med.items()))
        wide = rng.standard_normal((max(rows), 1024)).astype(np.float32)
        ref = sess["fp32"].run(None, {"x": wide})[0]
        for n, s in sess.items():
            y = s.run(None, {"x": wide})[0]
            err = float(np.abs(y - ref).max() / np.abs(ref).max())
            same = bool((s.run(None, {"x": wide[:1]})[0] == y[:1]).all())
            print(f"{n:10s} max |error| / max |fp32| {err:.4f}   row 0 alone == row 0 of {max(rows)}: {same}")


if __name__ == "__main__":
    main()
