"""How many threads torch's own ops between a backend's forwards use (the round's argmaxes, gathers, small
index writes), where the backend says so: `loop_threads`, an optional backend attribute (default None: leave
torch's setting alone, as the torch backend needs, whose forwards are torch ops on the same pool).

The ONNX Runtime backend runs its forwards in ONNX Runtime's own thread pool; the torch ops around
them work on [N, K, V] logits and smaller tensors, which torch still splits over its pool from 32768
elements on. Each such op then wakes the other threads, which costs more than the op where the cores are
busy (measured on this machine's 2 cores at load 5: argmax over [16, 2048] fp32 38 us on one thread, 5.8 ms
on two; docs/gpu-runtime.md). One thread gives the same values: the round's reductions run along the last
dimension, one row per thread in either case.
"""

from __future__ import annotations

import torch

from retrace.runtime.device import device_of


class LoopThreads:
    """A context for one scheduler step: torch at the backend's `loop_threads` inside, its setting after."""

    def __init__(self, backend):
        self.threads = getattr(backend, "loop_threads", None) if device_of(backend).type == "cpu" else None
        self._saved: int | None = None

    def __enter__(self) -> LoopThreads:
        if self.threads and torch.get_num_threads() != self.threads:
            self._saved = torch.get_num_threads()
            torch.set_num_threads(self.threads)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            torch.set_num_threads(self._saved)
            self._saved = None
