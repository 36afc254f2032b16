"""GatedSuffixFusion as TensorRT "quickly deployable plugins" (`tensorrt.plugin`, TensorRT >= 10.9).

Written against the documented `tensorrt.plugin` API; TensorRT cannot be installed on the machines
this project is developed on, so nothing here has run inside TensorRT. Everything TensorRT-free is
tested: the tactic table, the type combinations, the launch grid, the Triton signatures, and the AOT
compilation of both kernels to PTX (tests/test_plugin_tensorrt.py).

Three plugins, namespace "retrace", version "1":

* `retrace::GatedSuffixFusion` - the whole op, exactly the ONNX node (10 inputs, attribute
  `epsilon`, output like x). JIT implementation only (`@trtp.impl`): it launches the Triton kernels
  from Python on TensorRT's stream, so the engine needs this Python process at run time.
* `retrace::GatedSuffixRefine` (memory, correction, w_refine -> fp32 refined) and
  `retrace::GatedSuffixFuse` (x, refined, features, valid, w_gate, b_gate, norm_weight, w_value,
  `epsilon` -> out) - the two Triton kernels as AOT plugins (`@trtp.aot_impl`: PTX compiled by
  `triton.compile` at build time and embedded in the engine; no Python at run time). An AOT plugin
  is exactly one kernel launch, and this op is two launches (see `triton_kernel.py`: every output
  channel needs the whole refined row, a grid-wide dependency), so
  `retrace.export.tensorrt.split_fusion_nodes` rewrites each GatedSuffixFusion node into this pair
  before parsing.

`@trtp.autotune` advertises fp32, fp16 and bf16 (activations/weights in one dtype, `features` and
`valid` in any of them, the refined scratch always fp32) and one tactic per tile of `triton_kernel.TILES`; TensorRT
times them and keeps
the fastest. The parser maps a node to a plugin by op_type plus the node attributes
`plugin_namespace="retrace"`, `plugin_version="1"`, and takes the AOT implementation for `aot=1`.
"""

import functools
import os

import torch

from . import triton_kernel as tk
from .errors import RetraceMissingDependency, require_tensorrt, require_version, tensorrt_too_old
from .gated_suffix_fusion import OP_DOMAIN, OP_NAME, OP_VERSION

NAMESPACE = OP_DOMAIN
VERSION = OP_VERSION
FUSION = f"{NAMESPACE}::{OP_NAME}"
REFINE = f"{NAMESPACE}::GatedSuffixRefine"
FUSE = f"{NAMESPACE}::GatedSuffixFuse"
STAGE_OF_PLUGIN = {REFINE: "refine", FUSE: "fuse"}
# `trtp.aot_impl`, `KernelLaunchParams`, `SymIntExprs` and the parser's `aot` node attribute arrived in 10.9
MIN_TENSORRT = (10, 9)
DTYPES = ("FP32", "FP16", "BF16")  # TensorRT names, in autotune order
TORCH_DTYPE = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}
# Triton target for AOT compiles, e.g. "cuda:90" to build for sm_90 from another device; default:
# the current GPU.
TARGET_ENV = "RETRACE_TRITON_TARGET"

_registered = False


# positions of `features` and `valid` among each plugin's inputs: their dtype is free (a graph may keep
# the 0/1 mask and the features in fp32 next to fp16 activations)
FREE_DTYPE_INPUTS = {FUSION: {"features": 3, "valid": 4}, REFINE: {}, FUSE: {"features": 2, "valid": 3}}


def autotune_types(plugin: str) -> str:
    """The `AutoTuneCombination` type string: activations, weights and output share one dtype
    (dependent, '|'); `features` and `valid` take any float dtype independently ('*'); the refined
    scratch is always fp32."""
    n_inputs = {FUSION: 10, REFINE: 3, FUSE: 8}[plugin]
    io = ["|".join(DTYPES)] * (n_inputs + 1)
    for pos in FREE_DTYPE_INPUTS[plugin].values():
        io[pos] = "*".join(DTYPES)
    if plugin == REFINE:
        io[-1] = "FP32"
    elif plugin == FUSE:
        io[1] = "FP32"
    return ", ".join(io)


def tactics(plugin: str) -> list[int]:
    """Custom tactics: one per tile for the AOT plugins; none (default tactic) for the JIT one."""
    return [t.tactic for t in tk.TILES] if plugin in STAGE_OF_PLUGIN else []


def aot_target(spec: str | None = None):
    """`GPUTarget` from "cuda:<arch>" (spec or $RETRACE_TRITON_TARGET), or None for the current GPU."""
    spec = spec if spec is not None else os.environ.get(TARGET_ENV)
    if not spec:
        return None
    from triton.backends.compiler import GPUTarget

    backend, _, arch = spec.partition(":")
    return GPUTarget(backend, int(arch), 32)


@functools.cache
def compiled(stage: str, dtype_name: str, tactic: int, eps: float, target_spec: str | None,
             features_dtype: str | None = None, valid_dtype: str | None = None) -> tk.CompiledStage:
    """PTX of one (stage, dtypes, tile) combination, compiled once per process."""
    overrides = {n: TORCH_DTYPE[d] for n, d in (("features", features_dtype), ("valid", valid_dtype)) if d}
    return tk.compile_stage(stage, TORCH_DTYPE[dtype_name], tk.TILE_BY_TACTIC[tactic], eps,
                            target=aot_target(target_spec), overrides=overrides)


def _dtype_name(trt, dtype) -> str:
    names = {trt.float32: "FP32", trt.float16: "FP16", trt.bfloat16: "BF16"}
    try:
        return names[dtype]
    except KeyError:
        raise TypeError(f"GatedSuffixFusion plugins support {DTYPES}, not {dtype}") from None


def register() -> None:
    """Register the three plugins with TensorRT's plugin registry (idempotent).

    Raises RetraceMissingDependency (one clear message) when tensorrt is missing or older than
    MIN_TENSORRT, when its `tensorrt.plugin` module lacks the AOT API, or when triton is missing."""
    global _registered
    if _registered:
        return
    feature = "The TensorRT plugin of retrace::GatedSuffixFusion"
    trt = require_tensorrt(feature)
    require_version(trt, MIN_TENSORRT, feature)
    try:
        import tensorrt.plugin as trtp
    except ImportError:
        trtp = None
    if trtp is None or not all(hasattr(trtp, a) for a in ("aot_impl", "KernelLaunchParams", "SymIntExprs")):
        raise tensorrt_too_old(feature, MIN_TENSORRT, getattr(trt, "__version__", "?"),
                       "without tensorrt.plugin's aot_impl / KernelLaunchParams / SymIntExprs")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise RetraceMissingDependency(feature, "triton", "pip install triton",
                                       "a Linux machine with an NVIDIA GPU") from None
    _define(trt, trtp)
    _registered = True


def _define(trt, trtp) -> None:
    Desc = trtp.TensorDesc
    Descs = tuple[trtp.TensorDesc]
    # what TensorRT's aot_impl validation requires as the return annotation: kernel name, PTX, launch, scalars
    Aot = tuple[str | bytes, str | bytes, trtp.KernelLaunchParams, trtp.SymIntExprs]

    def n_rows_and_d(t):
        shape = t.shape_expr
        d = shape[t.ndim - 1]
        return shape.numel() // d, d

    def combos(plugin):
        return [trtp.AutoTuneCombination(autotune_types(plugin), "LINEAR", tactics(plugin) or None)]

    def aot(plugin, first, feat, valid, tactic, eps) -> Aot:
        stage = STAGE_OF_PLUGIN[plugin]
        free = (None, None) if feat is None else (_dtype_name(trt, feat.dtype), _dtype_name(trt, valid.dtype))
        k = compiled(stage, _dtype_name(trt, first.dtype), int(tactic), float(eps), os.environ.get(TARGET_ENV),
                     *free)
        n_rows, d = n_rows_and_d(first)
        gx, gy = tk.launch_grid(n_rows, d, k.tile, trtp.cdiv)
        launch = trtp.KernelLaunchParams()
        launch.grid_x = gx
        launch.grid_y = gy
        launch.block_x = k.num_warps * 32
        launch.shared_mem = k.shared_mem
        scalars = [n_rows, d] if stage == "refine" else [n_rows, d, feat.shape_expr[feat.ndim - 1]]
        extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(s) for s in scalars])
        return k.name, k.ptx, launch, extra

    # --- the whole op (JIT) ---
    @trtp.register(FUSION)
    def fusion_desc(x: Desc, memory: Desc, correction: Desc, features: Desc, valid: Desc, w_refine: Desc,
                    w_gate: Desc, b_gate: Desc, norm_weight: Desc, w_value: Desc, epsilon: float) -> Desc:
        return x.like()

    @trtp.autotune(FUSION)
    def fusion_autotune(x, memory, correction, features, valid, w_refine, w_gate, b_gate, norm_weight,
                        w_value, outputs):
        return combos(FUSION)

    @trtp.impl(FUSION)
    def fusion_impl(x, memory, correction, features, valid, w_refine, w_gate, b_gate, norm_weight, w_value,
                    epsilon: float, outputs, stream: int) -> None:
        tensors = [torch.as_tensor(t, device="cuda") for t in
                   (x, memory, correction, features, valid, w_refine, w_gate, b_gate, norm_weight, w_value)]
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            out = torch.as_tensor(outputs[0], device="cuda")
            out.copy_(tk.run_gated_suffix_fusion(*tensors, eps=float(epsilon)))

    # --- stage 1: refine (AOT) ---
    @trtp.register(REFINE)
    def refine_desc(memory: Desc, correction: Desc, w_refine: Desc) -> Desc:
        return trtp.from_shape_expr(memory.shape_expr, dtype=trt.float32)

    @trtp.autotune(REFINE)
    def refine_autotune(memory, correction, w_refine, outputs):
        return combos(REFINE)

    @trtp.aot_impl(REFINE)
    def refine_aot(memory: Desc, correction: Desc, w_refine: Desc, outputs: Descs, tactic: int) -> Aot:
        return aot(REFINE, memory, None, None, tactic, 0.0)

    # --- stage 2: gate / RMSNorm / value / residual (AOT) ---
    @trtp.register(FUSE)
    def fuse_desc(x: Desc, refined: Desc, features: Desc, valid: Desc, w_gate: Desc, b_gate: Desc,
                  norm_weight: Desc, w_value: Desc, epsilon: float) -> Desc:
        return x.like()

    @trtp.autotune(FUSE)
    def fuse_autotune(x, refined, features, valid, w_gate, b_gate, norm_weight, w_value, outputs):
        return combos(FUSE)

    @trtp.aot_impl(FUSE)
    def fuse_aot(x: Desc, refined: Desc, features: Desc, valid: Desc, w_gate: Desc, b_gate: Desc,
                 norm_weight: Desc, w_value: Desc, epsilon: float, outputs: Descs, tactic: int) -> Aot:
        return aot(FUSE, x, features, valid, tactic, epsilon)
