"""GatedSuffixFusion: the one op ReTrace adds to a DFlash drafter (pure-torch reference).

For every block slot k of the next draft block:

    r_k   = m_k + W_c [m_k ; c_k]                                  (refine)
    g_k   = sigmoid(W_g [x_k ; r_k ; f_k] + b_g)                   (gate, per channel)
    out_k = x_k + valid_k * g_k * W_v RMSNorm(r_k)                 (gated residual fusion)

x = block input embeddings [N, B, d] (anchor + MASK embeddings), m = rejected-suffix memory
(drafter hidden states of the previous round, aligned to this block) [N, B, d], c = correction
(projected target taps of the same verify pass) [N, B, d], f = reliability features [N, B, F],
valid = 0/1 mask [N, B] (slot 0, the anchor, is never valid). Weights: w_refine [d, 2d],
w_gate [d, 2d + F], b_gate [d], norm_weight [d], w_value [d, d]. With w_value == 0 the op is the
identity, so a zero-initialised conditioner is exactly DFlash.
"""

from __future__ import annotations

import functools
import os

import torch

OP_NAME = "GatedSuffixFusion"
OP_DOMAIN = "retrace"
OP_VERSION = "1"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def gated_suffix_fusion_reference(
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
    eps: float = 1e-6,
) -> torch.Tensor:
    refined = memory + torch.cat([memory, correction], dim=-1) @ w_refine.T
    gate = torch.sigmoid(torch.cat([x, refined, features], dim=-1) @ w_gate.T + b_gate)
    value = rms_norm(refined, norm_weight, eps) @ w_value.T
    return x + valid.to(x.dtype).unsqueeze(-1) * gate * value


@functools.cache
def _cuda_impl():
    """The CUDA implementation, resolved once. The torch reference by default: on an H200 (gpu_check,
    2026-11-30, N=8 B=16 d=4096) the two Triton kernels took 0.16x (fp32) and 0.38x (fp16/bf16) of the
    reference's speed, whose three matmuls go to cuBLAS. RETRACE_SUFFIX_FUSION=triton selects the kernels
    (they stay what the TensorRT plugins run)."""
    if os.environ.get("RETRACE_SUFFIX_FUSION", "reference") != "triton":
        return gated_suffix_fusion_reference
    try:
        import triton  # noqa: F401

        from .triton_kernel import gated_suffix_fusion_triton
    except ImportError:
        return gated_suffix_fusion_reference
    return gated_suffix_fusion_triton


def gated_suffix_fusion(*args, **kwargs) -> torch.Tensor:
    """Dispatch point used by the models: the CUDA implementation (_cuda_impl) for CUDA tensors when no gradient is
    needed (the kernels have no backward) and autocast is off (the kernels take one dtype;
    autocast hands them mixed ones), else the reference."""
    x = args[0] if args else kwargs["x"]
    if (x.is_cuda and not torch.is_autocast_enabled("cuda")
            and not (torch.is_grad_enabled() and _any_requires_grad(args, kwargs))):
        return _cuda_impl()(*args, **kwargs)
    return gated_suffix_fusion_reference(*args, **kwargs)


def _any_requires_grad(args, kwargs) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values()))
