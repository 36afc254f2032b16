"""retrace.runtime: the lossless ReTrace draft/verify loop, its backends and the embeddable API.

The names below are imported when first used (PEP 562), so a torch-free module of this package
(sampling_params, options' users on the command line) can be imported without importing torch.
"""

import importlib

_EXPORTS = {
    "Engine": "retrace.runtime.serving_engine",
    "ServingEngine": "retrace.runtime.serving_engine",
    "Runtime": "retrace.runtime.api",
    "Result": "retrace.runtime.api",
    "RuntimeOptions": "retrace.runtime.options",
    "Scheduler": "retrace.runtime.loop",
    "Request": "retrace.runtime.loop",
    "Event": "retrace.runtime.loop",
    "SamplingParams": "retrace.runtime.sampling_params",
    "MODES": "retrace.runtime.modes",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
