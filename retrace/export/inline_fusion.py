"""The drafter's `retrace::GatedSuffixFusion` node inlined for a weight-only quantized bundle, so that the
quantizer sees its three linear layers.

The exported graphs keep the op as one custom node whose body is a model-local ONNX function
(retrace.plugins.onnx_function): TensorRT maps the node to its plugin, ONNX Runtime inlines the body when it
loads the graph. Its weights are function inputs and the body transposes them (`MatMul(x, Transpose(W))`),
so ONNX Runtime's MatMulNBits quantizer, which replaces a MatMul whose B operand is a constant initializer,
left the refine, gate and value layers in float: 5.2M float weights per draft call at the Qwen3-0.6B shape,
next to the int4 body. A quantized bundle runs on ONNX Runtime only (retrace.export.build refuses the other
backends), which would inline the node anyway; here that is done before the quantizer runs, with the
`Transpose` of each of its weights folded into a transposed initializer, so those MatMuls are quantized like
every other linear layer. The op computes the same function (the `valid == 0` rows stay exactly the block's
embedding: the body's `Where`); TensorRT bundles, built from float graphs, keep the node.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from retrace.plugins.onnx_function import INPUTS, fusion_nodes

# the body's weight inputs -> a name for the MatMul that reads them
MATMULS = {"w_refine": "gated_suffix_fusion_refine", "w_gate": "gated_suffix_fusion_gate",
           "w_value": "gated_suffix_fusion_value"}


def inline_gated_suffix_fusion(model: onnx.ModelProto) -> list[str]:
    """Inline every GatedSuffixFusion node of `model` (its weights loaded) in place and fold the Transposes of
    its weights; returns the names of the MatMuls that now read constant weights (empty: no such node)."""
    from onnx.inliner import inline_selected_functions

    from retrace.plugins.gated_suffix_fusion import OP_DOMAIN, OP_NAME
    from retrace.runtime.graph_prune import prune

    nodes = fusion_nodes(model)
    if not nodes:
        return []
    matmul_of = {}  # the initializer bound to a weight input of a fusion node -> its MatMul's name
    for nd in nodes:
        for formal, actual in zip(INPUTS, nd.input, strict=True):
            if formal in MATMULS:
                matmul_of[actual] = MATMULS[formal] if len(nodes) == 1 else f"{MATMULS[formal]}_{nd.name}"
    model.CopyFrom(inline_selected_functions(model, [(OP_DOMAIN, OP_NAME)]))
    kept = [f for f in model.functions if (f.domain, f.name) != (OP_DOMAIN, OP_NAME)]
    del model.functions[:]
    model.functions.extend(kept)
    g = model.graph
    init = {t.name: t for t in g.initializer}
    folded: dict[str, tuple[str, str]] = {}  # a weight Transpose's output -> (the transposed initializer, W)
    keep = []
    for n in g.node:
        w = n.input[0] if n.op_type == "Transpose" and n.input else None
        perm = next((list(a.ints) for a in n.attribute if a.name == "perm"), [1, 0])
        if w in matmul_of and len(init[w].dims) == 2 and perm == [1, 0]:
            t = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(init[w]).T), w + ".T")
            g.initializer.append(t)
            folded[n.output[0]] = (t.name, w)
            continue
        keep.append(n)
    matmuls = []
    for n in keep:
        for i, name in enumerate(n.input):
            if name in folded:
                n.input[i], w = folded[name]
                if n.op_type == "MatMul" and i == 1:
                    n.name = matmul_of[w]
                    matmuls.append(n.name)
    del g.node[:]
    g.node.extend(keep)
    prune(g)
    return sorted(matmuls)
