"""retrace::GatedSuffixFusion as an ONNX node + FunctionProto: structure, checker, ONNX Runtime parity
with the torch reference (fp32 within 1e-5), the TensorRT plugin attributes, and the torch.onnx
dynamo export path through `symbolic_gated_suffix_fusion`."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from retrace.plugins import onnx_function as of
from retrace.plugins.gated_suffix_fusion import gated_suffix_fusion_reference as ref
from retrace.plugins.onnx_symbolic import symbolic_gated_suffix_fusion

ort = pytest.importorskip("onnxruntime")

D, F = 24, 3


def _weights(d=D, f=F, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(d, 2 * d, generator=g) * d**-0.5, torch.randn(d, 2 * d + f, generator=g) * d**-0.5,
            torch.randn(d, generator=g), 1 + 0.1 * torch.randn(d, generator=g),
            torch.randn(d, d, generator=g) * d**-0.5]


def _activations(n=3, b=5, d=D, f=F, seed=1, nan_invalid=False):
    g = torch.Generator().manual_seed(seed)
    x, m, c = (torch.randn(n, b, d, generator=g) for _ in range(3))
    valid = (torch.rand(n, b, generator=g) > 0.4).float()
    valid[:, 0] = 0.0
    valid[0, 1] = 1.0
    if nan_invalid:
        m[valid == 0] = float("nan")
    return [x, m, c, torch.rand(n, b, f, generator=g), valid]


def _single_node_model(opset: int, elem=TensorProto.FLOAT, epsilon=1e-6, plugin_attrs=True):
    shapes = [["N", "B", D]] * 3 + [["N", "B", F], ["N", "B"], [D, 2 * D], [D, 2 * D + F], [D], [D], [D, D]]
    node = of.make_node(of.INPUTS, ["out"], epsilon=epsilon, name="gsf", aot=True)
    if not plugin_attrs:
        keep = [a for a in node.attribute if a.name == "epsilon"]
        del node.attribute[:]
        node.attribute.extend(keep)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, elem, s) for n, s in zip(of.INPUTS, shapes, strict=True)],
        [helper.make_tensor_value_info("out", elem, ["N", "B", D])])
    return of.attach_function(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _run(model, args):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return sess.run(None, {n: a.numpy() for n, a in zip(names, args, strict=True)})[0]


def test_function_proto_structure():
    fn = of.function_proto(23)
    assert (fn.domain, fn.name) == ("retrace", "GatedSuffixFusion")
    assert list(fn.input) == ["x", "memory", "correction", "features", "valid", "w_refine", "w_gate", "b_gate",
                              "norm_weight", "w_value"]
    assert list(fn.output) == ["out"]
    assert [(o.domain, o.version) for o in fn.opset_import] == [("", 23)]
    assert [(a.name, a.f) for a in fn.attribute_proto] == [("epsilon", pytest.approx(1e-6))]
    ops = [n.op_type for n in fn.node]
    assert "RMSNormalization" in ops and ops[-1] == "Where"
    rms = next(n for n in fn.node if n.op_type == "RMSNormalization")
    assert {a.name: a.ref_attr_name for a in rms.attribute}["epsilon"] == "epsilon"
    old = of.function_proto(20)
    assert [(o.domain, o.version) for o in old.opset_import] == [("", 20)]
    assert "RMSNormalization" not in [n.op_type for n in old.node]
    with pytest.raises(ValueError, match="opset >= 18"):
        of.function_proto(17)


def test_make_node_carries_tensorrt_plugin_attributes():
    node = of.make_node(of.INPUTS, ["y"], epsilon=1e-5, name="fuse0", aot=True)
    assert (node.op_type, node.domain, node.name) == ("GatedSuffixFusion", "retrace", "fuse0")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"epsilon": pytest.approx(1e-5), "plugin_namespace": b"retrace", "plugin_version": b"1",
                     "aot": 1}
    assert {a.name: a.type for a in node.attribute}["epsilon"] == onnx.AttributeProto.FLOAT
    jit = of.make_node(of.INPUTS, ["y"])  # default: the whole-op plugin is JIT only
    assert "aot" not in [a.name for a in jit.attribute]
    with pytest.raises(ValueError, match="10 inputs"):
        of.make_node(of.INPUTS[:-1], ["y"])


def test_attach_function_is_idempotent_and_follows_model_opset():
    model = _single_node_model(21)
    of.attach_function(model)
    assert [(f.domain, f.name) for f in model.functions] == [("retrace", "GatedSuffixFusion")]
    assert model.functions[0].opset_import[0].version == 21
    assert sorted((o.domain, o.version) for o in model.opset_import) == [("", 21), ("retrace", 1)]
    onnx.checker.check_model(model, full_check=True)
    # a body at another opset than the model's is what onnx.checker rejects
    of.attach_function(model, opset=23)
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model)
    of.detach_function(model)
    assert len(model.functions) == 0 and len(of.fusion_nodes(model)) == 1


@pytest.mark.parametrize("opset", [18, 23])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_onnxruntime_matches_reference(opset, dtype):
    torch_dt, elem = {"fp32": (torch.float32, TensorProto.FLOAT), "fp16": (torch.float16, TensorProto.FLOAT16)}[dtype]
    model = _single_node_model(opset, elem, epsilon=1e-5)
    onnx.checker.check_model(model, full_check=True)
    args = [a.to(torch_dt) for a in _activations(nan_invalid=True) + _weights()]
    got = torch.from_numpy(_run(model, args))
    valid = args[4] != 0
    assert torch.equal(got[~valid], args[0][~valid])  # empty slots: x, bit for bit, despite NaN memory
    exact = ref(*(a.double() for a in args), eps=1e-5)
    err = (got.double() - exact)[valid].abs().max().item()
    if dtype == "fp32":
        direct = (got - ref(*args, eps=1e-5))[valid].abs().max().item()
        assert direct <= 1e-5 and err <= 1e-5
    else:
        assert err <= 4e-3  # fp16 output rounding (|out| < 8: half ulp <= 4e-3)


def test_plugin_attributes_do_not_change_onnxruntime():
    args = _activations() + _weights()
    with_attrs = _run(_single_node_model(23), args)
    without = _run(_single_node_model(23, plugin_attrs=False), args)
    np.testing.assert_array_equal(with_attrs, without)


def test_epsilon_attribute_reaches_the_body():
    args = _activations() + _weights()
    args[1] = args[1] * 1e-2  # small memory: epsilon matters
    args[2] = args[2] * 1e-2
    got = _run(_single_node_model(23, epsilon=0.5), args)
    np.testing.assert_allclose(got, ref(*args, eps=0.5).numpy(), atol=1e-5)
    assert np.abs(got - ref(*args, eps=1e-6).numpy()).max() > 1e-3


class _Fusion(torch.nn.Module):
    def __init__(self, eps=1e-5):
        super().__init__()
        self.eps = eps
        for name, w in zip(("w_refine", "w_gate", "b_gate", "norm_weight", "w_value"), _weights(), strict=True):
            setattr(self, name, torch.nn.Parameter(w))

    def forward(self, x, memory, correction, features, valid):
        args = (x, memory, correction, features, valid, self.w_refine, self.w_gate, self.b_gate, self.norm_weight,
                self.w_value)
        if torch.onnx.is_in_onnx_export():
            y = symbolic_gated_suffix_fusion(*args, eps=self.eps)
        else:
            y = ref(*args, eps=self.eps)
        return y * 2.0  # a regular op after the custom node


def test_torch_dynamo_export_runs_in_onnxruntime():
    module = _Fusion().eval()
    example = tuple(_activations(n=2, b=3, seed=3))
    n_dim, b_dim = torch.export.Dim("N"), torch.export.Dim("B")
    dyn = {k: {0: n_dim, 1: b_dim} for k in ("x", "memory", "correction", "features", "valid")}
    program = torch.onnx.export(module, example, dynamo=True, opset_version=23, dynamic_shapes=dyn)
    model = program.model_proto
    nodes = of.fusion_nodes(model)
    assert len(nodes) == 1
    node = nodes[0]
    assert list(node.input[:5]) == ["x", "memory", "correction", "features", "valid"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["epsilon"] == pytest.approx(1e-5)
    assert (attrs["plugin_namespace"], attrs["plugin_version"]) == (b"retrace", b"1")
    assert "aot" not in attrs
    of.attach_function(model)
    onnx.checker.check_model(model, full_check=True)
    args = _activations(n=3, b=5, seed=4)  # other sizes than the example: dims stayed dynamic
    got = _run(model, args)
    with torch.no_grad():
        expected = module(*args).numpy()
    assert np.abs(got - expected).max() <= 1e-5
