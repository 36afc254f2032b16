"""The round's argmax as one torch operator, `torch.ops.retrace.argmax(x)` (the index of the first maximal
entry along the last dimension, NaN counting as the maximum, as `x.max(-1).indices`), whose CPU kernel is
numpy's argmax over the same memory (no copy).

Why: torch's CPU max-with-indices reduction does not use the vector units, numpy's argmax does. Measured
here at one thread (torch 2.13, numpy 2.4, fp32): [8, 16, 2048] 586 us vs 41 us, [16, 151936] 4.3 ms vs
0.32 ms (docs/gpu-runtime.md). The round takes an argmax over the verify logits and over the draft logits
every round, so this was the largest single host cost of a batch-8 round on the zoo pair.
Registered with torch.library as an operator: the kernel runs below the dispatcher, so a view of a CPU
tensor's memory is not a host read of the round (there is none on CUDA, where the kernel is torch's own).
"""

from __future__ import annotations

import torch

NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)

_lib = torch.library.Library("retrace", "DEF")
_lib.define("argmax(Tensor x) -> Tensor")


def _argmax(x: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype in NUMPY_DTYPES and x.shape[-1]:
        return torch.from_numpy(x.detach().numpy().argmax(-1))
    return x.max(-1).indices  # CUDA, meta, bfloat16 (numpy has none)


_lib.impl("argmax", _argmax, "CompositeExplicitAutograd")
_lib.impl("argmax", lambda x: x.max(-1).indices, "Meta")  # shapes only (meta and fake tensors)
argmax = torch.ops.retrace.argmax.default
