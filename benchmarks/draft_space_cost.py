"""What a drafted round's draft side costs with the draft logits kept over the draft vocabulary (the round's
draft space, runtime/draft_space.py) against the same logits expanded to the target's vocabulary (-inf
outside the subset: what the ONNX Runtime backend returned before), on one loaded bundle with a draft
vocabulary, interleaved call by call:

    python benchmarks/draft_space_cost.py --engine BUNDLE --threads 2 --reps 30 [--batch 1] [--json OUT]

Per round, medians in ms: the draft call (with the expansion for the expanded form), the drafts and q
(`propose_tokens`), the adaptive verify policy's confidence (`draft_confidence`) and the rejected suffix's
features (`kept_features`, 14 kept rows), and their sum; the same drafts in both forms is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from retrace.runtime.draft_space import DraftSpace
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend
from retrace.runtime.proposers.chain import propose_tokens
from retrace.runtime.sampling import SamplingParams
from retrace.runtime.suffix_memory import align, kept_features
from retrace.runtime.verify_policy import draft_confidence


class _Req:
    params = SamplingParams(max_new_tokens=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    be = OnnxRuntimeBackend.from_bundle(a.engine, max_batch=a.batch, threads=a.threads)
    if be.draft_ids is None:
        raise SystemExit(f"{a.engine}: no draft vocabulary in this bundle")
    subset, full = DraftSpace.of(be), DraftSpace(None, be.target_config.vocab_size)
    N, B, P, V = a.batch, be.drafter_config.block_size, a.context, be.target_config.vocab_size
    slots = torch.arange(N)
    g = torch.Generator().manual_seed(0)
    be.target(slots, torch.randint(0, 500, (N, P), generator=g), torch.arange(P).expand(N, P).contiguous(),
              torch.full((N, 1), P - 1))
    k_d = be.drafter_config.num_taps * be.target_config.hidden_size
    draft = (slots, torch.randn(N, 4, k_d, generator=g), torch.arange(P - 4, P).expand(N, 4).contiguous(),
             torch.randint(0, 500, (N, B), generator=g), torch.arange(P, P + B).expand(N, B).contiguous(), None)
    verify_logits = torch.randn(N, B, V, generator=g)
    reqs = [_Req() for _ in range(N)]
    accepted = torch.zeros(N, dtype=torch.int64)
    old, _, corr = align(accepted, B, torch.full((N,), B - 1))

    def round_side(space: DraftSpace) -> dict[str, float]:
        t = {}
        t0 = time.perf_counter()
        _, logits = be.draft(*draft)
        if space.full:
            logits = DraftSpace(be.draft_ids, V).logits_full(logits)
        t["draft_call"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        drafts, q = propose_tokens(logits, reqs, space)
        t["propose"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        draft_confidence(logits, q)
        t["confidence"] = time.perf_counter() - t0
        block = torch.cat([draft[3][:, :1], drafts], 1)
        t0 = time.perf_counter()
        kept_features(block, verify_logits, logits, verify_logits.argmax(-1), old, corr, range(1, B - 1), space)
        t["suffix_features"] = time.perf_counter() - t0
        t["drafts"] = drafts
        return t

    times: dict[str, dict[str, list[float]]] = {"subset": {}, "expanded": {}}
    for rep in range(a.reps + 2):
        outs = {}
        for name, space in (("subset", subset), ("expanded", full)):
            t = round_side(space)
            outs[name] = t.pop("drafts")
            if rep >= 2:
                for k, v in t.items():
                    times[name].setdefault(k, []).append(v * 1e3)
        assert torch.equal(outs["subset"], outs["expanded"]), "the two forms drafted different tokens"
    res = {name: {k: statistics.median(v) for k, v in parts.items()} for name, parts in times.items()}
    for name, parts in res.items():
        parts["total"] = sum(parts.values())
        print(f"{name:>9}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()) + " ms")
    print(f"draft side per round: subset {res['subset']['total']:.2f} ms vs expanded {res['expanded']['total']:.2f} "
          f"ms ({res['expanded']['total'] / res['subset']['total']:.2f}x)")
    if a.json:
        out = {"engine": str(a.engine), "batch": N, "threads": a.threads, "reps": a.reps,
               "draft_vocab": int(be.draft_ids.numel()), "vocab": V, "ms": res}
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
