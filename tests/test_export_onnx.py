"""The exported ONNX graphs: structure (I/O, dynamic dims, the one GatedSuffixFusion node and its function,
onnx.checker) and ONNX Runtime vs torch parity on shapes other than the export's examples.

The graphs come from the session bundle (tests/export_fixtures.py), exported by `retrace-export build`.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from export_fixtures import BLOCK, pair_and_bundle

from retrace.export import onnx_export, onnx_parity
from retrace.models.drafter import load_pair
from retrace.plugins import onnx_function as of

TOL = 1e-4


@pytest.fixture(scope="module")
def built():
    return pair_and_bundle()


@pytest.fixture(scope="module")
def models(built):
    return load_pair(built.target, built.drafter)


def graph(built, name) -> onnx.ModelProto:
    return onnx.load(str(built.bundle / name / "model.onnx"), load_external_data=False)


def dims(vi) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def test_target_graph_io_and_dynamic_dims(built, models):
    target, _ = models
    g = graph(built, "target")
    L = target.config.num_hidden_layers
    c = target.config.layers
    ins = {i.name: dims(i) for i in g.graph.input}
    outs = {o.name: dims(o) for o in g.graph.output}
    assert list(ins) == onnx_export.target_io(L)[0] and list(outs) == onnx_export.target_io(L)[1]
    assert ins["input_ids"] == ["N", "T"] and ins["position_ids"] == ["N", "T"] and ins["past_len"] == ["N"]
    assert ins["logits_index"] == ["N", "K"]
    for i in range(L):
        assert ins[f"past_key_{i}"] == ["N", c.num_key_value_heads, "P", c.head_dim]
        assert outs[f"new_value_{i}"] == ["N", c.num_key_value_heads, "T", c.head_dim]
    assert outs["logits"] == ["N", "K", target.config.vocab_size]
    assert outs["taps"] == ["N", "T", len(target.tap_layers) * c.hidden_size]
    types = {i.name: i.type.tensor_type.elem_type for i in g.graph.input}
    assert types["input_ids"] == types["past_len"] == onnx.TensorProto.INT64
    assert types["past_key_0"] == onnx.TensorProto.FLOAT
    ops = [n.op_type for n in g.graph.node]
    # opset 23 native forms: one Attention per layer, fused RMSNorm; no custom op in the target
    assert ops.count("Attention") == L and "RMSNormalization" in ops
    assert not of.fusion_nodes(g) and not g.functions
    assert {o.domain: o.version for o in g.opset_import}[""] == 23
    assert not any(n.metadata_props for n in g.graph.node)  # no stack traces with build-machine paths
    onnx.checker.check_model(str(built.bundle / "target" / "model.onnx"))


def test_drafter_graph_has_one_fusion_node_with_plugin_attributes(built, models):
    _, drafter = models
    g = graph(built, "drafter")
    L = drafter.config.layers.num_hidden_layers
    ins = {i.name: dims(i) for i in g.graph.input}
    outs = {o.name: dims(o) for o in g.graph.output}
    assert list(ins) == onnx_export.drafter_io(L, suffix=True)[0]
    d = drafter.config.hidden_size
    assert ins["ctx_taps"] == ["N", "C", drafter.config.num_taps * d] and ins["block_ids"] == ["N", "B"]
    assert ins["memory"] == ["N", "B", d] and ins["features"] == ["N", "B", 3] and ins["valid"] == ["N", "B"]
    assert ins["corr_index"] == ["N", "B"] and ins["past_key_0"][2] == "P"
    assert outs["hidden"] == ["N", "B", d] and outs["logits"][0] == "N" and outs["new_key_0"][2] == "C"
    nodes = of.fusion_nodes(g)
    assert len(nodes) == 1
    (node,) = nodes
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert node.domain == "retrace" and node.op_type == "GatedSuffixFusion"
    assert attrs["plugin_namespace"] == b"retrace" and attrs["plugin_version"] == b"1"
    assert attrs["epsilon"] == pytest.approx(drafter.conditioner.eps)
    assert list(node.input)[:1] and len(node.input) == len(of.INPUTS)
    (fn,) = [f for f in g.functions if f.name == "GatedSuffixFusion"]
    assert fn.domain == "retrace" and {o.domain: o.version for o in fn.opset_import}[""] == 23
    assert {o.domain: o.version for o in g.opset_import}.get("retrace") == 1
    # the shared target weights travel with the drafter graph
    shapes = {i.name: tuple(i.dims) for i in g.graph.initializer}
    V = drafter.config.vocab_size
    assert shapes["shared_target.model.embed_tokens.weight"] == (V, d)
    assert shapes["shared_target.lm_head.weight"] == (V, d)  # [V, d]: the A operand of its GEMM, no .T copy
    # weights keep readable names (no anonymous folded copies), and none is stored twice
    assert all(n.startswith(("drafter.", "shared_target.")) for n, s in shapes.items() if len(s) == 2)
    onnx.checker.check_model(str(built.bundle / "drafter" / "model.onnx"))


def test_weights_are_external_data(built):
    for name in ("target", "drafter"):
        g = graph(built, name)
        big = [i for i in g.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
        assert big, name
        assert all({e.key: e.value for e in i.external_data}["location"] == "model.onnx.data" for i in big)


# -- parity on shapes the export never saw --------------------------------------------------------------------
def _run_target(sess, target, N, T, P, K, past_len=None, seed=0):
    names_in, names_out = onnx_export.target_io(target.config.num_hidden_layers)
    args = onnx_export.target_inputs(target, N, T, P, K, seed=seed, past_len=past_len)
    got = sess.run(names_out, {n: a.numpy() for n, a in zip(names_in, args, strict=True)})
    with torch.no_grad():
        logits, taps, nk, nv = target(args[0], args[1], list(args[4::2]), list(args[5::2]), args[2], args[3])
    return got, (logits, taps, *[t for kv in zip(nk, nv, strict=True) for t in kv])


@pytest.mark.parametrize("N,T,P,K", [(1, 1, 0, 1), (1, 1, 37, 1), (3, 5, 11, 5), (1, BLOCK, 20, BLOCK),
                                     (4, 17, 0, 1), (2, 2, 2, 2)])
def test_target_parity_prefill_decode_verify(built, models, N, T, P, K):
    target, _ = models
    sess = onnx_parity.session(built.bundle / "target" / "model.onnx")
    got, ref = _run_target(sess, target, N, T, P, K, seed=N * 100 + T)
    assert np.abs(got[0] - ref[0].numpy()).max() < TOL  # logits
    assert np.abs(got[1] - ref[1].numpy()).max() < TOL  # taps
    for g, r in zip(got[2:], ref[2:], strict=True):
        assert np.abs(g - r.numpy()).max() < TOL


def test_target_parity_ragged_past(built, models):
    """Rows with different past lengths in one call: entries >= past_len[n] must not be attended."""
    target, _ = models
    sess = onnx_parity.session(built.bundle / "target" / "model.onnx")
    got, ref = _run_target(sess, target, 3, 4, 12, 4, past_len=torch.tensor([12, 0, 5]))
    assert np.abs(got[0] - ref[0].numpy()).max() < TOL


@pytest.mark.parametrize("B", [BLOCK, 3])
def test_drafter_parity_with_and_without_suffix(built, models, B):
    _, drafter = models
    res = onnx_parity.drafter_parity(drafter, built.bundle / "drafter" / "model.onnx", block_size=B)
    assert set(res) == {"first_round", "dflash", "retrace"}
    for case, r in res.items():
        assert r["logits"] < TOL and r["hidden"] < TOL and r["kv"] < TOL, (case, r)


def test_retrace_suffix_changes_the_draft(built, models):
    """The graph's fusion node is live: suffix inputs change the logits, valid = 0 reproduces DFlash."""
    _, drafter = models
    sess = onnx_parity.session(built.bundle / "drafter" / "model.onnx")
    L = drafter.config.layers.num_hidden_layers
    names_in, names_out = onnx_export.drafter_io(L, True)
    on = onnx_export.drafter_inputs(drafter, 2, BLOCK, BLOCK, 4, suffix=True, seed=5)
    off = onnx_export.drafter_inputs(drafter, 2, BLOCK, BLOCK, 4, suffix=True, seed=5, valid_all_zero=True)
    a = sess.run(["logits"], {n: t.numpy() for n, t in zip(names_in, on, strict=True)})[0]
    b = sess.run(["logits"], {n: t.numpy() for n, t in zip(names_in, off, strict=True)})[0]
    assert np.abs(a - b).max() > 1e-2
