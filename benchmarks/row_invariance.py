"""Which ONNX Runtime CPU kernels compute a row the same way at every call width (not a test; the table in
docs/quantization.md, "Row invariance", and the reason for retrace/runtime/row_invariance.py).

    python benchmarks/row_invariance.py [--threads 2] [--bundle DIR ...]

Kernels, random weights at the Qwen3-0.6B shape: for M = 1..16 rows, is each row of an M-row call bit-equal to
the same row in a 16-row call? (float MatMul; MatMulNBits int4 at blocks 16-256 and accuracy levels 0 and 4,
int8 at level 4, each with the rule the backend probes for it on this CPU;
GroupQueryAttention over a 40-token past, each one-token call against the matching row of an 8-token one.)
`--bundle`: the bundle-level check (`rows_matching_decodes`) with and without the padding.
"""

from __future__ import annotations

import argparse
import logging

import numpy as np


def _session(model, threads: int):
    """A CPU session of an onnx model or of its serialized bytes."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def _widths_that_differ(sess, K: int, rng) -> list[int]:
    x = rng.standard_normal((16, K)).astype(np.float32)
    full = sess.run(None, {"x": x})[0]
    return [m for m in range(1, 16) if not np.array_equal(sess.run(None, {"x": x[:m]})[0], full[:m])]


def _gqa_one_token_differs(threads: int, rng, H: int = 16, KVH: int = 8, hd: int = 128, P: int = 40, T: int = 8):
    from onnx import TensorProto as TP
    from onnx import helper

    f = TP.FLOAT
    node = helper.make_node("GroupQueryAttention", ["q", "k", "v", "pk", "pv", "sl", "tot"], ["y", "ok", "ov"],
                            domain="com.microsoft", num_heads=H, kv_num_heads=KVH)
    shapes = {"q": [1, "T", H * hd], "k": [1, "T", KVH * hd], "v": [1, "T", KVH * hd], "pk": [1, KVH, "P", hd],
              "pv": [1, KVH, "P", hd]}
    ins = [helper.make_tensor_value_info(n, f, shape) for n, shape in shapes.items()]
    ins += [helper.make_tensor_value_info("sl", TP.INT32, [1]), helper.make_tensor_value_info("tot", TP.INT32, [])]
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("y", "ok", "ov")]
    model = helper.make_model(helper.make_graph([node], "g", ins, outs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    s = _session(model, threads)
    q, k, v = (rng.standard_normal((1, T, n * hd)).astype(np.float32) for n in (H, KVH, KVH))
    pk, pv = (rng.standard_normal((1, KVH, P, hd)).astype(np.float32) for _ in range(2))

    def run(qq, kk, vv, ppk, ppv):
        tot = ppk.shape[2] + qq.shape[1]
        return s.run(None, {"q": qq, "k": kk, "v": vv, "pk": ppk, "pv": ppv, "sl": np.array([tot - 1], np.int32),
                            "tot": np.array(tot, np.int32)})[0][0]

    full = run(q, k, v, pk, pv)
    kh, vh = (x.reshape(1, T, KVH, hd).transpose(0, 2, 1, 3) for x in (k, v))
    diffs = []
    for i in range(T):
        one = run(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], np.concatenate([pk, kh[:, :, :i]], 2),
                  np.concatenate([pv, vh[:, :, :i]], 2))[0]
        diffs.append(float(np.abs(one - full[i]).max()))
    return max(diffs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bundle", action="append", default=[])
    args = ap.parse_args()
    logging.disable(logging.INFO)  # the quantizer's progress lines
    rng = np.random.default_rng(0)
    shapes = ((1024, 6144), (3072, 1024), (1024, 151936))
    from retrace.runtime.nbits_probe import float_matmul, matmul_nbits, probe_rule

    print("widths M (1..15) whose rows differ from the same rows of a 16-row call:")
    for K, N in shapes:
        print(f"  float MatMul {K}x{N}: "
              f"{_widths_that_differ(_session(float_matmul(K, N, seed=K + N), args.threads), K, rng)}")
    for level, bits in ((0, 4), (4, 4), (4, 8)):
        for block in (16, 32, 64, 128, 256):
            for K, N in shapes[:2]:
                s = _session(matmul_nbits(K, N, bits, block, level, seed=block + K), args.threads)
                print(f"  MatMulNBits int{bits} level {level} block {block} {K}x{N}: {_widths_that_differ(s, K, rng)}"
                      f"; the rule the runtime probes (runtime/nbits_probe.py): "
                      f"{probe_rule(K, bits, block, level, args.threads)}")
    gqa = _gqa_one_token_differs(args.threads, rng)
    print(f"GroupQueryAttention: one-token calls vs an 8-token call, max |diff| {gqa:.2g}")
    if args.bundle:
        from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend
        from retrace.runtime.row_invariance import rows_matching_decodes

        for d in args.bundle:
            for inv in (True, False):
                be = OnnxRuntimeBackend.from_bundle(d, threads=args.threads, max_batch=2, verify=False,
                                                    row_invariant=inv)
                print(f"{d} row_invariant={inv}: rows equal to the decode steps per width "
                      f"{rows_matching_decodes(be, widths=(2, 3, 4, 5, 7, 8, 9, 16))}")


if __name__ == "__main__":
    main()
