"""How the torch backend runs its padded static-shape steps: eagerly, or as CUDA graphs captured per bucket.

A runner is called as `runner(bucket, step, inputs)`: `bucket` (runtime/step_buckets.Bucket) names the
fixed shape, `step(width=bucket.window, **inputs)` is the step (models/cached_step.py slot_target_step /
slot_draft_step, possibly under torch.compile), `inputs` its tensors (a tuple of tensors is allowed).

`CUDAGraphSteps` (the thin CUDA-only layer): the first call of a bucket copies its inputs into persistent
buffers of that shape, runs the step twice on a side stream (warm-up: the cuBLAS/cuDNN handles and any
compile), then captures one `torch.cuda.CUDAGraph` of it in a memory pool every graph shares; every call,
the first included, copies the inputs into the buffers and replays the graph, and the outputs are read from
the graph's own output buffers (the caller copies what it keeps: the next replay overwrites them). The
warm-up and the capture write the call's own K/V (the same values each time), so capturing changes nothing.
If a capture fails, a warning says why and every later call runs the step eagerly (the same padded step:
the same tokens). Without CUDA it refuses to be built, with one clear error.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
from torch.utils import _pytree as pytree

from retrace.errors import RetraceError


class EagerSteps:
    """The padded steps run as they are (the CPU, tests, `--no-cuda-graphs` on CUDA)."""

    captures = replays = 0

    def __init__(self):
        self.calls: Counter = Counter()  # bucket -> calls

    def __call__(self, bucket, step, inputs: dict):
        self.calls[bucket] += 1
        return step(width=bucket.window, **inputs)


class CUDAGraphSteps:
    """One CUDA graph per bucket, captured on first use; eager for good after a failed capture."""

    def __init__(self, device: torch.device, warmup: int = 2):
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise RetraceError(f"CUDA graphs need a CUDA device (the backend runs on {device}); "
                               "leave cuda_graphs unset or use --no-cuda-graphs")
        self.device, self.warmup = device, warmup
        self.graphs: dict = {}  # bucket -> (graph, input buffers (flat), output buffers)
        self.pool = None
        self.failed: str | None = None  # why capture was given up
        self.captures = self.replays = 0
        self.calls: Counter = Counter()  # bucket -> calls

    def __call__(self, bucket, step, inputs: dict):
        self.calls[bucket] += 1
        if self.failed is not None:
            return step(width=bucket.window, **inputs)
        entry = self.graphs.get(bucket)
        if entry is None:
            try:
                entry = self.graphs[bucket] = self._capture(bucket, step, inputs)
            except Exception as e:  # noqa: BLE001 - any capture failure: eager from now on, said once
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"CUDA graph capture of the {bucket.step} step failed ({self.failed}); running the "
                              "steps eagerly", RuntimeWarning, stacklevel=2)
                return step(width=bucket.window, **inputs)
        graph, buffers, outputs = entry
        for buf, value in zip(buffers, pytree.tree_leaves(inputs), strict=True):
            buf.copy_(value, non_blocking=True)
        graph.replay()
        self.replays += 1
        return outputs

    def _capture(self, bucket, step, inputs: dict):
        leaves, spec = pytree.tree_flatten(inputs)
        buffers = [t.clone() for t in leaves]
        static = pytree.tree_unflatten(buffers, spec)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                step(width=bucket.window, **static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = step(width=bucket.window, **static)
        self.captures += 1
        return graph, buffers, outputs


def steps_runner(device: torch.device, cuda_graphs: bool | None):
    """The runner for a backend on `device`: cuda_graphs None = on CUDA only; True without CUDA refuses."""
    if cuda_graphs is None:
        cuda_graphs = device.type == "cuda"
    return CUDAGraphSteps(device) if cuda_graphs else EagerSteps()
