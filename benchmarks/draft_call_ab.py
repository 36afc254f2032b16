"""The draft call of several bundles loaded in one process, interleaved call by call (each round starting
with another bundle), at draft widths 8 and 16, batch 1, after a 128-token prefill, 3 new context rows and
a rejected suffix valid at every slot but the anchor (not a test):

    python benchmarks/draft_call_ab.py BUNDLE_A BUNDLE_B [...]

Prints the median and the minimum of 50 calls per bundle and width (ms).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import retrace.runtime.onnxruntime_backend as ob
from retrace.models.drafter import SuffixInputs


def main() -> None:
    torch.set_num_threads(2)
    bes = {p: ob.OnnxRuntimeBackend.from_bundle(p, max_batch=1, threads=2, verify=False) for p in sys.argv[1:]}
    P = 128
    for be in bes.values():
        be.target(torch.arange(1), torch.randint(0, 500, (1, P)), torch.arange(P)[None], torch.full((1, 1), P - 1))
    be0 = next(iter(bes.values()))
    k_d = be0.drafter_config.num_taps * be0.target_config.hidden_size
    d = be0.drafter_config.hidden_size
    g = torch.Generator().manual_seed(0)
    for B in (8, 16):
        times = {p: [] for p in bes}
        for i in range(60):
            pos = P + 4 * (i % 20)
            suffix = SuffixInputs(memory=torch.randn(1, B, d, generator=g),
                                  features=torch.randn(1, B, be0._num_features, generator=g),
                                  valid=(torch.arange(B) > 0).float()[None],
                                  corr_index=torch.zeros(1, B, dtype=torch.int64))
            args = (torch.arange(1), torch.randn(1, 3, k_d, generator=g), torch.arange(pos - 3, pos)[None],
                    torch.randint(0, 500, (1, B), generator=g), torch.arange(pos, pos + B)[None], suffix)
            order = list(bes.items()) if i % 2 else list(reversed(bes.items()))
            for p, be in order:
                t0 = time.perf_counter()
                be.draft(*args)
                times[p].append((time.perf_counter() - t0) * 1e3)
        for p, t in times.items():
            t = t[10:]
            print(f"width {B:2d} {p:40s} median {statistics.median(t):6.2f} min {min(t):6.2f} ms")


if __name__ == "__main__":
    main()
