"""Sections `ort_cuda` and `tensorrt`: the carried zoo pair's engine bundle on ONNX Runtime's CUDA
provider and on TensorRT, greedy ar / dflash / retrace against the torch backend on the same device and
dtype (TF32 off), token for token, with what ran (providers, K/V mode, TensorRT version, attention form).

Each is skipped with its reason when its runtime is absent (`ort_cuda_unavailable`, `tensorrt_unavailable`:
no onnxruntime-gpu / no tensorrt, or no CUDA device). ``--dry-run`` runs `ort_cuda` on the CPU provider
(the same IO-binding code with device "cpu") at toy sizes; `tensorrt` needs the real thing.
"""

from __future__ import annotations

from pathlib import Path

import torch

from retrace.gpucheck import decode
from retrace.gpucheck.parity import compare
from retrace.gpucheck.record import log
from retrace.runtime.modes import MODES

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def ort_cuda_unavailable(dry_run: bool) -> str | None:
    try:
        import onnxruntime
    except ImportError:
        return "onnxruntime is not installed"
    if dry_run:
        return None  # the CPU provider stands in
    avail = onnxruntime.get_available_providers()
    if "CUDAExecutionProvider" not in avail:
        return f"onnxruntime-gpu is not installed (onnxruntime {onnxruntime.__version__} offers {avail})"
    if not torch.cuda.is_available():
        return "torch has no CUDA device (the backend keeps its buffers on the GPU through torch)"
    return None


def tensorrt_unavailable() -> str | None:
    from retrace.plugins.errors import RetraceMissingDependency, require_tensorrt

    try:
        require_tensorrt("The tensorrt section")
    except RetraceMissingDependency as e:
        return str(e)
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def _build(zoo: Path, out: Path, backend: str, dtype: str, attention: str, max_batch: int, max_seq_len: int) -> Path:
    from retrace.export.build import BuildOptions, build_bundle

    opts = BuildOptions(zoo / "target", zoo / "drafter", out, backend=backend, dtype=dtype, max_batch=max_batch,
                        max_seq_len=max_seq_len, attention=attention, force=True)
    return build_bundle(opts).out


def _against_torch(result: dict, rt, zoo: Path, dtype: str, prompts: list[list[int]], max_new: int,
                   device: torch.device, modes) -> None:
    target, drafter = decode.load(zoo, TORCH_DTYPES[dtype], device)
    runs = result.setdefault("runs", {})
    for mode in modes:
        ref = decode.greedy(target, drafter, prompts, mode, len(prompts), max_new, device)
        got = decode.timed(rt, prompts, mode, max_new, device)
        runs[f"{dtype}/{mode}"] = e = {"tau": got["tau"], "tokens_per_s": got["tokens_per_s"],
                                       "torch_tokens_per_s": ref["tokens_per_s"],
                                       "vs_torch": compare(got["token_ids"], ref["token_ids"])}
        log(f"{result['engine']} {dtype} {mode}: tau {e['tau']}, {e['tokens_per_s']} tok/s (torch "
            f"{e['torch_tokens_per_s']}), vs torch {e['vs_torch']['identical']}/{e['vs_torch']['n']}")


def _run(result: dict, engine: str, make_runtime, zoo: Path, reference: Path, work: Path, device: torch.device,
         dtypes, n_prompts: int, max_new: int, backend: str, attention: str, modes=MODES) -> None:
    import json

    prompts = json.loads(Path(reference).read_text())["prompts"][:n_prompts]
    block = json.loads((zoo / "drafter" / "config.json").read_text()).get("block_size", 16)
    max_seq = max(len(p) for p in prompts) + max_new + 2 * block + 8
    result.update({"engine": engine, "device": str(device), "n_prompts": len(prompts), "max_new_tokens": max_new,
                   "attention": attention})
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for dtype in dtypes:
            bundle = _build(zoo, work / f"{engine}-{dtype}", backend, dtype, attention, len(prompts), max_seq)
            rt = make_runtime(bundle)
            result.setdefault("ran", {})[dtype] = describe(rt.backend)
            _against_torch(result, rt, zoo, dtype, prompts, max_new, device, modes)
            del rt
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    result["token_exact"] = {d: all(e["vs_torch"]["identical"] == e["vs_torch"]["n"]
                                    for k, e in result["runs"].items() if k.startswith(d + "/")) for d in dtypes}


def describe(be) -> dict:
    """What actually ran: the backend, its providers / K/V mode / device, the TensorRT version."""
    info = {"backend": be.name, "device": str(getattr(be, "device", ""))}
    if be.name == "onnxruntime":
        info.update(providers=be.active_providers, kv_mode=be.kv_mode, lm_head_session=be.head is not None)
    else:
        import tensorrt

        info["tensorrt"] = tensorrt.__version__
    return info


def run_ort_cuda(result: dict, zoo: Path, reference: Path, work: Path, device: torch.device, dry_run: bool) -> None:
    from retrace.runtime.api import Runtime

    providers = ["CPUExecutionProvider"] if dry_run else ["CUDAExecutionProvider", "CPUExecutionProvider"]
    result["providers_asked"] = providers
    # dry run: fp32, retrace only (it drives both graphs and the conditioner), 2 prompts x 8 tokens
    _run(result, "onnxruntime", lambda b: Runtime.from_bundle(b, providers=providers), zoo, reference, work,
         device, ("float32",) if dry_run else ("float32", "float16"), 2 if dry_run else 8, 8 if dry_run else 48,
         "onnxruntime", "native", ("retrace",) if dry_run else MODES)


def run_tensorrt(result: dict, zoo: Path, reference: Path, work: Path, device: torch.device) -> None:
    import tensorrt

    from retrace.export.tensorrt import NATIVE_MIN_TENSORRT
    from retrace.plugins.errors import tensorrt_version
    from retrace.runtime.api import Runtime

    attention = "native" if tensorrt_version(tensorrt) >= NATIVE_MIN_TENSORRT else "decomposed"
    result["tensorrt"] = tensorrt.__version__
    _run(result, "tensorrt", lambda b: Runtime.from_bundle(b, backend="tensorrt"), zoo, reference, work, device,
         ("float32",), 8, 48, "tensorrt", attention)
