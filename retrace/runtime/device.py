"""Where the runtime's tensors live: a device and a dtype by name (one clear error when CUDA is asked for
and absent), and the round's one device-to-host read (non-blocking into pinned memory on CUDA).

A backend's `device` (optional attribute, default cpu) is where the tensors it takes and returns live; the
loop builds its tensors there and keeps the round there: acceptance, sampling, the rejected-suffix memory
and the verify policy's confidences never leave it, and `read` brings back the few numbers the host needs.
"""

from __future__ import annotations

import torch

from retrace.errors import RetraceError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CPU = torch.device("cpu")


def resolve_device(device: str | torch.device | None, what: str = "--device") -> torch.device:
    """"cpu", "cuda", "cuda:N" (None: cpu; "auto": cuda when available) -> torch.device, checked."""
    if device is None:
        return CPU
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise RetraceError(f"{what} {device!r}: not a device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
            raise RetraceError(f"{what} {device}: CUDA is not available on this machine (torch {torch.__version__} "
                               f"built {built}); use {what} cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise RetraceError(f"{what} {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise RetraceError(f"{what} {device}: the runtime runs on cpu or cuda")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, what: str = "--dtype") -> torch.dtype:
    """"bfloat16" | "float16" | "float32" (or the torch dtype; None: float32) -> torch.dtype."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise RetraceError(f"{what} {dtype}: choose from {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise RetraceError(f"{what} {dtype!r}: choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


def device_of(backend) -> torch.device:
    """The device of a backend's tensors (backends that do not say: cpu)."""
    return getattr(backend, "device", CPU)


def read(t: torch.Tensor) -> list:
    """The values of a small tensor as Python lists: the round's one device-to-host read. On CUDA a
    non-blocking copy into pinned memory, then one wait for it; on the CPU `tolist` directly."""
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host.tolist()


def index_tensor(values: list, device: torch.device) -> torch.Tensor:
    """An int64 tensor on `device` built from host values, which it keeps beside it (`host_values`): the
    scheduler's metadata has a host copy, as in vLLM, so a backend can read the longest past or whether the
    slots are one range without a device-to-host read."""
    t = to_device(values, device, torch.int64)
    t.host_values = values
    return t


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor on `device` from host values. On CUDA through pinned memory with a non-blocking copy: a
    plain `torch.tensor(values, device=cuda)` copies from pageable memory and waits for the stream, so every
    one of them would stall the host until the GPU has drained (5 per plain-decoding round before this, read
    from the code after the H200 run counted 6.1 synchronisations per round)."""
    kind = (device if isinstance(device, torch.device) else torch.device(device)).type
    if isinstance(values, torch.Tensor):  # a host tensor (prompt lookup's)
        host = values.to(dtype or values.dtype)
    else:
        host = torch.tensor(values, dtype=dtype, device=CPU)
        if kind == "cpu":  # the host tensor is the tensor: no `.to` (one op fewer, 8-10 per round)
            return host
    if kind != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def host_values(t: torch.Tensor) -> list:
    """The host copy an index tensor was built from, else one read of it."""
    values = getattr(t, "host_values", None)
    return values if values is not None else read(t)
