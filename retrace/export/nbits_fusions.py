"""Graph fusions for quantized bundles, with ONNX Runtime's own contrib operators (applied at the quantize
stage, after MatMulNBitsQuantizer, before the weights are saved).

ONNX Runtime's optimizer does not fuse the forms our exporter writes (the opset-23 `RMSNormalization`, one
MatMulNBits per projection), so a decode step of the Qwen3-0.6B shape ran ~850 kernels against
onnxruntime-genai's ~520 (docs/quantization.md). Each function below rewrites one pattern in place and
returns how many it rewrote; nothing else in the graph changes (names of every tensor other nodes, the
in-place K/V rewrite or the outputs read stay as they were).

- `merge_parallel_nbits`: MatMulNBits nodes that read the same activation with the same K / bits / block /
  accuracy level (q/k/v, gate/up) become one MatMulNBits over their weights concatenated along N, then a
  `Split` back to the original outputs (what onnxruntime-genai's builder does for q/k/v). Each output column
  is the same blocks times the same (block-quantized) activation: the numbers do not change.
- `fuse_skip_rms_norm`: a residual `Add` whose sum feeds an `RMSNormalization` over the last axis becomes
  one `com.microsoft.SkipSimplifiedLayerNormalization` (its 4th output is the sum, kept under the Add's
  name for the next residual and the drafter's taps).
"""

from __future__ import annotations

import collections

NBITS_KEYS = ("K", "bits", "block_size", "accuracy_level")


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _consumers(g) -> collections.Counter:
    uses = collections.Counter(i for n in g.node for i in n.input)
    uses.update(o.name for o in g.output)
    return uses


def merge_parallel_nbits(model) -> int:
    """Merge each group of parallel MatMulNBits (same A, attributes, no zero points / bias) as described
    above; returns the number of groups merged."""
    import numpy as np
    from onnx import helper, numpy_helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    uses = _consumers(g)
    groups = collections.defaultdict(list)
    for n in g.node:
        if n.op_type != "MatMulNBits" or n.domain != "com.microsoft" or len(n.input) != 3:
            continue
        a = _attrs(n)
        if any(w not in inits or uses[w] != 1 or "lm_head" in w for w in n.input[1:]) or "N" not in a:
            continue  # the LM head (the drafter shares its bytes) and a weight another node reads stay
        groups[(n.input[0], *(a.get(k) for k in NBITS_KEYS))].append(n)
    merged = 0
    for (act, *_), nodes in groups.items():
        if len(nodes) < 2:
            continue
        order = list(g.node)
        nodes.sort(key=order.index)
        attrs = _attrs(nodes[0])
        widths = [int(_attrs(n)["N"]) for n in nodes]
        tables = []
        for k in (1, 2):  # B [N, blocks, bytes], scales [N * blocks] or [N, blocks]: both concatenate along N
            arrays = [numpy_helper.to_array(inits[n.input[k]]) for n in nodes]
            shape = arrays[0].shape
            flat = [x.reshape(w, -1) for x, w in zip(arrays, widths, strict=True)]
            joined = np.concatenate(flat, axis=0)
            joined = joined.reshape(sum(widths), *shape[1:]) if len(shape) > 1 else joined.reshape(-1)
            name = f"{nodes[0].input[k]}_merged"
            tables.append(numpy_helper.from_array(joined, name))
        for n in nodes:
            for w in n.input[1:]:
                g.initializer.remove(inits.pop(w))
        g.initializer.extend(tables)
        split = helper.make_tensor(f"{nodes[0].name}_merged_split", 7, [len(widths)], widths)
        g.initializer.append(split)
        out = f"{nodes[0].output[0]}_merged"
        at = order.index(nodes[0])
        mm = helper.make_node("MatMulNBits", [act, tables[0].name, tables[1].name], [out], domain="com.microsoft",
                              name=f"{nodes[0].name}_merged", **(attrs | {"N": sum(widths)}))
        sp = helper.make_node("Split", [out, split.name], [n.output[0] for n in nodes], axis=-1,
                              name=f"{nodes[0].name}_merged_split")
        for n in nodes:
            g.node.remove(n)
        g.node.insert(at, mm)
        g.node.insert(at + 1, sp)
        merged += 1
    return merged


def fuse_skip_rms_norm(model) -> int:
    """Fuse each residual Add -> RMSNormalization(axis -1, 1-D scale) pair as described above; returns the
    number fused."""
    from onnx import helper

    g = model.graph
    inits = {i.name: i for i in g.initializer}
    graph_inputs = {i.name for i in g.input}
    producer = {o: n for n in g.node for o in n.output}
    uses = _consumers(g)
    fused = 0
    for norm in [n for n in g.node if n.op_type == "RMSNormalization" and n.domain in ("", "ai.onnx")]:
        add = producer.get(norm.input[0])
        a = _attrs(norm)
        scale = inits.get(norm.input[1]) if len(norm.input) > 1 else None
        if (add is None or add.op_type != "Add" or a.get("axis", -1) != -1 or scale is None
                or len(scale.dims) != 1 or any(x in inits or x in graph_inputs for x in add.input)
                or add not in g.node):
            continue  # only a residual sum of two activations (same shape) has the fused form
        # both addends come from nodes writing [.., hidden]: a broadcast bias would be an initializer
        keep_sum = uses[add.output[0]] > 1
        node = helper.make_node("SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
                                [norm.output[0], "", "", add.output[0] if keep_sum else ""],
                                domain="com.microsoft", name=f"{norm.name}_skip", epsilon=a.get("epsilon", 1e-5))
        order = list(g.node)
        at = order.index(add)
        g.node.remove(norm)
        g.node.remove(add)
        g.node.insert(at, node)
        fused += 1
    return fused


FUSIONS = (merge_parallel_nbits, fuse_skip_rms_norm)


def fuse_quantized(model) -> dict:
    """Every fusion above on `model` (changed in place): {fusion name: patterns rewritten}."""
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        from onnx import helper

        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return {f.__name__: f(model) for f in FUSIONS}
