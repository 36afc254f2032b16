"""How many threads torch's own ops between a backend's forwards use (the round's argmaxes, gathers, small
index writes), where the backend says so: `loop_threads`, an optional backend attribute (default None: leave
torch's setting alone, as the torch backend needs, whose forwards are torch ops on the same pool).

The ONNX Runtime backend runs its forwards in ONNX Runtime's own thread pool; the torch ops around
them work on [N, K, V] logits and smaller tensors, which torch still splits over its pool from 32768
elements on. Each such op then wakes the other threads, which costs more than the op where the cores are
busy (measured on this machine's 2 cores at load 4, OMP_WAIT_POLICY=PASSIVE: softmax over [16, 2048] fp32
43 us on one thread, 111 us on two; an index write 11 us vs 313 us; docs/gpu-runtime.md). One thread gives
the same values: the round's reductions run along the last dimension, one row per thread in either case.
"""

from __future__ import annotations

import torch

from retrace.runtime.device import device_of


class LoopThreads:
    """A context for each scheduler step: torch at the backend's `loop_threads` inside; torch's own setting
    again once the scheduler has no work left (`idle()`), or on an error. Not between the steps of one run:
    changing torch's thread count rebuilds its thread pool (about 30 us a change here, 6% of a round's
    0.5 ms budget), so a generate switches once at its first step and once after its last. torch's count
    is the process's: while such a scheduler has work, other torch code in the process runs at it too."""

    def __init__(self, backend, idle=lambda: True):
        self.threads = getattr(backend, "loop_threads", None) if device_of(backend).type == "cpu" else None
        self.idle = idle
        self._saved: int | None = None

    def __enter__(self) -> LoopThreads:
        if self.threads and torch.get_num_threads() != self.threads:
            if self._saved is None:
                self._saved = torch.get_num_threads()
            torch.set_num_threads(self.threads)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if self._saved is not None and (exc_type is not None or self.idle()):
            torch.set_num_threads(self._saved)
            self._saved = None
