"""Is the inflated target as slow as a random-weight model of its shape? (not a test)

    python benchmarks/inflated_speed.py --target DIR/target [--threads 2] [--reps 5] [--json F]

The inflated pair's new heads, channels and layers are multiplied by exact zeros; a dense fp32 matmul does
not skip zeros, so the inflated target must cost what any model of its shape costs. Times the torch target
forward (prefill T=128 and decode T=1 at past 128, batch 1) of the inflated weights and of the same config
with random weights, interleaved, minimum of `reps` each; prints ms and the ratio inflated / random.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from retrace.models.target import Qwen3Target


@torch.inference_mode()
def _time(model: Qwen3Target, T: int, past: int) -> float:
    pk, pv = model.empty_past(1, past)
    ids = torch.randint(0, model.config.vocab_size // 2, (1, T))
    pos = torch.arange(past, past + T).unsqueeze(0)
    t0 = time.perf_counter()
    model(ids, pos, pk, pv, torch.tensor([past]), torch.tensor([[T - 1]]))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    inflated = Qwen3Target.from_pretrained(a.target)
    random = Qwen3Target(inflated.config).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in random.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    cases = {"prefill_T128": (128, 0), "decode_T1_past128": (1, 128)}
    res = {}
    for name, (T, past) in cases.items():
        best = {"inflated": float("inf"), "random": float("inf")}
        for _ in range(a.reps):
            for k, m in (("inflated", inflated), ("random", random)):
                best[k] = min(best[k], _time(m, T, past))
        res[name] = {"inflated_ms": best["inflated"] * 1e3, "random_ms": best["random"] * 1e3,
                     "ratio": best["inflated"] / best["random"]}
        print(f"{name}: inflated {res[name]['inflated_ms']:.1f} ms, random {res[name]['random_ms']:.1f} ms, "
              f"ratio {res[name]['ratio']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
