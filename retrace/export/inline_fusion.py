"""The drafter's `retrace::GatedSuffixFusion` node inlined for a weight-only quantized bundle, so that the
quantizer sees its three linear layers.

The exported graphs keep the op as one custom node whose body is a model-local ONNX function
(retrace.plugins.onnx_function): TensorRT maps the node to its plugin, ONNX Runtime inlines the body when it
loads the graph. Its weights are function inputs and the body transposes them (`MatMul(x, Transpose(W))`),
so ONNX Runtime's MatMulNBits quantizer, which replaces a MatMul whose B operand is a constant initializer,
left the refine, gate and value layers in float: 5.2M float weights per draft call at the Qwen3-0.6B shape,
next to the int4 body. A quantized bundle runs on ONNX Runtime only (retrace.export.build refuses the other
backends), which would inline the node anyway; here that is done before the quantizer runs, with each
`Transpose` of a 2-D initializer folded into a transposed initializer, so those MatMuls are quantized like
every other linear layer. The op computes the same function (the `valid == 0` rows stay exactly the block's
embedding: the body's `Where`); TensorRT bundles, built from float graphs, keep the node.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from retrace.plugins.onnx_function import fusion_nodes

# the body's weight inputs (retrace.plugins.onnx_function.INPUTS) -> a name for the MatMul that reads them
MATMULS = {"w_refine": "gated_suffix_fusion_refine", "w_gate": "gated_suffix_fusion_gate",
           "w_value": "gated_suffix_fusion_value"}


def inline_gated_suffix_fusion(model: onnx.ModelProto) -> list[str]:
    """Inline every GatedSuffixFusion node of `model` (its weights loaded) in place and fold its weight
    Transposes; returns the names of the MatMuls that now read constant weights (empty: no such node)."""
    from onnx.inliner import inline_selected_functions

    from retrace.plugins.gated_suffix_fusion import OP_DOMAIN, OP_NAME
    from retrace.runtime.graph_prune import prune

    nodes = fusion_nodes(model)
    if not nodes:
        return []
    weight_of = {}  # the initializer each weight input of the fusion is bound to -> its MatMul's name
    for nd in nodes:
        for formal, actual in zip(("x", "memory", "correction", "features", "valid", "w_refine", "w_gate",
                                   "b_gate", "norm_weight", "w_value"), nd.input, strict=True):
            if formal in MATMULS:
                weight_of[actual] = MATMULS[formal] if len(nodes) == 1 else f"{MATMULS[formal]}_{nd.name}"
    inlined = inline_selected_functions(model, [(OP_DOMAIN, OP_NAME)])
    model.CopyFrom(inlined)
    g = model.graph
    del model.functions[:]  # the body was the only function; nothing calls it now
    init = {t.name: t for t in g.initializer}
    folded: dict[str, str] = {}  # a Transpose's output -> the transposed initializer that replaces it
    keep = []
    for n in g.node:
        src = n.input[0] if n.op_type == "Transpose" and n.input else None
        if src in init and len(init[src].dims) == 2:
            t = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(init[src]).T), src + ".T")
            g.initializer.append(t)
            folded[n.output[0]] = t.name
            continue
        keep.append(n)
    matmuls = []
    for n in keep:
        for i, name in enumerate(n.input):
            if name in folded:
                n.input[i] = folded[name]
                if n.op_type == "MatMul" and i == 1:
                    n.name = weight_of.get(name_of(folded[name]), n.name)
                    matmuls.append(n.name)
    del g.node[:]
    g.node.extend(keep)
    prune(g)
    return sorted(matmuls)


def name_of(transposed: str) -> str:
    return transposed[: -len(".T")]
