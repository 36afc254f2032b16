"""Why random bf16 Qwen3 weights make speculative and plain greedy outputs part at the full vocabulary.

`python benchmarks/bf16_near_ties.py [--shape qwen3-0.6b]`: one 128-token forward of the random target that
`scripts/gpu_bench.sh` builds, in fp32 and in bf16 on the CPU; prints the top-1 / top-2 logit gap and how
often bf16 rounding alone changes the argmax. Random weights over 151,936 ids give near-ties everywhere, so
two kernels that round differently (a T=1 decode and a T=16 verify) pick different tokens sooner or later.
"""

from __future__ import annotations

import argparse
import time

import torch

from retrace.gpucheck.bench import SHAPES, build_pair
from retrace.runtime.device import index_tensor
from retrace.runtime.torch_backend import TorchBackend


def all_logits(target, ids: torch.Tensor) -> torch.Tensor:
    """[T, V] fp32 logits of every position of ids [1, T] from a fresh cache."""
    T = ids.shape[1]
    be = TorchBackend(target, None, max_batch=1, max_seq_len=T + 8)
    out, _ = be.target(index_tensor([0], be.device), ids, index_tensor([list(range(T))], be.device),
                       torch.arange(T)[None])
    return out[0].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    a = ap.parse_args()
    t0 = time.perf_counter()
    target, _ = build_pair(a.shape, 1, torch.device("cpu"), torch.float32)
    V = SHAPES[a.shape][-1]
    ids = torch.randint(0, V - 2, (1, 128), generator=torch.Generator().manual_seed(0))
    f = all_logits(target, ids)
    top = f.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    print(f"fp32: logit std {f.std():.3f}, top-1 minus top-2 median {gap.median():.4f}, min {gap.min():.5f}")
    b = all_logits(target.to(torch.bfloat16), ids)
    err = (b - f).abs()
    flips = int((b.argmax(-1) != f.argmax(-1)).sum())
    print(f"bf16 vs fp32: logit error max {err.max():.4f}, median {err.median():.4f}; "
          f"argmax differs at {flips} of {ids.shape[1]} positions ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
