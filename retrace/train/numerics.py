"""Portable CPU numerics: the zoo as deterministic as torch allows, on any x86-64 CPU with AVX2.

Where a CPU build's floating-point results depend on the machine, and what pins each source:
- MKL, torch's BLAS on x86, picks its kernels per CPU (AVX-512 paths on a Xeon, others on an EPYC), and
  a GEMM's summation order follows the kernel -> ``MKL_CBWR=AVX2,STRICT`` (MKL's Conditional Numerical
  Reproducibility: the AVX2 code path on every CPU; STRICT makes GEMM results independent of the
  thread count).
- ATen's vectorised kernels (softmax, norms, reductions, attention) are dispatched per CPU capability
  -> ``ATEN_CPU_CAPABILITY=avx2`` (torch.compile's C++ code generation reads it too).
- bf16 autocast runs through oneDNN, whose kernels differ per CPU (AMX on recent Xeons, AVX512-BF16 on
  EPYCs) -> the zoo trains in fp32.
- torch.compile builds code with the machine's C++ compiler -> the zoo trains eagerly.
- nondeterministic torch algorithms -> ``torch.use_deterministic_algorithms(True)`` during the build.
Both environment variables are read when the libraries initialise, so `retrace zoo tiny` runs the build in
a child interpreter with them set (:func:`run_portable`) unless this process already has them.

What stays machine dependent: the Python standard library the corpus comes from (its path and version
are in the zoo key), and libraries of other versions (also in the key).
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Iterator

PORTABLE_ENV = {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2"}


def mode() -> str:
    """"portable" when this process runs with PORTABLE_ENV and torch took it (ATen on its AVX2 kernels),
    else "native". Part of every zoo key."""
    if not all(os.environ.get(k) == v for k, v in PORTABLE_ENV.items()):
        return "native"
    import torch

    return "portable" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "native"


def run_portable(args: list[str]) -> tuple[int, str]:
    """Run `python -m retrace ARGS` with PORTABLE_ENV -> (exit code, its stdout). stderr (progress,
    errors) goes straight through; SIGINT/SIGTERM are passed on, so the child cleans up its staging."""
    child = subprocess.Popen([sys.executable, "-m", "retrace", *args], env=dict(os.environ, **PORTABLE_ENV),
                             stdout=subprocess.PIPE, text=True)

    def forward(signum, _frame):
        child.send_signal(signum)

    old = signal.signal(signal.SIGTERM, forward) if _main_thread() else None
    try:
        while True:
            try:
                out, _ = child.communicate()
                # a child that died of a signal (Python re-raises an interrupt that arrives while it finalizes
                # a half-done import as the signal itself) exits like a shell reports it: 128 + the signal
                return (128 - child.returncode if child.returncode < 0 else child.returncode), out
            except KeyboardInterrupt:
                child.send_signal(signal.SIGINT)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict:
    """What the manifest records about the numerics of a build."""
    import torch

    return {"mode": mode(), "env": {k: os.environ.get(k) for k in PORTABLE_ENV}, "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch.use_deterministic_algorithms(True) for the duration (restored afterwards)."""
    import torch

    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old)
