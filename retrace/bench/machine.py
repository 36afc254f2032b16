"""The machine a benchmark ran on, as recorded in its results (`machine_info`), and the threads it defaults to."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(mod: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(mod)
    except metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict:
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": default_threads(),
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("retrace", "torch", "transformers", "onnxruntime",
                                              "onnxruntime-genai", "numpy", "tokenizers")},
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "env_note": "the bench process's own; each system's is systems[].env",
    }
