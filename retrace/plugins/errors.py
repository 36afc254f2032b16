"""The missing-dependency error of the TensorRT paths (plugins, engine build, runtime backend).

`RetraceMissingDependency` is a `retrace.errors.MissingDependencyError` (so the CLIs print it as one
line, no traceback) and an `ImportError` (so `except ImportError` fallbacks keep working). Its message
is complete on its own: what is missing, the command that installs it, the machine it needs.
"""

from __future__ import annotations

import importlib

from retrace.errors import MissingDependencyError


class RetraceMissingDependency(MissingDependencyError, ImportError):
    """An optional dependency is missing; the message says what to install and where."""

    def __init__(self, feature: str, package: str, install: str, machine: str | None = None,
                 detail: str | None = None):
        self.feature = feature
        self.package = package
        self.install = install
        self.machine = machine
        msg = f"{feature} needs the Python package '{package}', which is not usable here. Install it with: {install}"
        if machine:
            msg += f" (on {machine})"
        msg += "."
        if detail:
            msg += f" {detail}"
        super().__init__(msg, name=package)


TENSORRT_MACHINE = "a Linux machine with an NVIDIA GPU and a CUDA driver"


def require_tensorrt(feature: str):
    """Import and return `tensorrt`, or raise one clear RetraceMissingDependency."""
    try:
        trt = importlib.import_module("tensorrt")
        # The PyPI name resolves to a stub on machines without NVIDIA's index: it imports but has no API.
        trt.Builder  # noqa: B018
    except Exception as err:  # ImportError, or the stub's AttributeError / its own RuntimeError
        raise RetraceMissingDependency(
            feature, "tensorrt", "pip install tensorrt", TENSORRT_MACHINE,
            f"({type(err).__name__}: {err})",
        ) from None
    return trt


def tensorrt_version(trt) -> tuple[int, int]:
    """(major, minor) of an imported `tensorrt` ((0, 0) when it does not say)."""
    parts = str(getattr(trt, "__version__", "0.0")).split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return 0, 0


def tensorrt_too_old(feature: str, minimum: tuple[int, int], found: str, detail: str = "") -> RetraceMissingDependency:
    need = ".".join(map(str, minimum))
    return RetraceMissingDependency(feature, f"tensorrt>={need}", f"pip install 'tensorrt>={need}'", TENSORRT_MACHINE,
                                    f"(found tensorrt {found}{' ' + detail if detail else ''})")


def require_version(trt, minimum: tuple[int, int], feature: str) -> None:
    """Raise one clear RetraceMissingDependency when the imported tensorrt is older than `minimum`."""
    if tensorrt_version(trt) < minimum:
        raise tensorrt_too_old(feature, minimum, getattr(trt, "__version__", "?"))
