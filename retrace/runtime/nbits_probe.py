"""Which rows of a MatMulNBits call agree bit for bit with the same rows of another width, on THIS CPU.

Row invariance (runtime/row_invariance.py) pads a call to the widths at which the quantized matmul computes
every row by the same kernel. Which widths those are depends on the CPU, not only on the quantization:
MLAS picks its kernels by instruction set. Measured with ONNX Runtime 1.32, int4, accuracy_level 4: on an
AVX-512 Intel Xeon blocks <= 32 agree at every width; on an AVX2-only AMD EPYC only block 16 does, and a
block-32 one-row call differs from the same row in any wider call (docs/quantization.md, "Row invariance
depends on the CPU"). A fixed table keyed on the block size would silently lose exactness on one of them.

`probe_rule` runs one small MatMulNBits (the bundle's bits, block size and accuracy level, the model's K,
random weights quantized by ONNX Runtime's own quantizer, N = 64 columns) at M = 1 .. 6 rows in this process
and returns the weakest rule of row_invariance.RULES that makes the rows agree:

    any    every row equals the row computed alone (M = 1) and in every wider call;
    two    rows of calls with M >= 2 agree with each other; a one-row call differs;
    pairs  rows of even-M calls agree; a one-row call and the odd last row of M differ.

None when none does (no padding makes this CPU's kernel row-invariant): row_invariance.nbits_rule then warns
that exactness holds only up to near ties and pads as pairs. Each probe takes a few milliseconds and is
cached per process.
"""

from __future__ import annotations

import functools

import numpy as np

PROBE_N = 64  # output columns of the probe matmul
PROBE_ROWS = 6  # the widest call probed


def float_matmul(k: int, n: int, seed: int):
    """One float [M, k] x [k, n] MatMul of random weights (x -> y), an onnx ModelProto."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.05
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "matmul",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])],
                              [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def matmul_nbits(k: int, n: int, bits: int, block_size: int, accuracy_level: int, seed: int) -> bytes:
    """`float_matmul` quantized to MatMulNBits by ONNX Runtime's own quantizer (symmetric, round to nearest): a
    serialized model with input x and output y (also what the kernel benchmarks in benchmarks/ time)."""
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, accuracy_level=accuracy_level,
                                          bits=bits)
    quantizer = MatMulNBitsQuantizer(float_matmul(k, n, seed), algo_config=config)
    log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")  # a progress line per call
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        quantizer.process()
    finally:
        log.setLevel(level)
    return quantizer.model.model.SerializeToString()


def classify(rows_by_width: dict[int, np.ndarray]) -> str | None:
    """{M: the [M, N] output of the first M rows of one input} -> the weakest rule under which every padded
    call's rows agree (see the module docstring), or None."""
    widest = rows_by_width[max(rows_by_width)]

    def agrees(m: int, upto: int) -> bool:  # the first `upto` rows of the M-row call equal the widest call's
        return bool(np.array_equal(rows_by_width[m][:upto], widest[:upto]))

    wide = [m for m in rows_by_width if m >= 2]
    even = [m for m in wide if m % 2 == 0]
    if all(agrees(m, m) for m in rows_by_width):
        return "any"
    if all(agrees(m, m) for m in wide):
        return "two"
    if all(agrees(m, m) for m in even):
        return "pairs"
    return None


@functools.lru_cache(maxsize=64)
def probe_rule(k: int, bits: int, block_size: int, accuracy_level: int, threads: int | None = 1) -> str | None:
    """The row rule of this CPU's MatMulNBits kernel for a K-deep matmul of these settings (see above)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or 0  # 0: ONNX Runtime's default
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(matmul_nbits(k, PROBE_N, bits, block_size, accuracy_level, seed=k), so,
                                providers=["CPUExecutionProvider"])
    x = np.random.default_rng(k + 1).standard_normal((PROBE_ROWS, k)).astype(np.float32)
    return classify({m: sess.run(None, {"x": x[:m]})[0] for m in range(1, PROBE_ROWS + 1)})
