"""W8A8 graphs (retrace.export.w8a8): the arithmetic it claims, exact row invariance, and what it converts."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from retrace.export.w8a8 import convert, quantize_weight


def _graph(k=64, n=48, seed=0):
    """x [M, k] -> a = x @ W1, b = x @ W2 (one shared input), y = a @ W3 + b @ W4 (W3 also read by an Identity
    output, so it must stay float too)."""
    rng = np.random.default_rng(seed)
    ws = {f"W{i}": (rng.standard_normal((k if i < 3 else n, n)) / np.sqrt(k)).astype(np.float32) for i in (1, 2, 3, 4)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"], name="mm1"),
             helper.make_node("MatMul", ["x", "W2"], ["b"], name="mm2"),
             helper.make_node("MatMul", ["a", "W3"], ["c"], name="mm3"),
             helper.make_node("MatMul", ["b", "W4"], ["d"], name="mm4"),
             helper.make_node("Add", ["c", "d"], ["y"]),
             helper.make_node("Identity", ["W3"], ["w3_out"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n]),
                           helper.make_tensor_value_info("w3_out", TensorProto.FLOAT, [n, n])],
                          [numpy_helper.from_array(w, name) for name, w in ws.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 9
    return m, ws


def _session(model):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _reference(x, w):
    """The W8A8 formula in numpy: int8 rows (per-row scale) times int8 columns (per-column scale), exact sums."""
    m = np.maximum(np.abs(x).max(-1, keepdims=True), np.float32(1e-30))
    xq = np.rint(x * (np.float32(127) / m)).astype(np.int64)
    wq, ws = quantize_weight(w)
    return (xq @ (wq.astype(np.int64) - 128)).astype(np.float32) * (m / np.float32(127)) * ws


def test_quantize_weight_is_per_column_symmetric_and_round_to_nearest():
    w = np.array([[1.0, -0.5, 0.0], [-2.0, 0.25, 0.0]], dtype=np.float32)
    q, s = quantize_weight(w)
    assert q.dtype == np.uint8 and s.dtype == np.float32
    np.testing.assert_allclose(s, [2 / 127, 0.5 / 127, 1.0])  # a zero column gets scale 1
    q = q.astype(np.int64) - 128  # stored with zero point 128
    assert q[1, 0] == -127 and q[0, 1] == -127 and (q[:, 2] == 0).all()
    assert np.abs(q * s - w).max() <= s.max() / 2 + 1e-7


def test_converted_graph_computes_the_w8a8_formula_and_leaves_the_rest_alone():
    model, ws = _graph()
    done = convert(model)
    assert sorted(done) == ["mm1", "mm2", "mm3", "mm4"]
    ops = [n.op_type for n in model.graph.node]
    # mm1 and mm2 read x: one MatMulInteger over both weights' columns, split back (x quantized once)
    assert ops.count("MatMulInteger") == 3 and ops.count("Split") == 1 and "MatMul" not in ops
    assert ops.count("ReduceMax") == 3  # x, a and b
    names = {i.name for i in model.graph.initializer}
    assert "W3" in names and not names & {"W1", "W2", "W4"}  # W3 is still read by the Identity
    onnx.checker.check_model(model)
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    y, w3 = _session(model).run(None, {"x": x})
    np.testing.assert_array_equal(w3, ws["W3"])
    want = _reference(_reference(x, ws["W1"]), ws["W3"]) + _reference(_reference(x, ws["W2"]), ws["W4"])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    fp32 = (x @ ws["W1"]) @ ws["W3"] + (x @ ws["W2"]) @ ws["W4"]
    assert np.abs(y - fp32).max() < 0.05 * np.abs(fp32).max()


@pytest.mark.parametrize("rows", [2, 3, 16, 33])
def test_every_row_has_the_bits_it_has_alone(rows):
    """Integer sums: a row's output is the same bits whatever else is in the call (MatMulNBits' is not,
    retrace.runtime.row_invariance)."""
    model, _ = _graph(k=1024, n=256)
    convert(model)
    sess = _session(model)
    x = np.random.default_rng(rows).standard_normal((rows, 1024)).astype(np.float32)
    x[-1] = 0.0  # a row of zeros quantizes to zeros
    together = sess.run(["y"], {"x": x})[0]
    for i in range(rows):
        np.testing.assert_array_equal(sess.run(["y"], {"x": x[i: i + 1]})[0], together[i: i + 1])
    assert (together[-1] == 0).all()


def test_excluded_and_non_constant_matmuls_stay_float():
    model, _ = _graph()
    assert sorted(convert(model, exclude={"mm4"})) == ["mm1", "mm2", "mm3"]
    assert [n.name for n in model.graph.node if n.op_type == "MatMul"] == ["mm4"]
    again, _ = _graph()
    again.graph.node.insert(0, helper.make_node("Identity", ["x"], ["x2"]))
    again.graph.node.append(helper.make_node("MatMul", ["x2", "x2_t"], ["z"], name="dynamic"))
    assert "dynamic" not in convert(again)
