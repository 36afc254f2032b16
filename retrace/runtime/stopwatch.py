"""Round timings that measure the device's work: host timers on the CPU, CUDA events on CUDA.

Once the round runs asynchronously on a GPU, a host timer around a call measures only the launch; the
verify policy's cost model must see what the verify and the draft cost on the device. A stopwatch hands
out marks during the round and turns two marks into seconds after the round's one read (by then every
event recorded before it has completed, so reading them waits for nothing).
"""

from __future__ import annotations

import time

import torch


class HostStopwatch:
    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaStopwatch:
    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        if not end.query():  # complete after the round's read (tree rounds read earlier): no wait, no call
            end.synchronize()
        return start.elapsed_time(end) / 1e3


def stopwatch_for(device: torch.device) -> HostStopwatch | CudaStopwatch:
    return CudaStopwatch() if device.type == "cuda" else HostStopwatch()
