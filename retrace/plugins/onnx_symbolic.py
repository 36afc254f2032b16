"""Emit retrace::GatedSuffixFusion as one ONNX node from torch.onnx.export(dynamo=True).

Use it where the model applies the op:

    if torch.onnx.is_in_onnx_export():
        out = symbolic_gated_suffix_fusion(x, memory, correction, features, valid,
                                           w_refine, w_gate, b_gate, norm_weight, w_value, eps=eps)
    else:
        out = gated_suffix_fusion(...)

then, after export, `retrace.plugins.onnx_function.attach_function(model)` adds the op's body so
ONNX Runtime can run the graph (and onnx.checker accepts it). The node carries `epsilon` and the
TensorRT plugin keys (`plugin_namespace`, `plugin_version`; `aot` on request), see
`onnx_function.py`.
"""

from __future__ import annotations

import torch

from .gated_suffix_fusion import OP_DOMAIN, OP_NAME, OP_VERSION
from .onnx_function import DEFAULT_EPSILON, node_attributes


def symbolic_gated_suffix_fusion(
    x: torch.Tensor,
    memory: torch.Tensor,
    correction: torch.Tensor,
    features: torch.Tensor,
    valid: torch.Tensor,
    w_refine: torch.Tensor,
    w_gate: torch.Tensor,
    b_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    w_value: torch.Tensor,
    eps: float = DEFAULT_EPSILON,
    aot: bool = False,
) -> torch.Tensor:
    """The op as a single symbolic node: output dtype and shape are x's. Valid outside export too
    (returns an empty-valued placeholder tensor of the right shape), so call it only when exporting."""
    return torch.onnx.ops.symbolic(
        f"{OP_DOMAIN}::{OP_NAME}",
        (x, memory, correction, features, valid, w_refine, w_gate, b_gate, norm_weight, w_value),
        node_attributes(eps, aot),
        dtype=x.dtype,
        shape=x.shape,
        version=int(OP_VERSION),
    )
