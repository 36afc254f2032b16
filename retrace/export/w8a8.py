"""W8A8 graphs: every MatMul with a constant 2-D float weight as an integer matmul, int8 weights per output
channel and int8 activations per row, the row's scale computed on the fly (`retrace-export build --weights
w8a8`).

Why beside MatMulNBits (retrace.export.quantize): its accumulation is exact. For one activation row x
(one token) and a weight column w:

    y = (s_x * s_w) * sum_k (round(x_k / s_x)) * round(w_k / s_w)      s_x = max|x| / 127, s_w = max|w| / 127

the sum is over int8 products in ONNX Runtime's int32 `MatMulInteger`, and integer sums are the same in any
order: a row's output never depends on how many rows share the call or on the kernel's blocking. So a
verify of T tokens gives each row the bits a one-token decode gives it, on every CPU, with no padding to a
second row (MatMulNBits' one-row kernel differs from its many-row kernel: retrace.runtime.row_invariance).
On the AVX2-only 2-core EPYC of 2026-12-06, a stack of six Qwen3-0.6B-shaped layers' linear layers ran one
row in 7.5 ms against 5.6 ms for MatMulNBits int4 (block 256) and 8.7 ms for MatMulNBits int8 (block 128),
and 16 rows in 41 ms against 46 and 87 ms (`python benchmarks/w8a8_stack.py`; docs/quantization.md "W8A8").
Both operands are uint8 with zero point 128: AVX2's u8 x s8 kernel sums product pairs in int16 and saturates.

Per distinct activation input (q/k/v share one, gate/up another): Abs -> ReduceMax over the last axis ->
the row's reciprocal scale 127 / m and scale m / 127 -> Mul, Round, Add 128, Cast to uint8 (the row as
u8 with zero point 128: |x / s_x| <= 127, so no clip is needed). Per MatMul: MatMulInteger(x_u8, W_u8, 128,
128) -> Cast to float -> Mul by the row scale [.., 1] -> Mul by the column scales [N]; matmuls that read one
activation with weights nothing else reads (q/k/v, gate/up) are one MatMulInteger over their columns
concatenated, then a Split. A row of zeros gets the scale of max 1e-30 and quantizes to zeros.
"""

from __future__ import annotations

import numpy as np

ROW_AXIS = "w8a8_last_axis"
CONSTANTS = {  # name -> value of the shared constants the pass adds
    "w8a8_127": np.float32(127.0),
    "w8a8_128": np.float32(128.0),
    "w8a8_floor": np.float32(1e-30),  # the scale of a row of zeros (its 127 / m stays finite)
    "w8a8_zero_point": np.uint8(128),
    ROW_AXIS: np.array([-1], dtype=np.int64),
}


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [K, N] float -> (uint8 [K, N] = q + 128, float32 scales [N]): q in [-127, 127], symmetric per output
    column, round to nearest (a column of zeros gets scale 1)."""
    w = np.asarray(w, dtype=np.float32)
    scale = np.abs(w).max(axis=0) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return (np.clip(np.rint(w / scale), -127, 127) + 128).astype(np.uint8), scale


def _quantize_rows(x: str) -> list:
    """The nodes that make `x`'s rows uint8 (zero point 128) and their scales: `x_w8a8_u8`, `x_w8a8_scale`."""
    from onnx import TensorProto, helper

    p = f"{x}_w8a8"
    return [
        helper.make_node("Abs", [x], [p + "_abs"], name=p + "_abs"),
        helper.make_node("ReduceMax", [p + "_abs", ROW_AXIS], [p + "_max0"], keepdims=1, name=p + "_max0"),
        helper.make_node("Max", [p + "_max0", "w8a8_floor"], [p + "_max"], name=p + "_max"),
        helper.make_node("Div", ["w8a8_127", p + "_max"], [p + "_inv"], name=p + "_inv"),
        helper.make_node("Div", [p + "_max", "w8a8_127"], [p + "_scale"], name=p + "_scale"),
        helper.make_node("Mul", [x, p + "_inv"], [p + "_scaled"], name=p + "_scaled"),
        helper.make_node("Round", [p + "_scaled"], [p + "_round"], name=p + "_round"),
        helper.make_node("Add", [p + "_round", "w8a8_128"], [p + "_shift"], name=p + "_shift"),
        helper.make_node("Cast", [p + "_shift"], [p + "_u8"], to=TensorProto.UINT8, name=p + "_u8"),
    ]


def convert(model, exclude: set[str] = frozenset()) -> list[str]:
    """Rewrite `model` (an onnx ModelProto with its weights loaded; changed in place) as W8A8; returns the
    names of the MatMul nodes converted. exclude: node names to leave float."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    targets = [n for n in g.node if n.op_type == "MatMul" and n.name not in exclude and len(n.input) == 2
               and n.input[1] in inits and len(inits[n.input[1]].dims) == 2
               and inits[n.input[1]].data_type == TensorProto.FLOAT]
    if not targets:
        return []
    consumers: dict[str, int] = {}  # initializer -> how many nodes read it (a shared one stays float as well)
    for n in g.node:
        for i in n.input:
            consumers[i] = consumers.get(i, 0) + 1
    for name, value in CONSTANTS.items():
        if name not in inits:
            g.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    groups: dict[str, list] = {}  # activation -> its matmuls whose weights nothing else reads (q/k/v, gate/up)
    for n in targets:
        if consumers[n.input[1]] == 1:
            groups.setdefault(n.input[0], []).append(n)
    merged = {n.output[0]: group for group in groups.values() if len(group) > 1 for n in group}
    converting = {n.output[0] for n in targets}  # nodes are keyed by their output (the same node object is
    #   not guaranteed across two iterations of a protobuf repeated field)
    quantized_rows: dict[str, tuple[str, str]] = {}  # activation -> (u8 rows, row scale)
    written: set[str] = set()  # quantized weights already added (a weight two converted matmuls read: once)
    new_nodes = []
    done = []
    for node in list(g.node):
        if node.op_type != "MatMul" or node.output[0] not in converting:
            new_nodes.append(node)
            continue
        group = merged.get(node.output[0], [node])
        if node.output[0] != group[0].output[0]:
            continue  # written with its group's first node
        x = node.input[0]
        if x not in quantized_rows:
            new_nodes += _quantize_rows(x)
            quantized_rows[x] = (f"{x}_w8a8_u8", f"{x}_w8a8_scale")
        xq, xs = quantized_rows[x]
        parts = [quantize_weight(numpy_helper.to_array(inits[n.input[1]])) for n in group]
        wname = group[0].input[1] if len(group) == 1 else "+".join(n.input[1] for n in group)
        qname, sname = wname + "_W8", wname + "_W8_scale"
        if qname not in written:
            g.initializer.extend([numpy_helper.from_array(np.concatenate([w for w, _ in parts], axis=1), qname),
                                  numpy_helper.from_array(np.concatenate([c for _, c in parts]), sname)])
            written.add(qname)
        p = (node.name or wname) + "_w8a8"
        y = node.output[0] if len(group) == 1 else p + "_y"
        new_nodes += [
            helper.make_node("MatMulInteger", [xq, qname, "w8a8_zero_point", "w8a8_zero_point"], [p + "_acc"],
                             name=node.name if len(group) == 1 else p),
            helper.make_node("Cast", [p + "_acc"], [p + "_f"], to=TensorProto.FLOAT, name=p + "_f"),
            helper.make_node("Mul", [p + "_f", xs], [p + "_row"], name=p + "_row"),
            helper.make_node("Mul", [p + "_row", sname], [y], name=p + "_col"),
        ]
        if len(group) > 1:  # the group's outputs back under their own names
            sizes = p + "_sizes"
            g.initializer.append(numpy_helper.from_array(np.array([w.shape[1] for w, _ in parts], np.int64), sizes))
            new_nodes.append(helper.make_node("Split", [y, sizes], [n.output[0] for n in group], axis=-1,
                                              name=p + "_split"))
        for n in group:
            consumers[n.input[1]] -= 1
            done.append(n.name)
    del g.node[:]
    g.node.extend(new_nodes)
    unused = {name for name, c in consumers.items() if c == 0}
    kept = [i for i in g.initializer if i.name not in unused]
    del g.initializer[:]
    g.initializer.extend(kept)
    return done
