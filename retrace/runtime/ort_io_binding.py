"""ONNX Runtime IO binding over device-resident torch memory, one code path for every execution provider.

The ONNX Runtime backend keeps its K/V caches, staging buffers and outputs in torch tensors on the device
of the session's first execution provider (`session_device`: "cuda" for the CUDA provider, "cpu" for the
CPU one) and binds each by pointer, `IOBinding.bind_input / bind_output(name, device_type, device_id,
element_type, shape, buffer_ptr)` with the tensor's own device, so ONNX Runtime reads and writes them where
they are: nothing crosses to the host per call except what the loop consumes (the logits rows it asked
for, the taps, the drafter's hidden states). On the CPU provider these are the same calls with
device_type "cpu", which is how they are tested here (tests/test_ort_io_binding.py).

Element types are passed as ONNX TensorProto integers (accepted by bind_input / bind_output alongside
numpy types), so bfloat16, which numpy lacks, binds like the rest.
"""

from __future__ import annotations

import torch
from onnx import TensorProto

from retrace.errors import RetraceError

# ONNX Runtime's type string -> (torch dtype, TensorProto element type)
ORT_TYPES: dict[str, tuple[torch.dtype, int]] = {
    "tensor(float)": (torch.float32, TensorProto.FLOAT),
    "tensor(float16)": (torch.float16, TensorProto.FLOAT16),
    "tensor(bfloat16)": (torch.bfloat16, TensorProto.BFLOAT16),
    "tensor(double)": (torch.float64, TensorProto.DOUBLE),
    "tensor(int64)": (torch.int64, TensorProto.INT64),
    "tensor(int32)": (torch.int32, TensorProto.INT32),
    "tensor(bool)": (torch.bool, TensorProto.BOOL),
}
ELEMENT_TYPE = {dt: et for dt, et in ORT_TYPES.values()}
ELEMENT_DTYPE = {et: dt for dt, et in ORT_TYPES.values()}
# execution provider -> the torch device type its buffers live on
PROVIDER_DEVICE = {"CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "cuda"}


def torch_dtype(ort_type: str) -> torch.dtype:
    try:
        return ORT_TYPES[ort_type][0]
    except KeyError:
        raise RetraceError(f"ONNX Runtime tensor type {ort_type} has no torch dtype here "
                           f"(supported: {', '.join(ORT_TYPES)})") from None


def first_provider(providers: list) -> str:
    """The name of the first execution provider (an entry may be (name, options)); CPU when none is given."""
    first = providers[0] if providers else "CPUExecutionProvider"
    return first[0] if isinstance(first, tuple) else first


def session_device(providers: list, device: str | torch.device | None = None) -> torch.device:
    """Where a session's bound buffers live: `device` when given, else the first provider's device. Buffers
    on the GPU are torch CUDA tensors: without a CUDA build of torch the default falls back to host memory
    (ONNX Runtime then copies them per call, as before device buffers), and device="cuda" is one clear
    error."""
    if device is not None:
        dev = torch.device(device)
    else:
        dev = torch.device(PROVIDER_DEVICE.get(first_provider(providers), "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            dev = torch.device("cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RetraceError("the CUDA execution provider keeps the K/V caches and outputs on the GPU through torch, "
                           "but torch.cuda.is_available() is False (a CPU build of torch?): install a CUDA torch, or "
                           "pass device='cpu' to keep them in host memory (ONNX Runtime then copies them per call)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _where(t: torch.Tensor) -> tuple[str, int]:
    return t.device.type, t.device.index or 0


def bind_input(binding, name: str, t: torch.Tensor) -> None:
    """Bind a dense tensor as input `name` where it lives (no copy)."""
    if not t.is_contiguous():
        raise RetraceError(f"input {name}: IO binding needs a dense tensor")
    binding.bind_input(name, *_where(t), ELEMENT_TYPE[t.dtype], tuple(t.shape), t.data_ptr())


def bind_output(binding, name: str, t: torch.Tensor) -> None:
    """Bind a preallocated dense tensor as output `name`: ONNX Runtime writes into it where it lives."""
    if not t.is_contiguous():
        raise RetraceError(f"output {name}: IO binding needs a dense tensor")
    binding.bind_output(name, *_where(t), ELEMENT_TYPE[t.dtype], tuple(t.shape), t.data_ptr())


def run_bound(sess, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
    """One run with every input and output bound by pointer. Feeds must already be dense and on a device
    the session accepts (ONNX Runtime copies a host input a device kernel needs, e.g. a shape scalar)."""
    cuda = next((t.device for t in (*feeds.values(), *outputs.values()) if t.device.type == "cuda"), None)
    if cuda is not None:  # the gathers / uploads torch queued on its stream finish before ONNX Runtime's reads
        torch.cuda.current_stream(cuda).synchronize()
    b = sess.io_binding()
    for name, t in feeds.items():
        bind_input(b, name, t)
    for name, t in outputs.items():
        bind_output(b, name, t)
    sess.run_with_iobinding(b)  # returns after the providers synchronised (RunOptions default)
