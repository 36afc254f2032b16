"""A minimal greedy decoder the way vLLM / SGLang / gpt-fast run a Qwen3: the gpu_bench's reference.

Static K/V cache per layer [1, Hkv, L, hd] written in place with index_copy_, a precomputed RoPE table, the
mask built on the device from the position, the argmax on the device, and on CUDA the one-token step captured
once as a CUDA graph and replayed. It reads the weights of a `retrace.models.Qwen3Target` (the same tensors,
no copy) but none of its code, so the gpu_bench compares our runtime with an independent implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrace.models.target import Qwen3Target


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class StaticGreedy:
    def __init__(self, target: Qwen3Target, max_len: int):
        c = target.config.layers
        self.t, self.c, self.max_len = target, c, max_len
        dev, dt = target.lm_head.weight.device, target.lm_head.weight.dtype
        self.device = dev
        shape = (1, c.num_key_value_heads, max_len, c.head_dim)
        self.k = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dt, device=dev) for _ in range(c.num_hidden_layers)]
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, device=dev).float() / c.head_dim))
        freqs = torch.arange(max_len, device=dev).float().unsqueeze(1) * inv
        emb = torch.cat([freqs, freqs], -1)
        self.cos, self.sin = emb.cos().to(dt), emb.sin().to(dt)
        self.token = torch.zeros(1, 1, dtype=torch.int64, device=dev)  # the captured step's inputs
        self.pos = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graph = None
        self.out = None

    def _rope(self, x, pos):
        cos, sin = self.cos[pos].view(1, 1, -1, x.shape[-1]), self.sin[pos].view(1, 1, -1, x.shape[-1])
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """ids [1, T] at positions pos [T] (consecutive) -> the argmax after the last one [1]."""
        c, m = self.c, self.t.model
        T = ids.shape[1]
        x = m.embed_tokens(ids)
        visible = torch.arange(self.max_len, device=self.device).unsqueeze(0) <= pos.unsqueeze(1)  # [T, L]
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = _norm(x, layer.input_layernorm.weight, c.rms_norm_eps)
            q = a.q_proj(h).view(1, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
            k = a.k_proj(h).view(1, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            v = a.v_proj(h).view(1, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
            q = self._rope(_norm(q, a.q_norm.weight, c.rms_norm_eps), pos)
            k = self._rope(_norm(k, a.k_norm.weight, c.rms_norm_eps), pos)
            self.k[i].index_copy_(2, pos, k)
            self.v[i].index_copy_(2, pos, v)
            o = F.scaled_dot_product_attention(q, self.k[i], self.v[i], attn_mask=visible.view(1, 1, T, -1),
                                               enable_gqa=c.num_attention_heads != c.num_key_value_heads)
            x = x + a.o_proj(o.transpose(1, 2).reshape(1, T, -1))
            h = _norm(x, layer.post_attention_layernorm.weight, c.rms_norm_eps)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        h = _norm(x[:, -1:], m.norm.weight, c.rms_norm_eps)
        return self.t.lm_head(h)[:, 0].argmax(-1)

    def _step(self) -> torch.Tensor:
        nxt = self.forward(self.token, self.pos)
        return nxt

    def capture(self) -> None:
        """On CUDA: the one-token step as a CUDA graph (warmed up on a side stream first)."""
        if self.device.type != "cuda":
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self._step()

    def decode_step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        """One token [1] at position pos -> the next [1] (a graph replay on CUDA)."""
        self.token.copy_(token.view(1, 1))
        self.pos.fill_(pos)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.out.clone()

    def generate(self, prompt: list[int], n: int) -> list[int]:
        """Greedy continuation (n new tokens); one read at the end."""
        ids = torch.tensor([prompt], device=self.device)
        tok = self.forward(ids, torch.arange(len(prompt), device=self.device))
        out = [tok]
        for i in range(n - 1):
            tok = self.decode_step(tok, len(prompt) + i)
            out.append(tok)
        return torch.cat(out).tolist()
