"""The quantized LM head of an int4 / int8 bundle (retrace.export.quantize) at load time.

A quantized bundle's head is `rows -> com.microsoft.MatMulNBits(B, scales) -> Reshape -> logits` (the
quantizer's form of MatMul(rows, W^T)). MatMulNBits prepacks B into a private copy per session, like a
float MatMul, and retrace.runtime.lm_head_split can treat it the same way: cut off (`logits` replaced by
`rows`) for one LmHead session that holds the only packed copy for the target and the drafter, or left
in the graph (already the prepacked form). The backend's default keeps it in each graph (one session run
per call; the packed copy per session is a sixth of a float table's, docs/quantization.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

NBITS = "MatMulNBits"


def _head_nodes(g):
    """(reshape, matmul_nbits) producing `logits`, or None."""
    producer = {o: n for n in g.node for o in n.output}
    reshape = producer.get("logits")
    if reshape is None or reshape.op_type != "Reshape":
        return None
    mm = producer.get(reshape.input[0])
    inits = {i.name for i in g.initializer}
    if mm is None or mm.op_type != NBITS or mm.input[1] not in inits:
        return None
    return reshape, mm


def rewrite_nbits_head(m, cut: bool):
    """`m` (a ModelProto, changed in place) with its MatMulNBits head cut off (cut=True) or kept; returns
    a retrace.runtime.head_graph.HeadGraph, or None when the head is not of that form."""
    from onnx import helper

    from retrace.runtime.graph_prune import prune
    from retrace.runtime.head_graph import HeadGraph
    from retrace.runtime.shared_weights import tensor_bytes

    g = m.graph
    found = _head_nodes(g)
    if found is None:
        return None
    reshape, mm = found
    inits = {i.name: i for i in g.initializer}
    weight = mm.input[1]
    nbytes = sum(tensor_bytes(inits[n]) for n in mm.input[1:] if n in inits)
    rows = None
    if cut:
        rows = mm.input[0]
        g.node.remove(reshape)
        g.node.remove(mm)
        out = next(o for o in g.output if o.name == "logits")
        at = list(g.output).index(out)
        g.output.remove(out)
        d = next(a.i for a in mm.attribute if a.name == "K")
        g.output.insert(at, helper.make_tensor_value_info(rows, out.type.tensor_type.elem_type, ["rows", d]))
        prune(g)
    return HeadGraph(m.SerializeToString(), rows, weight, nbytes, {i.name for i in g.initializer}, nbits=True)


def _head_node(graph_path: Path, weight: str):
    """(the graph, its MatMulNBits node whose B operand is `weight`, its attributes), or None."""
    import onnx
    from onnx import helper

    m = onnx.load(str(graph_path), load_external_data=False)
    mm = next((n for n in m.graph.node if n.op_type == NBITS and len(n.input) > 1 and n.input[1] == weight), None)
    if mm is None:
        return None
    return m, mm, {a.name: helper.get_attribute_value(a) for a in mm.attribute}


def _one_node_model(inputs: list[str], attrs: dict, elem: int, initializers: list):
    """logits [R, N] = MatMulNBits(rows [R, K], *inputs) over the given initializers, as a ModelProto."""
    from onnx import helper

    node = helper.make_node(NBITS, ["rows", *inputs], ["logits"], domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], "lm_head", [helper.make_tensor_value_info("rows", elem, ["rows", attrs["K"]])],
                              [helper.make_tensor_value_info("logits", elem, ["rows", attrs["N"]])], initializers)
    model = helper.make_model(graph,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def nbits_head_model(graph_path: Path, weight: str):
    """(ModelProto of the graph's MatMulNBits head alone: rows [R, K] -> logits [R, N], vocab N, float
    elem type) when `weight` is a MatMulNBits B operand of the graph at graph_path, else None."""
    found = _head_node(graph_path, weight)
    if found is None:
        return None
    m, mm, attrs = found
    inits = {i.name: i for i in m.graph.initializer}
    elem = inits[mm.input[2]].data_type  # the scales' type is the float type of A and Y
    model = _one_node_model(list(mm.input[1:]), attrs, elem, [inits[n] for n in mm.input[1:] if n])
    return model, int(attrs["N"]), elem


def nbits_rows_model(graph_path: Path, weight: str, ids: np.ndarray, array, vocab_size: int):
    """The graph's MatMulNBits head over the rows `ids` of its N (a draft vocabulary's target ids): a
    MatMulNBits node with N = len(ids) and the same K, bits, block size and accuracy level, over those rows
    of the packed B [N, K/block, block*bits/8], the scales and the zero points (each [N * per row] or
    [N, per row]) -> (ModelProto, len(ids), elem), or None when `weight` is not such a B operand.
    `array(name)` gives an initializer's values (e.g. the target's mapping; nothing else is read); a head
    of other than `vocab_size` rows is refused."""
    from onnx import numpy_helper

    from retrace.engines.bundle import BundleError

    found = _head_node(graph_path, weight)
    if found is None:
        return None
    m, mm, attrs = found
    operands = list(mm.input[1:])
    if any(operands[3:]):  # g_idx / bias: not in the quantizer's head (retrace.export.quantize)
        raise BundleError(f"{graph_path}: the MatMulNBits head {mm.name!r} has inputs beyond B, scales and zero "
                          "points; a draft vocabulary cannot slice it (rebuild the bundle with retrace-export build)")
    N, ids = int(attrs["N"]), np.asarray(ids, dtype=np.int64)
    if N != vocab_size:
        raise BundleError(f"{graph_path}: the drafter's LM head has {N} rows, not the target vocab's {vocab_size}")
    sliced = []
    for name in operands[:3]:
        if not name:
            continue
        a = np.asarray(array(name))
        if a.size % N:
            raise BundleError(f"{graph_path}: {name!r} ({a.size} values) is not {N} rows of the MatMulNBits head")
        rows = a.reshape(N, -1)[ids]  # one row of packed blocks / scales / zero points per output id
        sliced.append(numpy_helper.from_array(rows.reshape(len(ids), *a.shape[1:]) if a.ndim > 1 else rows.ravel(),
                                              name))
    elem = sliced[1].data_type  # the scales' type is the float type of A and Y
    return _one_node_model(operands[:3], {**attrs, "N": len(ids)}, elem, sliced), len(ids), elem
