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


def nbits_head_model(graph_path: Path, weight: str):
    """(ModelProto of the graph's MatMulNBits head alone: rows [R, K] -> logits [R, N], vocab N, float
    elem type) when `weight` is a MatMulNBits B operand of the graph at graph_path, else None."""
    import onnx
    from onnx import helper

    m = onnx.load(str(graph_path), load_external_data=False)
    mm = next((n for n in m.graph.node if n.op_type == NBITS and len(n.input) > 1 and n.input[1] == weight), None)
    if mm is None:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in mm.attribute}
    inits = {i.name: i for i in m.graph.initializer}
    used = [inits[n] for n in mm.input[1:] if n]
    elem = inits[mm.input[2]].data_type  # the scales' type is the float type of A and Y
    node = helper.make_node(NBITS, ["rows", *mm.input[1:]], ["logits"], domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], "lm_head", [helper.make_tensor_value_info("rows", elem, ["rows", attrs["K"]])],
                              [helper.make_tensor_value_info("logits", elem, ["rows", attrs["N"]])], used)
    model = helper.make_model(graph,
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model, int(attrs["N"]), elem
