"""`retrace::GatedSuffixFusion` as an ONNX custom node with a FunctionProto body.

The exported graphs keep the op as ONE node (domain "retrace", op_type "GatedSuffixFusion", float
attribute `epsilon`), inputs in the reference's order:

    x, memory, correction, features, valid, w_refine, w_gate, b_gate, norm_weight, w_value -> out

* ONNX Runtime has no kernel for it: `attach_function(model)` adds the op's body as a model-local
  FunctionProto (standard ops only), which ORT inlines. The body's default-domain opset must equal
  the model's, or `onnx.checker` rejects the model; `attach_function` reads it from the model.
* TensorRT's ONNX parser maps a node it has no importer for to a plugin named by op_type, looked up
  with the node's string attributes `plugin_namespace` and `plugin_version` (the node's domain is
  ignored), and uses the plugin's AOT implementation (no Python at engine run time) when the node
  carries `aot=1`. The whole-op plugin `retrace::GatedSuffixFusion` is JIT only (an AOT plugin is
  one kernel and this op is two launches), so exported nodes default to no `aot`; for Python-free
  engines `retrace.export.tensorrt` splits each node into the AOT pair GatedSuffixRefine +
  GatedSuffixFuse (both `aot=1`, see `tensorrt_plugin.py`). Since TensorRT 10.7 a registered
  plugin wins over a model-local function of the same name; older parsers always inline the
  function, so `retrace.export.tensorrt` removes it before parsing when the plugin is wanted.

Those attributes ride on the node next to `epsilon`. A function call node may carry attributes
its FunctionProto does not declare: ONNX Runtime and onnx.checker ignore them (tested in
tests/test_plugin_onnx.py), so one graph serves ORT and TensorRT unchanged.
"""

from __future__ import annotations

from onnx import AttributeProto, FunctionProto, ModelProto, NodeProto, TensorProto, helper

from .gated_suffix_fusion import OP_DOMAIN, OP_NAME, OP_VERSION

INPUTS = ("x", "memory", "correction", "features", "valid", "w_refine", "w_gate", "b_gate", "norm_weight",
          "w_value")
OUTPUTS = ("out",)
DEFAULT_EPSILON = 1e-6
DOMAIN_VERSION = int(OP_VERSION)
# Node attributes read by TensorRT's ONNX parser (FallbackPluginImporter / QDP AOT selection).
PLUGIN_NAMESPACE = OP_DOMAIN
PLUGIN_VERSION = OP_VERSION
MIN_OPSET = 18  # ReduceMean with `axes` as an input


def _ref_float(name: str, ref: str) -> AttributeProto:
    a = AttributeProto()
    a.name = name
    a.ref_attr_name = ref
    a.type = AttributeProto.FLOAT
    return a


def function_proto(opset: int = 23) -> FunctionProto:
    """The body of retrace::GatedSuffixFusion for a model whose default-domain opset is `opset`.

    opset >= 23 uses the native RMSNormalization (fp32 statistics, like the reference); 18..22 the
    equivalent decomposition. `epsilon` defaults to 1e-6 when the node does not set it.
    """
    if opset < MIN_OPSET:
        raise ValueError(f"GatedSuffixFusion's ONNX function needs opset >= {MIN_OPSET}, got {opset}")
    n = []

    def node(op, ins, outs, **kw):
        n.append(helper.make_node(op, list(ins), list(outs), **kw))

    node("Constant", [], ["axis_last"], value=helper.make_tensor("axis_last", TensorProto.INT64, [1], [-1]))
    node("Constant", [], ["zero_f"], value=helper.make_tensor("zero_f", TensorProto.FLOAT, [], [0.0]))
    # refine: r = m + [m; c] W_c^T
    node("Concat", ["memory", "correction"], ["mc"], axis=-1)
    node("Transpose", ["w_refine"], ["w_refine_t"], perm=[1, 0])
    node("MatMul", ["mc", "w_refine_t"], ["refine_delta"])
    node("Add", ["memory", "refine_delta"], ["refined"])
    # gate: sigmoid([x; r; f] W_g^T + b)
    node("Concat", ["x", "refined", "features"], ["xrf"], axis=-1)
    node("Transpose", ["w_gate"], ["w_gate_t"], perm=[1, 0])
    node("MatMul", ["xrf", "w_gate_t"], ["gate_lin"])
    node("Add", ["gate_lin", "b_gate"], ["gate_pre"])
    node("Sigmoid", ["gate_pre"], ["gate"])
    # value: W_v RMSNorm(r)
    if opset >= 23:
        rms = helper.make_node("RMSNormalization", ["refined", "norm_weight"], ["normed"], axis=-1,
                               stash_type=1)
        rms.attribute.append(_ref_float("epsilon", "epsilon"))
        n.append(rms)
    else:
        eps = helper.make_node("Constant", [], ["eps_f"])
        eps.attribute.append(_ref_float("value_float", "epsilon"))
        n.append(eps)
        node("Cast", ["refined"], ["r32"], to=TensorProto.FLOAT)
        node("Mul", ["r32", "r32"], ["r_sq"])
        node("ReduceMean", ["r_sq", "axis_last"], ["ms"], keepdims=1)
        node("Add", ["ms", "eps_f"], ["ms_eps"])
        node("Sqrt", ["ms_eps"], ["rms"])
        node("Div", ["r32", "rms"], ["r_hat32"])
        node("CastLike", ["r_hat32", "refined"], ["r_hat"])
        node("Mul", ["r_hat", "norm_weight"], ["normed"])
    node("Transpose", ["w_value"], ["w_value_t"], perm=[1, 0])
    node("MatMul", ["normed", "w_value_t"], ["value"])
    # out = x + valid * g * v, and exactly x where valid == 0 (stale memory never leaks)
    node("CastLike", ["valid", "x"], ["valid_x"])
    node("Unsqueeze", ["valid_x", "axis_last"], ["valid_u"])
    node("Mul", ["gate", "value"], ["gv"])
    node("Mul", ["valid_u", "gv"], ["delta"])
    node("Add", ["x", "delta"], ["fused"])
    node("CastLike", ["zero_f", "x"], ["zero_x"])
    node("Equal", ["valid_u", "zero_x"], ["is_invalid"])
    node("Where", ["is_invalid", "x", "fused"], ["out"])

    fn = helper.make_function(
        OP_DOMAIN, OP_NAME, list(INPUTS), list(OUTPUTS), n,
        opset_imports=[helper.make_opsetid("", opset)],
        attributes=[],
        doc_string="ReTrace gated suffix fusion: x + valid * sigmoid(W_g[x;r;f]+b) * W_v RMSNorm(r), "
                   "r = m + W_c[m;c]",
    )
    fn.attribute_proto.append(helper.make_attribute("epsilon", DEFAULT_EPSILON))
    return fn


def node_attributes(epsilon: float = DEFAULT_EPSILON, aot: bool = False) -> dict:
    """Attributes of a GatedSuffixFusion node: the op's own `epsilon` plus TensorRT's plugin keys."""
    attrs = {"epsilon": float(epsilon), "plugin_namespace": PLUGIN_NAMESPACE, "plugin_version": PLUGIN_VERSION}
    if aot:
        attrs["aot"] = 1
    return attrs


def make_node(inputs, outputs, epsilon: float = DEFAULT_EPSILON, name: str | None = None,
              aot: bool = False) -> NodeProto:
    """A retrace::GatedSuffixFusion node. `aot=True` adds `aot=1`, which asks TensorRT (QDP, >= 10.8)
    for a plugin's AOT implementation (compiled PTX embedded in the engine, no Python at run time);
    the whole-op plugin has none, see the module docstring."""
    inputs, outputs = list(inputs), list(outputs)
    if len(inputs) != len(INPUTS) or len(outputs) != len(OUTPUTS):
        raise ValueError(f"GatedSuffixFusion takes {len(INPUTS)} inputs {INPUTS} and 1 output, "
                         f"got {len(inputs)} and {len(outputs)}")
    return helper.make_node(OP_NAME, inputs, outputs, name=name, domain=OP_DOMAIN,
                            **node_attributes(epsilon, aot))


def model_opset(model: ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    raise ValueError("model has no default-domain opset import")


def attach_function(model: ModelProto, opset: int | None = None) -> ModelProto:
    """Add (or replace) the FunctionProto of retrace::GatedSuffixFusion and the "retrace" opset import,
    in place; returns the model. The function's opset defaults to the model's default-domain opset."""
    opset = model_opset(model) if opset is None else opset
    fn = function_proto(opset)
    keep = [f for f in model.functions if not (f.domain == fn.domain and f.name == fn.name)]
    del model.functions[:]
    model.functions.extend(keep + [fn])
    if not any(imp.domain == OP_DOMAIN for imp in model.opset_import):
        model.opset_import.append(helper.make_opsetid(OP_DOMAIN, DOMAIN_VERSION))
    return model


def detach_function(model: ModelProto) -> ModelProto:
    """Remove the model-local GatedSuffixFusion function (so a parser must use the plugin), in place."""
    keep = [f for f in model.functions if not (f.domain == OP_DOMAIN and f.name == OP_NAME)]
    del model.functions[:]
    model.functions.extend(keep)
    return model


def fusion_nodes(model: ModelProto) -> list[NodeProto]:
    """The GatedSuffixFusion nodes of the main graph."""
    return [nd for nd in model.graph.node if nd.op_type == OP_NAME and nd.domain == OP_DOMAIN]

