"""The `@triton.jit` bodies of GatedSuffixFusion. Imported lazily by `triton_kernel.py` (this module
needs triton at import time, and honours TRITON_INTERPRET=1 as of that import). Layouts: every
tensor row-major contiguous; rows = the N*B flattened block slots."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gsf_refine_kernel(
    memory_ptr, correction_ptr, w_refine_ptr,  # inputs: [M, d], [M, d], [d, 2d]
    n_rows, d,  # int32 scalars
    refined_ptr,  # output: fp32 [M, d]
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """refined[m, n] = memory[m, n] + sum_k memory[m, k] W_c[n, k] + correction[m, k] W_c[n, d + k]."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < n_rows
    n_ok = rn < d
    w_row = rn[None, :] * (2 * d)  # W_c row n starts at n * 2d; loaded transposed as [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        k = k0 + rk
        k_ok = k < d
        a_mask = m_ok[:, None] & k_ok[None, :]
        w_mask = k_ok[:, None] & n_ok[None, :]
        a_off = rm[:, None] * d + k[None, :]
        mem = tl.load(memory_ptr + a_off, mask=a_mask, other=0.0)
        cor = tl.load(correction_ptr + a_off, mask=a_mask, other=0.0)
        w_m = tl.load(w_refine_ptr + w_row + k[:, None], mask=w_mask, other=0.0)
        w_c = tl.load(w_refine_ptr + w_row + d + k[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(mem.to(DOT_DTYPE), w_m.to(DOT_DTYPE), acc, input_precision="ieee")
        acc = tl.dot(cor.to(DOT_DTYPE), w_c.to(DOT_DTYPE), acc, input_precision="ieee")
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_off = rm[:, None] * d + rn[None, :]
    mem_self = tl.load(memory_ptr + out_off, mask=out_mask, other=0.0).to(tl.float32)
    tl.store(refined_ptr + out_off, mem_self + acc, mask=out_mask)


@triton.jit
def gsf_fuse_kernel(
    x_ptr, refined_ptr, features_ptr, valid_ptr,  # inputs: [M, d], fp32 [M, d], [M, F], [M]
    w_gate_ptr, b_gate_ptr, norm_weight_ptr, w_value_ptr,  # [d, 2d+F], [d], [d], [d, d]
    n_rows, d, n_feat,  # int32 scalars
    out_ptr,  # output: [M, d]
    EPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """out = x + valid * sigmoid(W_g [x; R; f] + b) * (W_v (w * R)) * rstd(R); x where valid == 0."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < n_rows
    n_ok = rn < d
    g_row = rn[None, :] * (2 * d + n_feat)
    v_row = rn[None, :] * d
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    value = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        k = k0 + rk
        k_ok = k < d
        a_mask = m_ok[:, None] & k_ok[None, :]
        w_mask = k_ok[:, None] & n_ok[None, :]
        a_off = rm[:, None] * d + k[None, :]
        xk = tl.load(x_ptr + a_off, mask=a_mask, other=0.0)
        rk_ = tl.load(refined_ptr + a_off, mask=a_mask, other=0.0)
        nw = tl.load(norm_weight_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        wg_x = tl.load(w_gate_ptr + g_row + k[:, None], mask=w_mask, other=0.0)
        wg_r = tl.load(w_gate_ptr + g_row + d + k[:, None], mask=w_mask, other=0.0)
        wv = tl.load(w_value_ptr + v_row + k[:, None], mask=w_mask, other=0.0)
        gate = tl.dot(xk.to(DOT_DTYPE), wg_x.to(DOT_DTYPE), gate, input_precision="ieee")
        gate = tl.dot(rk_.to(DOT_DTYPE), wg_r.to(DOT_DTYPE), gate, input_precision="ieee")
        sumsq += tl.sum(rk_ * rk_, axis=1)
        value = tl.dot((rk_ * nw[None, :]).to(DOT_DTYPE), wv.to(DOT_DTYPE), value, input_precision="ieee")
    # Reliability features: F is tiny (3), an outer-product update per feature.
    for f in range(0, n_feat):
        fv = tl.load(features_ptr + rm * n_feat + f, mask=m_ok, other=0.0).to(tl.float32)
        wf = tl.load(w_gate_ptr + rn * (2 * d + n_feat) + 2 * d + f, mask=n_ok, other=0.0).to(tl.float32)
        gate += fv[:, None] * wf[None, :]
    bias = tl.load(b_gate_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    gate = tl.sigmoid(gate + bias[None, :])
    rstd = 1.0 / tl.sqrt(sumsq / d + EPS)
    valid = tl.load(valid_ptr + rm, mask=m_ok, other=0.0).to(tl.float32)
    out_mask = m_ok[:, None] & n_ok[None, :]
    out_off = rm[:, None] * d + rn[None, :]
    x_self = tl.load(x_ptr + out_off, mask=out_mask, other=0.0)
    fused = x_self.to(tl.float32) + valid[:, None] * gate * (value * rstd[:, None])
    result = tl.where(valid[:, None] != 0.0, fused.to(x_self.dtype), x_self)
    tl.store(out_ptr + out_off, result, mask=out_mask)
