"""Function-preserving inflation of a Qwen3 target + DFlash drafter + ReTrace conditioner to a larger shape.

Pure tensor functions, one per weight kind, driven by a `Plan`. Notation: d, hd, H, Hkv, I, L, V are the
small model's sizes, D, hd', H', Hkv', I', L', V' the inflated ones.

Residual stream layout (target and drafter; channels of width D)::

    [0, d)      the original channels x
    [d, 2d)     a scaled copy beta * x (every writer's rows are copied and scaled by beta; nothing reads it)
    2d          a constant channel c (set by the embedding, written by no layer)
    (2d, D)     zero (no writer)

Why the copy and the constant: one `rms_norm_eps` per config serves both the hidden-size norms and the
per-head q/k norms. Zero-padding head_dim (hd -> hd' = r*hd) forces eps' = eps * hd/hd' on the q/k norms.
A hidden-size norm x * rsqrt(mean(x^2) + eps) * w then sees mean'(x'^2) + eps' =
(K*sum(x^2) + c^2 + D*eps') / D with K = 1 + beta^2; choosing beta^2 = D*eps'/(d*eps) and c^2 = d*eps makes
that exactly K*(sum(x^2) + d*eps)/D = (K*d/D) * (mean(x^2) + eps), so the norm weight is scaled by
sqrt(K*d/D) and the original channels come out identical. The drafter's context stream (fc output) has no
constant; it carries a copy with beta_ctx^2 = beta^2 - 1 instead (needs D/d >= hd'/hd).

Heads: original q heads keep their K/V head (copies of a K/V head where the new group size is smaller);
within a head, original dim i goes to r*i and i + hd/2 to r*i + hd'/2, so RoPE pairs (i, i + hd'/2) and
frequencies theta^(-2j/hd') match the original ones exactly; the padded q/k dims are zero. The q_norm
weight is unchanged (its output grows by sqrt(r), which is exactly the change of the 1/sqrt(head_dim)
attention scale) and the k_norm weight is scaled by 1/sqrt(r). New heads, MLP channels and layers get
random weights whose outputs are multiplied by zero (o_proj / down_proj columns or whole matrices).

Vocabulary: ids V..V'-1 are padding. The final norms (target and drafter) pass the constant channel with
weight 1, so it arrives at the LM head as c * rsqrt(...) > 0; the LM head rows of padded ids are
-pad_scale on that channel and zero elsewhere, real rows are zero on it. Padded logits are therefore
-pad_scale * c * rsqrt(...), chosen far below every real logit (see `pad_scale_for`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from retrace.errors import RetraceError


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int

    def to_dict(self) -> dict:
        return asdict(self)


# Published Qwen3 shapes (config.json of Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B) and their non-embedding
# parameter counts as Qwen reports them.
SHAPES = {
    "qwen3-0.6b": Shape(1024, 28, 16, 8, 128, 3072, 151936),
    "qwen3-1.7b": Shape(2048, 28, 16, 8, 128, 6144, 151936),
}
NON_EMBEDDING_PARAMS = {"qwen3-0.6b": 0.44e9, "qwen3-1.7b": 1.4e9}


@dataclass(frozen=True)
class Plan:
    """Where every original channel, head, dim and layer goes, and the norm compensation factors."""

    small: Shape
    big: Shape
    eps: float  # the small target's (and drafter's) rms_norm_eps
    q_src: tuple[int | None, ...]  # per new q head: the original q head it carries, or None (new head)
    kv_src: tuple[int | None, ...]  # per new K/V head: the original K/V head it copies, or None
    layer_pos: tuple[int, ...]  # per original layer: its index in the inflated stack

    @property
    def d(self) -> int:
        return self.small.hidden_size

    @property
    def D(self) -> int:
        return self.big.hidden_size

    @property
    def r(self) -> int:
        return self.big.head_dim // self.small.head_dim

    @property
    def new_eps(self) -> float:
        return self.eps * self.small.head_dim / self.big.head_dim

    @property
    def beta(self) -> float:
        return math.sqrt(self.D * self.new_eps / (self.d * self.eps))

    @property
    def const(self) -> float:
        return math.sqrt(self.d * self.eps)

    @property
    def const_channel(self) -> int:
        return 2 * self.d

    @property
    def stream_scale(self) -> float:
        """Norm-weight factor for the residual stream: sqrt(K d / D), K = 1 + beta^2."""
        return math.sqrt((1 + self.beta ** 2) * self.d / self.D)

    @property
    def ctx_beta(self) -> float:
        return math.sqrt(max(self.beta ** 2 - 1, 0.0))

    @property
    def ctx_scale(self) -> float:
        return math.sqrt(self.beta ** 2 * self.d / self.D)

    def dim_index(self) -> torch.Tensor:
        """[hd] new position of each original head dim (RoPE halves kept, frequencies matched)."""
        hd, hd2 = self.small.head_dim, self.big.head_dim
        i = torch.arange(hd // 2)
        return torch.cat([self.r * i, self.r * i + hd2 // 2])

    def layer_src(self) -> list[int | None]:
        src: list[int | None] = [None] * self.big.num_hidden_layers
        for i, p in enumerate(self.layer_pos):
            src[p] = i
        return src

    def summary(self) -> dict:
        return {"beta": self.beta, "const": self.const, "const_channel": self.const_channel, "eps": self.eps,
                "new_eps": self.new_eps, "stream_scale": self.stream_scale, "ctx_beta": self.ctx_beta,
                "q_src": list(self.q_src), "kv_src": list(self.kv_src), "layer_pos": list(self.layer_pos),
                "head_dim_factor": self.r}


def head_layout(H: int, Hkv: int, H2: int, Hkv2: int) -> tuple[tuple[int | None, ...], tuple[int | None, ...]]:
    """Place every original q head in a new group whose K/V head is a copy of its original K/V head."""
    G, G2 = H // Hkv, H2 // Hkv2
    q_src: list[int | None] = [None] * H2
    kv_src: list[int | None] = [None] * Hkv2
    nxt = 0
    for g in range(Hkv):
        for t in range(G):
            j, slot = nxt + t // G2, t % G2
            if j >= Hkv2:
                raise RetraceError(f"cannot place {H} query heads / {Hkv} K/V heads into {H2} / {Hkv2}: "
                                   f"needs {Hkv * -(-G // G2)} K/V heads")
            kv_src[j] = g
            q_src[j * G2 + slot] = g * G + t
        nxt += -(-G // G2)
    return tuple(q_src), tuple(kv_src)


def spread_layers(L: int, L2: int) -> tuple[int, ...]:
    """Original layer i sits at floor(i*(L2-1)/(L-1) + 1/2); the last stays last (a tap on the last layer is
    the final-norm output)."""
    if L == 1:
        return (L2 - 1,)
    return tuple(int(math.floor(i * (L2 - 1) / (L - 1) + 0.5)) for i in range(L))


def make_plan(small: Shape, big: Shape, eps: float) -> Plan:
    problems = []
    for k, v in small.to_dict().items():
        if getattr(big, k) < v:
            problems.append(f"{k} {getattr(big, k)} < the zoo's {v}")
    if big.head_dim % small.head_dim:
        problems.append(f"head_dim {big.head_dim} is not a multiple of the zoo's {small.head_dim}")
    if big.hidden_size < 2 * small.hidden_size + 1:
        problems.append(f"hidden_size {big.hidden_size} < 2 * {small.hidden_size} + 1 (a copy and a constant channel)")
    if big.hidden_size * small.head_dim < small.hidden_size * big.head_dim:
        problems.append(f"hidden_size grows less than head_dim ({small.hidden_size}->{big.hidden_size} vs "
                        f"{small.head_dim}->{big.head_dim}): the drafter's context norm cannot be compensated")
    if big.num_attention_heads % big.num_key_value_heads:
        problems.append(f"num_attention_heads {big.num_attention_heads} is not a multiple of num_key_value_heads "
                        f"{big.num_key_value_heads}")
    if problems:
        raise RetraceError("cannot inflate to this shape: " + "; ".join(problems))
    q_src, kv_src = head_layout(small.num_attention_heads, small.num_key_value_heads, big.num_attention_heads,
                                big.num_key_value_heads)
    return Plan(small, big, float(eps), q_src, kv_src, spread_layers(small.num_hidden_layers, big.num_hidden_layers))


# -- per weight kind --------------------------------------------------------------------------------------
def _free(shape, like: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random values for entries whose output is multiplied by zero (std of the original tensor)."""
    std = float(like.float().std()) if like.numel() > 1 else 0.02
    return torch.randn(shape, generator=g) * (std if std > 0 else 0.02)


def stream_rows(w: torch.Tensor, p: Plan, beta: float) -> torch.Tensor:
    """A matrix whose rows write stream channels [d, ...] -> [D, ...]: rows x, beta*x, zero elsewhere."""
    out = w.new_zeros((p.D, *w.shape[1:]))
    out[: p.d] = w
    out[p.d: 2 * p.d] = beta * w
    return out


def pad_cols(w: torch.Tensor, D: int) -> torch.Tensor:
    out = w.new_zeros((*w.shape[:-1], D))
    out[..., : w.shape[-1]] = w
    return out


def stream_norm(w: torch.Tensor, p: Plan, scale: float) -> torch.Tensor:
    """An RMSNorm over a stream (input/post-attention norms, hidden_norm): new channels get weight 1 (their
    outputs are read only by rows whose output is discarded)."""
    out = torch.ones(p.D, dtype=w.dtype)
    out[: p.d] = w * scale
    return out


def final_norm(w: torch.Tensor, p: Plan) -> torch.Tensor:
    """The last norm before the LM head: original channels, and the constant channel with weight 1."""
    out = torch.zeros(p.D, dtype=w.dtype)
    out[: p.d] = w * p.stream_scale
    out[p.const_channel] = 1.0
    return out


def qk_proj(w: torch.Tensor, src: tuple[int | None, ...], p: Plan, g: torch.Generator,
            zero_padded: bool) -> torch.Tensor:
    """q/k/v projection [heads*hd, d] -> [heads'*hd', D]; original heads at their new slots."""
    hd, hd2 = p.small.head_dim, p.big.head_dim
    out = _free((len(src) * hd2, p.D), w, g)
    idx = p.dim_index()
    for h2, h in enumerate(src):
        if h is None:
            continue
        block = out[h2 * hd2: (h2 + 1) * hd2]
        if zero_padded:
            block.zero_()
        block[:, : p.d] = 0
        block[idx] = pad_cols(w[h * hd: (h + 1) * hd], p.D)
    return out


def o_proj(w: torch.Tensor, p: Plan) -> torch.Tensor:
    """[d, H*hd] -> [D, H'*hd']: original heads' columns at their new dims, zero for every other column."""
    hd, hd2 = p.small.head_dim, p.big.head_dim
    cols = w.new_zeros((p.d, len(p.q_src) * hd2))
    idx = p.dim_index()
    for h2, h in enumerate(p.q_src):
        if h is not None:
            cols[:, h2 * hd2 + idx] = w[:, h * hd: (h + 1) * hd]
    return stream_rows(cols, p, p.beta)


def head_norm(w: torch.Tensor, p: Plan, scale: float) -> torch.Tensor:
    out = torch.full((p.big.head_dim,), scale, dtype=w.dtype)
    out[p.dim_index()] = w * scale
    return out


def mlp_in(w: torch.Tensor, p: Plan, inter: int, g: torch.Generator) -> torch.Tensor:
    """gate/up [I, d] -> [I', D]: original channels first, new channels random (down_proj ignores them)."""
    out = _free((inter, p.D), w, g)
    out[: w.shape[0]] = pad_cols(w, p.D)
    return out


def mlp_out(w: torch.Tensor, p: Plan, inter: int) -> torch.Tensor:
    """down [d, I] -> [D, I']: zero columns for new MLP channels."""
    return stream_rows(pad_cols(w, inter), p, p.beta)


def layer(sd: dict[str, torch.Tensor], p: Plan, inter: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """One original decoder layer's tensors (names relative to the layer) at the new shape."""
    r = math.sqrt(1 / p.r)
    return {
        "self_attn.q_proj.weight": qk_proj(sd["self_attn.q_proj.weight"], p.q_src, p, g, zero_padded=True),
        "self_attn.k_proj.weight": qk_proj(sd["self_attn.k_proj.weight"], p.kv_src, p, g, zero_padded=True),
        "self_attn.v_proj.weight": qk_proj(sd["self_attn.v_proj.weight"], p.kv_src, p, g, zero_padded=False),
        "self_attn.o_proj.weight": o_proj(sd["self_attn.o_proj.weight"], p),
        "self_attn.q_norm.weight": head_norm(sd["self_attn.q_norm.weight"], p, 1.0),
        "self_attn.k_norm.weight": head_norm(sd["self_attn.k_norm.weight"], p, r),
        "mlp.gate_proj.weight": mlp_in(sd["mlp.gate_proj.weight"], p, inter, g),
        "mlp.up_proj.weight": mlp_in(sd["mlp.up_proj.weight"], p, inter, g),
        "mlp.down_proj.weight": mlp_out(sd["mlp.down_proj.weight"], p, inter),
        "input_layernorm.weight": stream_norm(sd["input_layernorm.weight"], p, p.stream_scale),
        "post_attention_layernorm.weight": stream_norm(sd["post_attention_layernorm.weight"], p, p.stream_scale),
    }


def identity_layer(like: dict[str, torch.Tensor], p: Plan, inter: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A new layer: random weights with zero o_proj and down_proj, so it adds exactly zero to the stream."""
    b = p.big
    shapes = {
        "self_attn.q_proj.weight": (b.num_attention_heads * b.head_dim, p.D),
        "self_attn.k_proj.weight": (b.num_key_value_heads * b.head_dim, p.D),
        "self_attn.v_proj.weight": (b.num_key_value_heads * b.head_dim, p.D),
        "mlp.gate_proj.weight": (inter, p.D),
        "mlp.up_proj.weight": (inter, p.D),
    }
    out = {k: _free(s, like[k], g) for k, s in shapes.items()}
    out["self_attn.o_proj.weight"] = torch.zeros(p.D, b.num_attention_heads * b.head_dim)
    out["mlp.down_proj.weight"] = torch.zeros(p.D, inter)
    out["self_attn.q_norm.weight"] = torch.ones(b.head_dim)
    out["self_attn.k_norm.weight"] = torch.ones(b.head_dim)
    out["input_layernorm.weight"] = torch.ones(p.D)
    out["post_attention_layernorm.weight"] = torch.ones(p.D)
    return out


def embedding(w: torch.Tensor, p: Plan) -> torch.Tensor:
    """[V, d] -> [V', D]: rows [e, beta*e, c, 0]; padded ids [0, 0, c, 0] (never fed)."""
    out = w.new_zeros((p.big.vocab_size, p.D))
    out[: w.shape[0]] = stream_rows(w.T, p, p.beta).T
    out[:, p.const_channel] = p.const
    return out


def lm_head(w: torch.Tensor, p: Plan, pad_scale: float) -> torch.Tensor:
    """[V, d] -> [V', D]: real rows read the original channels only; padded rows read -pad_scale * const."""
    out = w.new_zeros((p.big.vocab_size, p.D))
    out[: w.shape[0], : p.d] = w
    out[w.shape[0]:, p.const_channel] = -pad_scale
    return out


def target(sd: dict[str, torch.Tensor], p: Plan, pad_scale: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """A Qwen3ForCausalLM state dict (untied) at the new shape."""
    g = torch.Generator().manual_seed(seed)
    out = {"model.embed_tokens.weight": embedding(sd["model.embed_tokens.weight"], p),
           "model.norm.weight": final_norm(sd["model.norm.weight"], p),
           "lm_head.weight": lm_head(sd["lm_head.weight"], p, pad_scale)}
    first = {k[len("model.layers.0."):]: v for k, v in sd.items() if k.startswith("model.layers.0.")}
    for j, i in enumerate(p.layer_src()):
        pre = f"model.layers.{i}."
        new = (layer({k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}, p, p.big.intermediate_size, g)
               if i is not None else identity_layer(first, p, p.big.intermediate_size, g))
        out.update({f"model.layers.{j}.{k}": v for k, v in new.items()})
    return out


def drafter(sd: dict[str, torch.Tensor], p: Plan, num_taps: int, inter: int, seed: int = 1) -> dict[str, torch.Tensor]:
    """A DFlash drafter state dict: layers widened like the target's, fc reading the taps' original channels
    and writing the context stream [u, beta_ctx*u, 0]."""
    g = torch.Generator().manual_seed(seed)
    fc = sd["fc.weight"]
    cols = fc.new_zeros((p.d, num_taps * p.D))
    for t in range(num_taps):
        cols[:, t * p.D: t * p.D + p.d] = fc[:, t * p.d: (t + 1) * p.d]
    out = {"fc.weight": stream_rows(cols, p, p.ctx_beta),
           "hidden_norm.weight": stream_norm(sd["hidden_norm.weight"], p, p.ctx_scale),
           "norm.weight": final_norm(sd["norm.weight"], p)}
    n = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    for i in range(n):
        pre = f"layers.{i}."
        new = layer({k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}, p, inter, g)
        out.update({pre + k: v for k, v in new.items()})
    return out


def conditioner(sd: dict[str, torch.Tensor], p: Plan, num_features: int, seed: int = 2) -> dict[str, torch.Tensor]:
    """ReTrace conditioner state dict. refine: r = [r, 0] (its constant-channel row cancels the memory's
    constant channel, -1 on it); value_norm over the zero-padded r (its own eps is scaled by d/D, see
    `conditioner_eps`); value writes [v, beta*v, 0]; the gate's copy rows equal its original rows."""
    g = torch.Generator().manual_seed(seed)
    d, D, F = p.d, p.D, num_features
    wr = sd["refine.weight"]  # [d, 2d]
    refine = wr.new_zeros((D, 2 * D))
    refine[:d, :d] = wr[:, :d]
    refine[:d, D: D + d] = wr[:, d:]
    refine[p.const_channel, p.const_channel] = -1.0
    wg, bg = sd["gate.weight"], sd["gate.bias"]  # [d, 2d + F], [d]
    rows = wg.new_zeros((d, 2 * D + F))
    rows[:, :d] = wg[:, :d]
    rows[:, D: D + d] = wg[:, d: 2 * d]
    rows[:, 2 * D:] = wg[:, 2 * d:]
    gate = _free((D, 2 * D + F), wg, g)
    gate[: 2 * d] = torch.cat([rows, rows])
    bias = torch.full((D,), float(bg.mean()), dtype=bg.dtype)
    bias[: 2 * d] = torch.cat([bg, bg])
    return {"refine.weight": refine, "gate.weight": gate, "gate.bias": bias,
            "value_norm": stream_norm(sd["value_norm"], p, math.sqrt(d / D)),
            "value.weight": stream_rows(pad_cols(sd["value.weight"], D), p, p.beta)}


def conditioner_eps(eps: float, p: Plan) -> float:
    return eps * p.d / p.D


# the largest padded-row weight: finite in float16 (max 65504) and in the float16 block scales of llama.cpp's
# quantized types, with room for their rounding (an fp16 bundle or a GGUF of the pair holds it exactly)
PAD_SCALE_MAX = 32768.0


def pad_scale_for(p: Plan, rho_min: float, gap: float = 1000.0) -> float:
    """The LM-head weight of padded ids that puts their logit at -gap for the smallest observed final-norm
    factor rho_min = rsqrt(mean(x^2) + eps) of the small target (the constant channel arrives at the LM head
    as c * sqrt(D / (K d)) * rho >= c * sqrt(D / (K d)) * rho_min), at most PAD_SCALE_MAX (`pad_gap`: the
    gap that leaves)."""
    return min(gap / (p.const * rho_min / p.stream_scale), PAD_SCALE_MAX)


def pad_gap(p: Plan, rho_min: float, pad_scale: float) -> float:
    """How far below 0 a padded id's logit sits at the final-norm factor rho_min (`pad_scale_for`)."""
    return pad_scale * p.const * rho_min / p.stream_scale


def count(sd: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> int:
    return sum(v.numel() for k, v in sd.items() if not k.startswith(skip))


__all__ = ["Shape", "SHAPES", "NON_EMBEDDING_PARAMS", "Plan", "make_plan", "target", "drafter", "conditioner",
           "conditioner_eps", "pad_scale_for", "pad_gap", "PAD_SCALE_MAX", "count"]
