"""Qwen3 decoder-layer pieces shared by the target and the drafter, as plain modules and functions.

Parameter names follow transformers' Qwen3 (`self_attn.q_proj`, `mlp.gate_proj`, ...), so HF and z-lab
state dicts load without renaming. Nothing here owns a cache: K/V come in and go out as tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from retrace.models.config import LayerConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [N, T, head_dim] for absolute positions [N, T] (default RoPE, as transformers computes it)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64,
                                             device=positions.device).float() / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, T, hd]; cos/sin [N, T, hd]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


# How `attention` appears in an ONNX export (set by retrace.export.onnx_export, read only while
# torch.onnx.is_in_onnx_export()): "native" = one opset-23 `Attention` node per layer,
# "decomposed" = MatMul/Softmax over explicitly repeated KV heads. Eager numerics never depend on it.
ONNX_ATTENTION = "native"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              gqa: bool | None = None) -> torch.Tensor:
    """q [N,H,T,hd], k/v [N,Hkv,S,hd], mask [N,1,T,S] bool (True = attend). Returns [N,H,T,hd]. gqa: H != Hkv
    (from the config, so that torch.compile with dynamic shapes sees a constant; None: from the shapes)."""
    if torch.onnx.is_in_onnx_export():
        if ONNX_ATTENTION == "native":
            return torch.onnx.ops.attention(q, k, v, attn_mask=mask)[0]
        return _attention_decomposed(q, k, v, mask)
    gqa = q.shape[1] != k.shape[1] if gqa is None else gqa
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def lm_head(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h [..., d] -> logits [..., V] with weight [V, d] (an nn.Linear's). In an ONNX export the weight is
    the A operand of one GEMM over all rows, (W @ h2^T)^T: the graph keeps the [V, d] table as it is (no
    transposed copy), the tied embedding's Gather reads the same initializer, and a second session can
    share it (retrace.runtime.shared_weights). The ONNX Runtime backend rewrites this head when it loads
    the graph (retrace.runtime.lm_head_split: one prepacked Gemm, in a session of its own when the drafter
    shares a large table): as the A operand, ONE row (an ar step) costs as much as 16 (MLAS computes a
    16-wide panel for a 1-column B), 1.3-1.7x the prepacked form at the Qwen3-0.6B shape, 4x at the zoo's."""
    if torch.onnx.is_in_onnx_export():
        rows = h.reshape(-1, h.shape[-1])
        return (weight @ rows.transpose(0, 1)).transpose(0, 1).reshape(*h.shape[:-1], weight.shape[0])
    return F.linear(h, weight)


def _attention_decomposed(q, k, v, mask):
    """The same attention as plain MatMul/Softmax (the export's "decomposed" form)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


class Attention(nn.Module):
    def __init__(self, c: LayerConfig):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.c.head_dim).transpose(1, 2)

    def query(self, h: torch.Tensor, cos, sin) -> torch.Tensor:
        return apply_rope(self.q_norm(self._heads(self.q_proj(h), self.c.num_attention_heads)), cos, sin)

    def key_value(self, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Roped, normalised K and V [N, Hkv, T, hd] for states h [N, T, d]."""
        k = apply_rope(self.k_norm(self._heads(self.k_proj(h), self.c.num_key_value_heads)), cos, sin)
        v = self._heads(self.v_proj(h), self.c.num_key_value_heads)
        return k, v

    def output(self, q, k, v, mask) -> torch.Tensor:
        o = attention(q, k, v, mask, self.c.num_attention_heads != self.c.num_key_value_heads)
        return self.o_proj(o.transpose(1, 2).reshape(*o.shape[:1], o.shape[2], -1))


class MLP(nn.Module):
    def __init__(self, c: LayerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: LayerConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, past_k, past_v, mask, extra_kv=None):
        """One layer over new states x [N,T,d]. Keys/values attended: [past; extra_kv; new].

        Returns (x_out, k_new, v_new) with the new tokens' K/V (for the caller's cache).
        """
        h = self.input_layernorm(x)
        q = self.self_attn.query(h, cos, sin)
        k_new, v_new = self.self_attn.key_value(h, cos, sin)
        ks, vs = [past_k], [past_v]
        if extra_kv is not None:
            ks.append(extra_kv[0])
            vs.append(extra_kv[1])
        k = torch.cat([*ks, k_new], dim=2)
        v = torch.cat([*vs, v_new], dim=2)
        x = x + self.self_attn.output(q, k, v, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_new, v_new


def past_mask(past_len: torch.Tensor, P: int, T: int, past_valid: torch.Tensor | None = None) -> torch.Tensor:
    """[N, 1, T, P] bool: cache entry i is visible when i < past_len[n] (or past_valid[n, i])."""
    if past_valid is None:
        past_valid = torch.arange(P, device=past_len.device).unsqueeze(0) < past_len.unsqueeze(1)
    return past_valid[:, None, None, :].expand(-1, 1, T, P)
