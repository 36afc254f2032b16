"""Section `environment`: the machine and the library versions the other sections ran with."""

from __future__ import annotations

import importlib
import os
import platform
import sys

import torch


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "?")
    except Exception as e:  # noqa: BLE001 - a missing or broken package is a finding, not a failure
        return f"unavailable ({type(e).__name__}: {str(e)[:120]})"


def collect(result: dict, device: torch.device) -> None:
    result.update({
        "python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
        "cuda_available": torch.cuda.is_available(), "device": str(device),
        "torch_threads": torch.get_num_threads(),
    })
    for m in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "onnx", "onnxruntime", "retrace"):
        result[m] = _version(m)
    import retrace

    result["retrace_path"] = os.path.dirname(retrace.__file__)
    import transformers

    result["transformers_path"] = os.path.dirname(transformers.__file__)
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        result.update({"gpu": p.name, "capability": list(torch.cuda.get_device_capability(device)),
                       "gpu_memory_gib": round(p.total_memory / 2**30, 1), "sm_count": p.multi_processor_count,
                       "bf16_supported": torch.cuda.is_bf16_supported()})
