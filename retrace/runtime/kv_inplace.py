"""The target graph's attention, rewritten at load time for ONNX Runtime: K/V written in place, no past copies.

The exported target graph (retrace.export.onnx_export) is portable: each layer concatenates its dense past
K/V [N,Hkv,P,hd] with the new K/V and runs the opset-23 `Attention` on the result, under a boolean mask
built from `past_len` (and `tree_mask`). On ONNX Runtime that costs two copies of the whole past per call
and layer: the backend gathers the cache slice into a dense staging buffer (a strided slice is not a
tensor ONNX Runtime can read), and `Concat` copies it again. Both grow with the context, so decode slows
down with every token far more than attention itself does.

`to_inplace_kv` swaps each layer's Concat + Attention for ONNX Runtime's `com.microsoft.GroupQueryAttention`
over a shared past/present buffer: the backend binds the cache of a contiguous slot range, whole
([N,Hkv,max_seq_len,hd], a view, no copy), as both `past_key_i` and `present_key_i`; the operator writes
the T new K/V at positions [past, past + T) of each row and attends causally over exactly the row's
`seqlens_k + 1` entries. New graph inputs: `seqlens_k` [N] int32 (past + T - 1), `query_seqlens` [N] int32
(T), `total_sequence_length` [] int32 (max over rows of past + T) and, for a graph with `tree_mask`,
`attention_bias` [N,1,T,total] float (0 where a node may attend, -inf where the tree forbids it; the
causal order of the nodes is a superset of their ancestry). The operator runs with the default scale
1/sqrt(head_dim), as the exported `Attention` does. q/k/v and its output use the operator's own
[N, T, H*hd] layout without Transposes, and (given `max_positions`) it applies the rotary embedding itself
from cos/sin caches indexed by the graph's `position_ids`, so a tree node is still rotated by its depth while
its K/V sit at the scratch index past + m (retrace.runtime.kv_inplace_layout).

The bundle is unchanged (TensorRT reads the same graph whole); a graph whose attention does not have the
exported form is left as it is (the backend then uses its gather path).
"""

from __future__ import annotations

from dataclasses import dataclass

from retrace.runtime.graph_prune import prune
from retrace.runtime.kv_inplace_layout import Graph, bsh_input, bsh_output, rope_caches, rope_of

BIAS = "attention_bias"


@dataclass(frozen=True)
class InplaceKV:
    layers: int
    tree: bool  # the graph takes attention_bias (it had a tree_mask)
    pad: bool = False  # each GroupQueryAttention runs on max(T, 2) rows (pad_attention; the backend's seqlens say so)


def to_inplace_kv(model, num_heads: int, kv_heads: int, head_dim: int, fold_layout: bool = True,
                  max_positions: int | None = None, pad_attention: bool = False) -> InplaceKV | None:
    """Rewrite `model` (an onnx.ModelProto, changed in place) as described above; None (and `model`
    untouched) when its attention is not the exported Concat(past, new) -> Attention form. fold_layout:
    q/k/v and the output in the operator's own layout without Transposes (retrace.runtime.kv_inplace_layout);
    False keeps a Transpose + Reshape on each of them (the form before, for comparisons). max_positions
    (with fold_layout): the operator applies the rotary embedding itself (do_rotary, cos/sin caches over
    positions 0..max_positions-1 indexed by the graph's position_ids: a tree node keeps its depth).
    pad_attention: a one-token call gives each operator q/k/v (and position_ids) with their row repeated and
    its output cut back to one row, so it never runs its one-token path (retrace.runtime.row_invariance); the
    pad's K/V land one entry past the call, which the next call overwrites. Wider calls are not padded."""
    from onnx import TensorProto, helper

    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    inputs = {i.name: i for i in g.input}
    layers = []
    for att in (n for n in g.node if n.op_type == "Attention" and n.domain in ("", "ai.onnx")):
        if len(att.input) != 4 or len(att.output) != 1 or list(att.attribute):
            return None
        cats = [producer.get(att.input[1]), producer.get(att.input[2])]
        if any(c is None or c.op_type != "Concat" or len(c.input) != 2 or c.input[0] not in inputs
               or [a.i for a in c.attribute if a.name == "axis"] != [2] for c in cats):
            return None
        layers.append((att, cats))
    if not layers:
        return None
    dtype = inputs[layers[0][1][0].input[0]].type.tensor_type.elem_type
    tree = "tree_mask" in inputs

    def const(name: str, values: list[int]) -> str:
        g.initializer.append(helper.make_tensor(name, TensorProto.INT64, [len(values)], values))
        return name

    bsh, bnsh = const("inplace_kv_bsh", [0, 0, -1]), const("inplace_kv_bnsh", [0, 0, num_heads, head_dim])
    pad = AttentionPad(g, const) if pad_attention else None
    out_names = {o.name for o in g.output}
    gr = Graph.of(g)  # the lookups of the graph as exported (each layer below changes only its own nodes)
    new_outputs = []
    caches: dict[tuple, tuple | None] = {}  # (cos, sin) of the graph's rotary -> the operator's caches
    for j, (att, (ck, cv)) in enumerate(layers):
        at = list(g.node).index(att)
        nodes = []
        rope = _rope(gr, att.input[0], ck.input[1], head_dim, "position_ids" in inputs and fold_layout and
                     max_positions)
        if rope is not None and (key := tuple(rope.input[1:3])) not in caches:
            caches[key] = rope_caches(g, gr, rope, "position_ids", max_positions, nodes)
        rope_in = caches.get(tuple(rope.input[1:3])) if rope is not None else None

        def to_bsh(x: str, what: str, heads: int, j=j, nodes=nodes) -> str:
            if fold_layout and (flat := bsh_input(gr, x, heads, head_dim, bsh, f"inplace_kv_{j}_{what}", nodes)):
                return flat
            nodes.append(helper.make_node("Transpose", [x], [f"inplace_kv_{j}_{what}_t"], perm=[0, 2, 1, 3]))
            nodes.append(helper.make_node("Reshape", [f"inplace_kv_{j}_{what}_t", bsh], [f"inplace_kv_{j}_{what}"]))
            return f"inplace_kv_{j}_{what}"

        past_k, past_v = ck.input[0], cv.input[0]
        present_k, present_v = f"present_{past_k[len('past_'):]}", f"present_{past_v[len('past_'):]}"
        qk = None
        if rope_in is not None:  # q and k before their rotary (the operator applies it), or neither
            tmp: list = []
            qk = [bsh_input(gr, x, h, head_dim, bsh, f"inplace_kv_{j}_{w}", tmp, skip_rotary=True)
                  for x, h, w in ((att.input[0], num_heads, "q"), (ck.input[1], kv_heads, "k"))]
            qk, rope_in = (None, None) if None in qk else (qk, rope_in)
            nodes += tmp if qk else []
        qk = qk or [to_bsh(att.input[0], "q", num_heads), to_bsh(ck.input[1], "k", kv_heads)]
        qkv = [*qk, to_bsh(cv.input[1], "v", kv_heads)]
        if pad is not None:
            qkv = [pad.grow(x, nodes) for x in qkv]
        gqa_in = [*qkv, past_k, past_v, "seqlens_k", "total_sequence_length", *(rope_in or ("", "")),
                  (pad.positions(nodes) if pad else "position_ids") if rope_in else "", BIAS if tree else ""]
        gqa_in += ["", "", "", "", "", "query_seqlens"]  # head_sink, k/v scales, q/k norms, query_seqlens
        after = bsh_output(gr, att.output[0], num_heads, head_dim) if fold_layout else None
        y = after[1].output[0] if after else f"inplace_kv_{j}_y"  # straight into the o projection's Reshape's place
        y_rows = y if pad is None else f"{y}_padded"
        nodes.append(helper.make_node("GroupQueryAttention", gqa_in, [y_rows, present_k, present_v],
                                      domain="com.microsoft", name=f"inplace_kv_gqa_{j}", num_heads=num_heads,
                                      kv_num_heads=kv_heads, do_rotary=int(rope_in is not None),
                                      rotary_interleaved=int(rope_in is not None and _interleaved(rope))))
        if pad is not None:
            pad.cut(y_rows, y, nodes)
        if after:
            for n in after:
                g.node.remove(n)
        else:
            nodes.append(helper.make_node("Reshape", [y, bnsh], [f"inplace_kv_{j}_y4"]))
            nodes.append(helper.make_node("Transpose", [f"inplace_kv_{j}_y4"], [att.output[0]], perm=[0, 2, 1, 3]))
        g.node.remove(att)
        for k, n in enumerate(nodes):
            g.node.insert(at + k, n)
        for c in (ck, cv):
            if not any(c.output[0] in n.input for n in g.node):
                g.node.remove(c)
        shape = ["N", kv_heads, "max_seq_len", head_dim]
        new_outputs += [helper.make_tensor_value_info(p, dtype, shape) for p in (present_k, present_v)]

    if pad is not None:
        for k, n in enumerate(pad.head):  # position_ids padded once, before every layer
            g.node.insert(k, n)
    # the per-call new K/V are in the cache already: no longer outputs
    keep = [o for o in g.output if not o.name.startswith(("new_key_", "new_value_"))]
    del g.output[:]
    g.output.extend(keep + new_outputs)
    prune(g)
    used = {i for n in g.node for i in n.input} | out_names
    kept_inputs = [i for i in g.input if i.name in used]
    del g.input[:]
    g.input.extend(kept_inputs)
    g.input.extend([helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["N"]),
                    helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, ["N"]),
                    helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [])])
    if tree:
        g.input.append(helper.make_tensor_value_info(BIAS, dtype, ["N", 1, "T", "total"]))
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return InplaceKV(len(layers), tree, pad is not None)


class AttentionPad:
    """The nodes that give GroupQueryAttention max(T, 2) rows (a one-token call's row repeated) and take T back:
    widths >= 2 already run the operator's multi-row path, so only T = 1 gets a pad row."""

    def __init__(self, g, const):
        from onnx import helper

        self.end, self.axis = const("inplace_kv_pad_end", [2**62]), const("inplace_kv_pad_axis", [1])
        self.zero, self.one = const("inplace_kv_pad_zero", [0]), const("inplace_kv_pad_one", [1])
        two = const("inplace_kv_pad_two", [2])
        self.T, self.start = "inplace_kv_pad_T", "inplace_kv_pad_start"  # [T], [T - max(2 - T, 0)]
        self.head: list = [
            helper.make_node("Shape", ["input_ids"], [self.T], start=1, end=2),
            helper.make_node("Sub", [two, self.T], ["inplace_kv_pad_short"]),
            helper.make_node("Max", ["inplace_kv_pad_short", self.zero], ["inplace_kv_pad_n"]),  # pad rows: 1 or 0
            helper.make_node("Sub", [self.T, "inplace_kv_pad_n"], [self.start]),
        ]
        self._positions: str | None = None

    def _tail(self, x: str, y: str):
        """The last max(2 - T, 0) rows of x along axis 1 (none when T >= 2)."""
        from onnx import helper

        return helper.make_node("Slice", [x, self.start, self.end, self.axis], [y])

    def grow(self, x: str, nodes: list) -> str:
        from onnx import helper

        nodes.append(self._tail(x, f"{x}_lastrow"))
        nodes.append(helper.make_node("Concat", [x, f"{x}_lastrow"], [f"{x}_padrow"], axis=1))
        return f"{x}_padrow"

    def positions(self, nodes: list) -> str:
        """position_ids [N, T] -> [N, max(T, 2)] (a pad row one past the last), built once."""
        from onnx import helper

        if self._positions is None:
            last = "inplace_kv_pad_positions_last"
            self.head += [self._tail("position_ids", last),
                          helper.make_node("Add", [last, self.one], [f"{last}_next"]),
                          helper.make_node("Concat", ["position_ids", f"{last}_next"], ["inplace_kv_pad_positions"],
                                           axis=1)]
            self._positions = "inplace_kv_pad_positions"
        return self._positions

    def cut(self, rows: str, y: str, nodes: list) -> None:
        from onnx import helper

        nodes.append(helper.make_node("Slice", [rows, self.zero, self.T, self.axis], [y]))


def attention_rows(T: int, pad: bool) -> int:
    """The rows each GroupQueryAttention of an in-place graph runs for a T-token call (AttentionPad)."""
    return max(T, 2) if pad else T


def _rope(gr, q: str, k: str, head_dim: int, allowed):
    """The RotaryEmbedding of q (k's the same: same cos/sin, same layout) when the operator may apply it."""
    if not allowed:
        return None
    rq, rk = rope_of(gr, q, head_dim), rope_of(gr, k, head_dim)
    if rq is None or rk is None or rq.input[1:3] != rk.input[1:3] or _interleaved(rq) != _interleaved(rk):
        return None
    return rq


def _interleaved(rope) -> int:
    return next((a.i for a in rope.attribute if a.name == "interleaved"), 0)


def tree_bias(tree_mask, past_len, total: int, dtype):
    """attention_bias [N,1,T,total] for a tree verify: 0 on the past and on each node's ancestors (and
    itself), -inf on the other new tokens (columns past..past+T-1 of each row; the rest is never read)."""
    import torch

    N, T, _ = tree_mask.shape
    bias = torch.zeros(N, 1, T, total, dtype=dtype)
    cols = past_len.to(torch.int64).view(N, 1, 1) + torch.arange(T).view(1, 1, T)  # [N,1,T]
    blocked = torch.zeros(N, T, T, dtype=dtype).masked_fill_(~tree_mask.to(torch.bool), float("-inf"))
    bias[:, 0].scatter_(2, cols.expand(N, T, T), blocked)
    return bias
