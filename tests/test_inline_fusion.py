"""retrace.export.inline_fusion on the session bundle's fp32 ReTrace drafter graph: the inlined graph (no
custom node, no function, the three weight Transposes folded into initializers that MatMuls read) computes
the function form's hidden states and logits in ONNX Runtime, with suffix rows valid and invalid and with
none valid (DFlash rounds on a ReTrace graph: the fusion is the identity there), and a graph without the node
is left alone."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from export_fixtures import pair_and_bundle

from retrace.export.inline_fusion import inline_gated_suffix_fusion
from retrace.export.onnx_export import drafter_inputs, drafter_io
from retrace.export.onnx_parity import session
from retrace.models.drafter import load_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_inlined_fusion_computes_the_function_form(tmp_path):
    built = pair_and_bundle()
    src = built.bundle / "drafter" / "model.onnx"
    m = onnx.load(str(src))
    assert [n.op_type for n in m.graph.node].count("GatedSuffixFusion") == 1
    names = inline_gated_suffix_fusion(m)
    assert names == ["gated_suffix_fusion_gate", "gated_suffix_fusion_refine", "gated_suffix_fusion_value"]
    assert "GatedSuffixFusion" not in {n.op_type for n in m.graph.node} and not m.functions
    inits = {i.name for i in m.graph.initializer}
    matmuls = {n.name: n for n in m.graph.node if n.op_type == "MatMul"}
    assert all(matmuls[n].input[1] in inits for n in names)  # constant weights: what the quantizer takes
    assert not [n for n in m.graph.node if n.op_type == "Transpose" and n.input[0] in inits]
    dst = tmp_path / "inlined.onnx"
    onnx.save_model(m, str(dst), save_as_external_data=True, location="inlined.onnx.data")

    _, drafter = load_pair(built.target, built.drafter)
    L = drafter.config.layers.num_hidden_layers
    io_names = drafter_io(L, True)[0]
    for zero in (False, True):
        args = drafter_inputs(drafter, 2, 3, 8, 6, True, seed=3, valid_all_zero=zero)
        feeds = {n: a.numpy() for n, a in zip(io_names, args, strict=True)}
        ref = session(src).run(["hidden", "logits"], feeds)
        got = session(dst).run(["hidden", "logits"], feeds)
        for r, g in zip(ref, got, strict=True):
            assert np.abs(g - r).max() <= 1e-5 * max(1.0, float(np.abs(r).max()))


def test_a_graph_without_the_node_is_unchanged():
    built = pair_and_bundle()
    m = onnx.load(str(built.bundle / "target" / "model.onnx"), load_external_data=False)
    before = m.SerializeToString()
    assert inline_gated_suffix_fusion(m) == [] and m.SerializeToString() == before
