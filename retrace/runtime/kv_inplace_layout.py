"""GroupQueryAttention's q/k/v and output in its own [N, T, heads * hd] layout, without layout Transposes.

The exported target graph (retrace.export.onnx_export) computes each layer's q/k/v as the projection's
[N, T, H*hd] output viewed as [N, T, H, hd] and transposed to [N, H, T, hd] (the opset-23 Attention's
layout), with the per-head RMSNormalization (axis -1) and the 4-D RotaryEmbedding in between, and
transposes the attention's output back before the o projection. GroupQueryAttention (the in-place K/V form,
retrace.runtime.kv_inplace) reads and writes [N, T, H*hd] itself, so those Transposes and the Reshapes
around them are layout traffic only: per layer two Transposes survive ONNX Runtime's optimizer (q and k:
the norm and rotary sit between the pair) and four Reshape pairs.

`bsh_input` rebuilds a q/k/v chain in the [N, T, H, hd] view: the norm over the last axis is the same per
head in either layout; the rotary runs on [N, T, H*hd] (opset 23's 3-D form, `num_heads` set), the same
rotation of each head's vector; a chain with nothing to run in 4-D feeds the projection's output directly.
`bsh_output` hands GroupQueryAttention's output straight to the Reshape that fed the o projection. Where
the graph has another form (or a value it needs is used elsewhere), None: the caller keeps its Transposes.
"""

from __future__ import annotations

from dataclasses import dataclass

PERM = [0, 2, 1, 3]
PER_HEAD = "RMSNormalization"  # axis -1 over head_dim: the same in [N, T, H, hd] and [N, H, T, hd]
ROTARY = "RotaryEmbedding"


@dataclass
class Graph:
    """The lookups the rewrite needs (of an onnx.GraphProto, taken before it changes)."""

    g: object
    producer: dict
    consumers: dict
    shapes: dict  # value name -> [dim_value or dim_param], from value_info / inputs / outputs

    @classmethod
    def of(cls, g) -> Graph:
        consumers: dict[str, list] = {}
        for n in g.node:
            for i in n.input:
                consumers.setdefault(i, []).append(n)
        shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
                  for v in [*g.value_info, *g.input, *g.output] if v.type.tensor_type.HasField("shape")}
        return cls(g, {o: n for n in g.node for o in n.output}, consumers, shapes)

    def only_use(self, name: str):
        """The single node reading `name` when nothing else (no graph output) reads it, else None."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in {o.name for o in self.g.output} else None


def _attr(n, name):
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in n.attribute if a.name == name), None)


def _flat(gr: Graph, view, heads: int, head_dim: int) -> str | None:
    """The [N, T, heads*hd] value a [N, T, heads, hd] view Reshape was made from, when its shapes say so."""
    src = view.input[0]
    shape, out = gr.shapes.get(src), gr.shapes.get(view.output[0])
    if shape is None or out is None or len(shape) != 3 or len(out) != 4 or shape[2] != heads * head_dim \
            or out[2:] != [heads, head_dim]:
        return None
    return src


def bsh_input(gr: Graph, value: str, heads: int, head_dim: int, bsh: str, prefix: str, nodes: list,
              skip_rotary: bool = False) -> str | None:
    """`value` ([N, heads, T, hd], GroupQueryAttention's q, k or v) rebuilt as [N, T, heads*hd] without
    the Transpose: the new nodes appended to `nodes`, their outputs named from `prefix`. None when `value`
    is not Transpose(view) -> [RMSNormalization] -> [RotaryEmbedding] of a view Reshape. skip_rotary: the
    value before its RotaryEmbedding (`value` must be one, see `rope_caches`: the operator applies it)."""
    from onnx import helper

    chain = []
    n = gr.producer.get(value)
    if skip_rotary:
        if n is None or n.op_type != ROTARY:
            return None
        n = gr.producer.get(n.input[0])
    while n is not None and n.op_type in (PER_HEAD, ROTARY) and len(n.output) == 1:
        if n.op_type == PER_HEAD and _attr(n, "axis") not in (-1, 3):
            return None
        chain.append(n)
        n = gr.producer.get(n.input[0])
    if n is None or n.op_type != "Transpose" or _attr(n, "perm") != PERM:
        return None
    view = gr.producer.get(n.input[0])
    if view is None or view.op_type != "Reshape":
        return None
    chain.reverse()  # in the order they run
    if [c.op_type for c in chain] not in ([], [PER_HEAD], [ROTARY], [PER_HEAD, ROTARY]) or \
            (skip_rotary and ROTARY in [c.op_type for c in chain]):
        return None
    if any(gr.only_use(c.output[0]) is None for c in chain[:-1]):
        return None  # a step's 4-D value is read elsewhere too: keep the graph as it is
    cur, flat = view.output[0], False
    for k, c in enumerate(chain):
        if c.op_type == ROTARY:
            src = _flat(gr, view, heads, head_dim) if k == 0 else None
            if src is None:
                nodes.append(helper.make_node("Reshape", [cur, bsh], [f"{prefix}_flat"]))
                src = f"{prefix}_flat"
            cur, flat = src, True
        copy = helper.make_node(c.op_type, [cur, *c.input[1:]], [f"{prefix}_{c.op_type}"], domain=c.domain)
        copy.attribute.extend(a for a in c.attribute if a.name != "num_heads")
        if c.op_type == ROTARY:
            copy.attribute.append(helper.make_attribute("num_heads", heads))
        nodes.append(copy)
        cur = copy.output[0]
    if not flat:
        src = _flat(gr, view, heads, head_dim) if not chain else None
        if src is None:
            nodes.append(helper.make_node("Reshape", [cur, bsh], [f"{prefix}_flat"]))
            src = f"{prefix}_flat"
        cur = src
    return cur


def bsh_output(gr: Graph, value: str, heads: int, head_dim: int):
    """(Transpose, Reshape) after the attention's [N, heads, T, hd] output `value` that make it
    [N, T, heads*hd] for the o projection: GroupQueryAttention's output can replace the Reshape's output
    once both are removed. None when the graph has another form."""
    t = gr.only_use(value)
    if t is None or t.op_type != "Transpose" or _attr(t, "perm") != PERM:
        return None
    r = gr.only_use(t.output[0])
    shape = gr.shapes.get(r.output[0]) if r is not None and r.op_type == "Reshape" else None
    if shape is None or len(shape) != 3 or shape[2] != heads * head_dim:
        return None
    return t, r


def rope_of(gr: Graph, value: str, head_dim: int):
    """The RotaryEmbedding producing `value` when GroupQueryAttention can apply it instead (do_rotary with
    cos/sin caches indexed by `position_ids`, which keeps a tree node's depth as its position): the
    opset-23 form over the full head with 3-D cos/sin [N, T, hd/2] computed from the graph's position_ids;
    else None."""
    n = gr.producer.get(value)
    if n is None or n.op_type != ROTARY or n.domain not in ("", "ai.onnx") or len(n.input) != 3:
        return None
    if _attr(n, "rotary_embedding_dim") not in (None, 0, head_dim):
        return None
    if any((gr.shapes.get(c) or [None])[-1] != head_dim // 2 or len(gr.shapes.get(c) or ()) != 3
           for c in n.input[1:3]):
        return None
    return n


def _in_order(gr: Graph) -> list:
    """The graph's original nodes in their original (topological) order."""
    seen, out = set(), []
    for n in gr.producer.values():  # dict order: the order the nodes were met
        if id(n) not in seen:
            seen.add(id(n))
            out.append(n)
    return out


def rope_caches(g, gr: Graph, rope, positions: str, max_positions: int, nodes: list) -> tuple[str, str] | None:
    """GroupQueryAttention's cos_cache / sin_cache [max_positions, hd/2] for the RotaryEmbedding `rope`: the
    graph's own cos/sin computation copied with `positions` (the graph input) replaced by the constant
    0..max_positions-1, so ONNX Runtime folds it into two initializers at load; new nodes appended to `nodes`.
    None when the cos/sin are not computed from `positions`."""
    import numpy as np
    from onnx import helper, numpy_helper

    depends: dict[str, bool] = {}

    def dep(v: str) -> bool:
        if v not in depends:
            p = gr.producer.get(v)
            depends[v] = v == positions or (p is not None and any(dep(i) for i in p.input if i))
        return depends[v]

    if not all(dep(c) for c in rope.input[1:3]):
        return None
    ancestors, todo = set(), list(rope.input[1:3])
    while todo:  # the nodes the cos/sin are computed by
        p = gr.producer.get(todo.pop())
        if p is not None and id(p) not in ancestors:
            ancestors.add(id(p))
            todo += [i for i in p.input if i]
    const, shape = (f"inplace_kv_rope_{rope.input[1]}_{what}" for what in ("positions", "shape"))
    g.initializer.append(numpy_helper.from_array(np.arange(max_positions, dtype=np.int64)[None], const))
    half = int(gr.shapes[rope.input[1]][-1])
    g.initializer.append(numpy_helper.from_array(np.array([max_positions, half], dtype=np.int64), shape))
    renamed = {positions: const}
    for n in _in_order(gr):
        if id(n) in ancestors and any(dep(o) for o in n.output):
            copy = helper.make_node(n.op_type, [renamed.get(i, i) for i in n.input],
                                    [f"inplace_kv_rope_{o}" for o in n.output], domain=n.domain)
            copy.attribute.extend(n.attribute)
            renamed.update(zip(n.output, copy.output, strict=True))
            nodes.append(copy)
    out = []
    for c in rope.input[1:3]:
        nodes.append(helper.make_node("Reshape", [renamed[c], shape], [f"inplace_kv_rope_{c}_cache"]))
        out.append(f"inplace_kv_rope_{c}_cache")
    return out[0], out[1]
