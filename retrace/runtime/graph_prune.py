"""Dead-node elimination for the load-time graph rewrites (lm_head_split, kv_inplace)."""

from __future__ import annotations


def prune(g) -> None:
    """Drop the nodes and initializers of `g` (an onnx.GraphProto, changed in place) through which nothing
    reaches the graph's outputs."""
    live = {o.name for o in g.output}
    keep = []
    for n in reversed(list(g.node)):
        if any(o in live for o in n.output):
            keep.append(n)
            live.update(n.input)
    del g.node[:]
    g.node.extend(reversed(keep))
    kept = [i for i in g.initializer if i.name in live]
    del g.initializer[:]
    g.initializer.extend(kept)
