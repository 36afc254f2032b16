"""OpenAI Triton kernels for GatedSuffixFusion (see `gated_suffix_fusion.py` for the maths).

Two launches, by design:

1. `refine`:  R = m + W_c [m ; c]                          -> fp32 scratch [M, d]
2. `fuse`:    out = x + valid * sigmoid(W_g [x ; R ; f] + b) * rstd(R) * W_v (w * R)

Each program of both kernels owns a (BLOCK_M rows x BLOCK_N output channels) tile and streams the
weights once per row tile along K. The op is weight-bandwidth bound (M = N*B rows is small, the
weights are 5 d^2), so the grid must spread over output channels to use the whole GPU. But every
output channel of the gate and of the value needs ALL of R, a grid-wide dependency: one launch
would have to recompute R per output tile (d/BLOCK_N times the refine GEMM) or sync the grid. Two
launches cost one extra launch and an fp32 [M, d] round trip (tiny next to the weights).

RMSNorm needs the whole row of R; rather than a separate row-statistics pass, the `fuse` kernel
accumulates sum(R^2) in the same K loop that streams R for the gate GEMM, and applies rstd after
the value GEMM: W_v (w * R * rstd) == rstd * W_v (w * R) row by row. Slots with valid == 0 store x
unchanged (a select, not a multiply by 0, so stale or non-finite memory cannot leak into x).

Dots take their operands in the input dtype (fp16/bf16 tensor cores, fp32 accumulation), or in
fp32 for fp32 inputs ("ieee": no TF32) and for bf16 under TRITON_INTERPRET=1, where bf16 tl.dot
returns garbage. Both kernels take their arguments as (input pointers..., int32 scalars...,
output pointers...) and all shape scalars are int32: that is the launch convention of TensorRT's
AOT plugins, so `tensorrt_plugin.py` compiles these very kernels with `triton.compile`.

`triton` is imported only when a kernel is needed, so this module imports without it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

STAGES = ("refine", "fuse")


@dataclass(frozen=True)
class Tile:
    """One launch configuration; `tactic` is the id TensorRT's autotuner sees (> 0)."""

    tactic: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2

    def constexprs(self) -> dict[str, int]:
        return {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "BLOCK_K": self.block_k}


# Rows are few (N * B), weights many: small BLOCK_M, wide N/K tiles. tl.dot on a GPU needs every
# tile dim >= 16. Each tile keeps both kernels within 48 KiB of shared memory for fp32 and fp16
# (measured with triton 3.9 for sm_80/sm_90: 30, 36, 36, 48 KiB for the fp32 `fuse` kernel), the
# limit a launch may use without opting in to more, which TensorRT's AOT launcher is not known to
# do. The first entry is the default of the PyTorch wrapper.
SHARED_MEM_LIMIT = 48 * 1024
TILES: tuple[Tile, ...] = (
    Tile(1, 16, 64, 32, 4, 2),
    Tile(2, 16, 32, 64, 4, 2),
    Tile(3, 32, 64, 32, 4, 2),
    Tile(4, 64, 64, 32, 4, 2),
)
DEFAULT_TILE = TILES[0]
TILE_BY_TACTIC = {t.tactic: t for t in TILES}

# Runtime (non-constexpr) arguments of each kernel, in launch order: inputs, int32 scalars, outputs.
KERNEL_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "refine": (("memory", "correction", "w_refine"), ("n_rows", "d"), ("refined",)),
    "fuse": (
        ("x", "refined", "features", "valid", "w_gate", "b_gate", "norm_weight", "w_value"),
        ("n_rows", "d", "n_feat"),
        ("out",),
    ),
}
KERNEL_NAMES = {"refine": "gsf_refine_kernel", "fuse": "gsf_fuse_kernel"}
CONSTEXPRS = {"refine": ("BLOCK_M", "BLOCK_N", "BLOCK_K", "DOT_DTYPE"),
              "fuse": ("EPS", "BLOCK_M", "BLOCK_N", "BLOCK_K", "DOT_DTYPE")}

_TRITON_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def triton_type(dtype: torch.dtype) -> str:
    try:
        return _TRITON_DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"GatedSuffixFusion kernel supports fp32/fp16/bf16, not {dtype}") from None


def kernel_signature(stage: str, dtype: torch.dtype, overrides: dict[str, torch.dtype] | None = None) -> dict[str, str]:
    """Triton `ASTSource` signature of a stage for activations/weights of `dtype`; `overrides` gives other
    dtypes for single tensors (e.g. {"valid": torch.float32} in an fp16 graph; the kernels upcast every
    load). The refined scratch is always fp32. Constexprs are listed as "constexpr" (triton >= 3.2)."""
    inputs, scalars, outputs = KERNEL_ARGS[stage]
    types = {name: triton_type(dtype) for name in inputs + outputs}
    types.update({name: triton_type(dt) for name, dt in (overrides or {}).items() if name in types})
    types["refined"] = "fp32"
    sig = {f"{n}_ptr": f"*{types[n]}" for n in inputs}
    sig.update({n: "i32" for n in scalars})
    sig.update({f"{n}_ptr": f"*{types[n]}" for n in outputs})
    sig.update({c: "constexpr" for c in CONSTEXPRS[stage]})
    return sig


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_dtype(dtype: torch.dtype, interpret: bool | None = None):
    """The dtype tl.dot operands are cast to (a `triton.language` dtype)."""
    import triton.language as tl

    if interpret is None:
        interpret = interpreting()
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.bfloat16 and not interpret:
        return tl.bfloat16
    return tl.float32


def stage_constexprs(stage: str, dtype: torch.dtype, tile: Tile, eps: float,
                     interpret: bool | None = None) -> dict:
    c = dict(tile.constexprs(), DOT_DTYPE=dot_dtype(dtype, interpret))
    if stage == "fuse":
        c["EPS"] = float(eps)
    return c


@functools.cache
def kernels():
    """The two `@triton.jit` kernels (imports triton on first use)."""
    from . import _triton_kernels

    return {"refine": _triton_kernels.gsf_refine_kernel, "fuse": _triton_kernels.gsf_fuse_kernel}


def launch_grid(n_rows, d, tile: Tile, cdiv=lambda a, b: -(-a // b)):
    """(grid_x, grid_y) of both kernels: row tiles x output-channel tiles. `cdiv` may be symbolic
    (tensorrt.plugin.cdiv)."""
    return cdiv(n_rows, tile.block_m), cdiv(d, tile.block_n)


def run_gated_suffix_fusion(x, memory, correction, features, valid, w_refine, w_gate, b_gate,
                            norm_weight, w_value, eps: float = 1e-6, tile: Tile = DEFAULT_TILE) -> torch.Tensor:
    """Launch both kernels. Shapes as the reference: x/memory/correction [..., d], features [..., F],
    valid [...]; weights w_refine [d, 2d], w_gate [d, 2d+F], b_gate [d], norm_weight [d], w_value [d, d]."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    n_feat = features.shape[-1]
    if memory.shape != x.shape or correction.shape != x.shape:
        raise ValueError(f"memory {tuple(memory.shape)} / correction {tuple(correction.shape)} must match "
                         f"x {tuple(x.shape)}")
    if features.shape[:-1] != lead or valid.shape != lead:
        raise ValueError(f"features {tuple(features.shape)} / valid {tuple(valid.shape)} must match x's "
                         f"leading dims {tuple(lead)}")
    expect = {"w_refine": (d, 2 * d), "w_gate": (d, 2 * d + n_feat), "b_gate": (d,),
              "norm_weight": (d,), "w_value": (d, d)}
    for name, t in zip(expect, (w_refine, w_gate, b_gate, norm_weight, w_value), strict=True):
        if tuple(t.shape) != expect[name]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {expect[name]}")
    triton_type(x.dtype)
    n_rows = x.numel() // d if d else 0
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if n_rows == 0 or d == 0:
        return out.copy_(x)
    if not valid.is_floating_point():
        valid = valid.to(x.dtype)

    def flat(t, cols):
        return t.reshape(n_rows, cols).contiguous()

    x2, m2, c2 = flat(x, d), flat(memory, d), flat(correction, d)
    f2 = flat(features, n_feat)
    v1 = valid.reshape(n_rows).contiguous()
    refined = torch.empty((n_rows, d), dtype=torch.float32, device=x.device)
    k = kernels()
    grid = launch_grid(n_rows, d, tile)
    opts = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
    k["refine"][grid](m2, c2, w_refine.contiguous(), n_rows, d, refined,
                      **stage_constexprs("refine", x.dtype, tile, eps), **opts)
    k["fuse"][grid](x2, refined, f2, v1, w_gate.contiguous(), b_gate.contiguous(),
                    norm_weight.contiguous(), w_value.contiguous(), n_rows, d, n_feat, out.view(n_rows, d),
                    **stage_constexprs("fuse", x.dtype, tile, eps), **opts)
    return out


def gated_suffix_fusion_triton(
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
    """Same signature and result as `gated_suffix_fusion_reference`, computed by the Triton kernels."""
    return run_gated_suffix_fusion(x, memory, correction, features, valid, w_refine, w_gate, b_gate,
                                   norm_weight, w_value, eps)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compilation (used by the TensorRT AOT plugin; runs on any machine with triton,
# GPU or not, given an explicit target such as GPUTarget("cuda", 90, 32)).


@dataclass(frozen=True)
class CompiledStage:
    stage: str
    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    tile: Tile
    n_params: int  # .param entries of the PTX entry (runtime args + Triton's trailing scratch pointers)


def compile_stage(stage: str, dtype: torch.dtype, tile: Tile, eps: float = 1e-6, target=None,
                  overrides: dict[str, torch.dtype] | None = None) -> CompiledStage:
    """`triton.compile` one stage to PTX. `target=None` means the current GPU."""
    import triton

    src = triton.compiler.ASTSource(
        fn=kernels()[stage],
        signature=kernel_signature(stage, dtype, overrides),
        constexprs=stage_constexprs(stage, dtype, tile, eps, interpret=False),
    )
    compiled = triton.compile(src, target=target,
                              options={"num_warps": tile.num_warps, "num_stages": tile.num_stages,
                                       "enable_fp_fusion": True})
    md = compiled.metadata
    # TensorRT launches AOT kernels with (inputs, extra int32 args, outputs) and passes null for any
    # parameter it does not know (Triton appends global/profile scratch pointers). That is only sound
    # while the kernel uses no scratch, one CTA per program and no special launch mode.
    problems = []
    for field, ok in (("global_scratch_size", 0), ("profile_scratch_size", 0), ("num_ctas", 1),
                      ("launch_cooperative_grid", False), ("launch_pdl", False), ("tmem_size", 0)):
        value = getattr(md, field, ok)
        if value != ok:
            problems.append(f"{field}={value!r}")
    if md.shared > SHARED_MEM_LIMIT:
        problems.append(f"shared={md.shared} > {SHARED_MEM_LIMIT}")
    if problems:
        raise RuntimeError(f"{KERNEL_NAMES[stage]} compiled for {target} needs launch features a TensorRT AOT "
                           f"plugin cannot provide: {', '.join(problems)}")
    ptx = compiled.asm["ptx"]
    entry = ptx[ptx.index(".entry"):]
    n_params = entry[: entry.index(")")].count(".param")
    return CompiledStage(stage, md.name, ptx, md.num_warps, md.shared, tile, n_params)
