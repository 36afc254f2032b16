"""The TensorRT backend: the plans of `retrace.export.tensorrt` run through TensorRT's Python API.

Written against the documented TensorRT 10 API (IExecutionContext.set_input_shape /
set_tensor_address / execute_async_v3 with torch CUDA tensors as buffers); TensorRT cannot be
installed on the machines this project is developed on, so this file has not run against a real
engine. What is tested without it (tests/test_tensorrt_backend.py, with a stand-in engine that
computes on the bound CPU memory): the profile choice, the bindings, the caches, the order of the
stream work, and the one clear error when tensorrt (or a CUDA GPU) is missing.

TensorRT engine directory (default `<bundle>/tensorrt`): `target.plan`, `drafter.plan`, `tensorrt.json`
(profiles, I/O names, limits). K/V caches are preallocated on the GPU per slot, [max_batch, Hkv,
max_seq_len, hd] per layer, indexed by absolute position (docs/INTERFACES.md). A call with a past on
a contiguous slot range binds those slots' whole caches as the past (`bound_past`: P = max_seq_len,
views, so nothing is copied; the graph masks entries at or beyond each row's past_len); scattered
slots gather their first max(past_len) positions; a prefill binds an empty past (P = 0). The K/V of
the new tokens land in reusable output buffers and are written at their positions. Every device
operation of a call (input uploads, the run, the cache write, the downloads) is issued on the
backend's one CUDA stream, so TensorRT never reads a feed that another stream is still writing.
Tensors cross the interface on the CPU, as the Backend protocol says.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

from retrace.engines.bundle import Bundle
from retrace.errors import RetraceError
from retrace.models.config import DrafterConfig, Qwen3Config
from retrace.plugins.errors import RetraceMissingDependency, require_tensorrt
from retrace.runtime.backend import contiguous_range
from retrace.runtime.bundle_configs import bundle_configs
from retrace.runtime.torch_backend import KVCache

ENGINE_SUBDIR = "tensorrt"
ENGINE_MANIFEST = "tensorrt.json"
GPU_MACHINE = "a Linux machine with an NVIDIA GPU and a CUDA driver"


def bound_past(max_past: int, max_seq_len: int, contiguous: bool = True) -> int:
    """The past length P a call binds: 0 for a prefill; the whole cache for a contiguous slot range (views,
    no prefix copy); the longest past for scattered slots (those are gathered: only what is read)."""
    return 0 if max_past == 0 else max_seq_len if contiguous else max_past


def pick_profile(profile_shapes: list[dict[str, list]], shapes: dict[str, tuple[int, ...]]) -> int:
    """Index of the optimisation profile for a call: among those whose (min, max) ranges hold every
    input shape, the one whose opt shapes are nearest (a decode call fits "verify" too, but "decode" is
    tuned for it)."""
    best, best_dist = -1, None
    for index, table in enumerate(profile_shapes):
        dist = 0
        for name, shape in shapes.items():
            lo, opt, hi = table[name]
            if len(shape) != len(lo) or any(not a <= s <= b for s, a, b in zip(shape, lo, hi, strict=True)):
                dist = None
                break
            dist += sum(abs(s - o) for s, o in zip(shape, opt, strict=True))
        if dist is not None and (best_dist is None or dist < best_dist):
            best, best_dist = index, dist
    if best >= 0:
        return best
    desc = ", ".join(f"{n}={tuple(s)}" for n, s in shapes.items())
    raise RetraceError(f"no TensorRT optimisation profile fits the call ({desc}); rebuild the engines with larger "
                       "limits (retrace-export build --max-batch/--max-seq-len/--max-prompt-len)")


def _torch_dtype(trt, dtype) -> torch.dtype:
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.int8: torch.int8, trt.bool: torch.bool}
    return table[dtype]


class _TensorRTEngine:
    """One deserialized plan with its execution context and its profile table."""

    def __init__(self, trt, runtime, plan: Path, info: dict, profiles: list[str], device: torch.device):
        self.trt = trt
        self.engine = runtime.deserialize_cuda_engine(plan.read_bytes())
        if self.engine is None:
            raise RetraceError(f"{plan}: TensorRT could not deserialize the plan (built by another TensorRT "
                               "version or for another GPU? rebuild it here)")
        self.context = self.engine.create_execution_context()
        self.device = device
        self.inputs: list[str] = list(info["inputs"])
        self.outputs: list[str] = list(info["outputs"])
        self.output_table: dict[str, str] = info["output_table"]
        self.profile_shapes = [info["shapes"][p] for p in profiles]
        self.profile = -1
        self.dtypes = {n: _torch_dtype(trt, self.engine.get_tensor_dtype(n)) for n in self.inputs + self.outputs}
        self._out: dict[str, torch.Tensor] = {}  # reusable output storage, grown geometrically

    def _output(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        need = math.prod(shape)
        buf = self._out.get(name)
        if buf is None or buf.numel() < need:
            buf = torch.empty(max(need, 2 * (buf.numel() if buf is not None else 0)), dtype=self.dtypes[name],
                              device=self.device)
            self._out[name] = buf
        return buf[:need].view(shape)

    def layers(self) -> int:
        return sum(1 for n in self.inputs if n.startswith("past_key_"))

    def run(self, feeds: dict[str, torch.Tensor], stream: torch.cuda.Stream | None) -> dict[str, torch.Tensor]:
        """One execution on `stream` (the caller issues every other device op of the call on it too). The
        outputs are views of reusable buffers: valid until the next run."""
        feeds = {n: t.to(self.device, self.dtypes[n]).contiguous() for n, t in feeds.items() if n in self.dtypes}
        missing = set(self.inputs) - set(feeds)
        if missing:
            raise RetraceError(f"TensorRT engine inputs not provided: {sorted(missing)}")
        profile = pick_profile(self.profile_shapes, {n: tuple(t.shape) for n, t in feeds.items()})
        ctx = self.context
        handle = stream.cuda_stream if stream is not None else 0
        if profile != self.profile:
            ctx.set_optimization_profile_async(profile, handle)
            self.profile = profile
        for name in self.inputs:
            t = feeds[name]
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        results = {}
        for name in self.outputs:
            results[name] = self._output(name, tuple(ctx.get_tensor_shape(name)))
            ctx.set_tensor_address(name, results[name].data_ptr())
        if not ctx.execute_async_v3(handle):
            raise RetraceError("TensorRT execution failed (see the TensorRT log)")
        return results

    def kv_names(self, role: str) -> list[str]:
        template = self.output_table[role]
        return [template.format(i=i) for i in range(self.layers())]


class _DeviceKVCache(KVCache):
    """The torch backend's per-slot K/V cache (same `past`/`write`), allocated on the engine's device."""

    def __init__(self, layers: int, slots: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        shape = (slots, kv_heads, length, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def feeds(self, slots: torch.Tensor, length: int) -> dict[str, torch.Tensor]:
        """past_key_{i} / past_value_{i}: [N, Hkv, length, hd] (length 0 or the whole cache: for a contiguous
        slot range these are views of the caches, dense as TensorRT needs, so no copy)."""
        pk, pv = self.past(slots, length)
        return {**{f"past_key_{i}": k for i, k in enumerate(pk)}, **{f"past_value_{i}": v for i, v in enumerate(pv)}}


class TensorRTBackend:
    name = "tensorrt"

    def __init__(self, engine_dir: str | Path, target_config, drafter_config=None, device: str = "cuda"):
        trt = require_tensorrt("The TensorRT backend")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RetraceMissingDependency(
                "The TensorRT backend", "torch (a CUDA build)",
                "pip install torch --index-url https://download.pytorch.org/whl/cu128", GPU_MACHINE,
                "torch.cuda.is_available() is False here.")
        engine_dir = Path(engine_dir)
        manifest_path = engine_dir / ENGINE_MANIFEST
        if not manifest_path.is_file():
            raise RetraceError(f"{manifest_path}: not found; build the engines first "
                               "(retrace-export build --engine tensorrt)")
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("plugin") in ("aot", "jit"):
            try:  # AOT plans carry their PTX, the JIT plugin needs its Python definition registered
                from retrace.plugins import tensorrt_plugin

                tensorrt_plugin.register()
            except RetraceMissingDependency:
                if manifest["plugin"] == "jit":
                    raise
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.target_config = target_config
        self.drafter_config = drafter_config
        limits = manifest["limits"]
        self.max_batch = int(limits["max_batch"])
        self.max_seq_len = int(limits["max_seq_len"])
        self.block_size = int(limits["block_size"])
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        graphs = manifest["graphs"]
        self.engines = {g: _TensorRTEngine(trt, runtime, engine_dir / info["plan"], info, manifest["profiles"],
                                           self.device)
                        for g, info in graphs.items()}
        if drafter_config is not None and "drafter" not in self.engines:
            raise RetraceError(f"{engine_dir}: no drafter plan, but a drafter config was given")
        self.has_conditioner = "drafter" in self.engines and "memory" in self.engines["drafter"].inputs
        self.caches = {}
        for g, eng in self.engines.items():
            _, kv_heads, _, head_dim = eng.profile_shapes[0]["past_key_0"][0]  # static dims of [N, Hkv, P, hd]
            self.caches[g] = _DeviceKVCache(eng.layers(), self.max_batch, kv_heads, self.max_seq_len, head_dim,
                                            eng.dtypes["past_key_0"], self.device)
        if self.stream is not None:  # the caches were zeroed on the default stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def _on_stream(self):
        """The context every device op of a call runs in: the backend's stream (nothing on a CPU device)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _past_length(self, slots: torch.Tensor, past_len: torch.Tensor) -> int:
        return bound_past(int(past_len.max()), self.max_seq_len, contiguous_range(slots) is not None)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        """A float32 host copy (outputs are reused buffers; on the stream, the copy waits for the run)."""
        return t.to("cpu", torch.float32, copy=True)

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, engine_dir: str | Path | None = None, device: str = "cuda",
                    target_subdir: str = "target", drafter_subdir: str = "drafter",
                    max_batch: int | None = None, max_seq_len: int | None = None, threads: int | None = None,
                    verify: bool | None = None) -> TensorRTBackend:
        """The configs come from the bundle's manifest (`retrace-export build --backend tensorrt` writes the
        plans into BUNDLE/tensorrt; its graph directories hold only ONNX files), or, for a directory
        without a manifest, from `target_subdir` / `drafter_subdir` config.json files. The plans' profiles
        fix the limits: max_batch / max_seq_len / threads are accepted for interface compatibility with
        the other bundle backends (the CLI passes them) and otherwise ignored; verify=False skips hashing."""
        require_tensorrt("The TensorRT backend")  # before anything else: one clear message
        bundle = Path(bundle_dir)
        if (bundle / "manifest.json").is_file():
            target_config, drafter_config = bundle_configs(Bundle.open(bundle, verify_hashes=verify is not False))
        else:
            target_config = Qwen3Config.from_dir(bundle / target_subdir)
            drafter_dir = bundle / drafter_subdir
            drafter_config = DrafterConfig.from_dir(drafter_dir) if (drafter_dir / "config.json").is_file() else None
        return cls(engine_dir or bundle / ENGINE_SUBDIR, target_config, drafter_config, device)

    # -- Backend protocol ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def target(self, slots, input_ids, positions, logits_index, tree_mask=None):
        if tree_mask is not None:
            raise RetraceError("the TensorRT backend has no tree verification (use --tree-budget 0)")
        eng, cache = self.engines["target"], self.caches["target"]
        past_len = positions[:, 0]
        with self._on_stream():
            slots_d = slots.to(self.device)
            feeds = {"input_ids": input_ids, "position_ids": positions, "past_len": past_len,
                     "logits_index": logits_index,
                     **cache.feeds(slots_d, self._past_length(slots, past_len))}
            out = eng.run(feeds, self.stream)
            cache.write(slots_d, positions.to(self.device), [out[n] for n in eng.kv_names("new_key")],
                        [out[n] for n in eng.kv_names("new_value")])
            t = eng.output_table
            return self._host(out[t["logits"]]), self._host(out[t["taps"]])

    @torch.inference_mode()
    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        with self._on_stream():
            return self._draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)

    def _draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        eng, cache = self.engines["drafter"], self.caches["drafter"]
        slots_d = slots.to(self.device)
        past_len = ctx_positions[:, 0]
        feeds = {"ctx_taps": ctx_taps, "ctx_positions": ctx_positions, "block_ids": block_ids,
                 "block_positions": block_positions, "past_len": past_len,
                 **cache.feeds(slots_d, self._past_length(slots, past_len))}
        if self.has_conditioner:
            n, b = block_ids.shape
            if suffix is None:  # no memory: valid == 0 everywhere makes the fusion the identity (DFlash)
                d = self.drafter_config.hidden_size if self.drafter_config else eng.profile_shapes[0]["memory"][0][2]
                f = eng.profile_shapes[0]["features"][0][2]
                feeds.update(memory=torch.zeros(n, b, d), features=torch.zeros(n, b, f), valid=torch.zeros(n, b),
                             corr_index=torch.zeros(n, b, dtype=torch.int64))
            else:
                feeds.update(memory=suffix.memory, features=suffix.features, valid=suffix.valid,
                             corr_index=suffix.corr_index)
        out = eng.run(feeds, self.stream)
        cache.write(slots_d, ctx_positions.to(self.device), [out[n] for n in eng.kv_names("new_key")],
                    [out[n] for n in eng.kv_names("new_value")])
        t = eng.output_table
        return self._host(out[t["hidden"]]), self._host(out[t["logits"]])

    def commit_path(self, slots, src_index, dst_pos) -> None:
        raise RetraceError("the TensorRT backend has no tree verification (use --tree-budget 0)")

    def release(self, slot: int) -> None:
        pass  # positions mask stale cache rows; nothing to clear
