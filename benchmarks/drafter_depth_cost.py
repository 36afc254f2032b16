"""The draft call's cost per drafter depth at a published Qwen3 shape, against one target decode step (torch, CPU).

    python benchmarks/drafter_depth_cost.py --shape qwen3-0.6b --depths 1,2,3 --threads 1 --json out.json

Random weights at the shape (retrace.train.inflate.SHAPES): timing only. Batch 1, a target context of --context
tokens; one target decode step (1 token) and one verify step (a --block-token chain) against one draft call:
--new-ctx new context taps, the block of --block tokens, the LM head over the block's slots 1..B-1 at the full
vocabulary and at a draft vocabulary of --draft-vocab rows (the drafter's head rows taken from the target's
table). The layers' share is the call minus its head. Medians of --reps interleaved repetitions, in ms and in
target decodes. --clock cpu (the default) counts this process's CPU time (time.process_time: with one thread, the
call's own cost, unaffected by other processes taking the cores of a shared machine); --clock wall its wall time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from retrace.models.config import Qwen3Config
from retrace.models.drafter import DFlashDrafter, new_drafter_config
from retrace.models.target import Qwen3Target
from retrace.train.inflate import SHAPES


def target_at(shape: str, taps: tuple[int, ...]) -> Qwen3Target:
    raw = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **SHAPES[shape].to_dict(),
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 40960, "tie_word_embeddings": True}
    t = Qwen3Target(Qwen3Config.from_dict(raw, Path(f"<{shape}>")), tap_layers=taps)
    with torch.no_grad():
        for p in t.parameters():
            p.normal_(0, 0.02) if p.ndim >= 2 else p.fill_(1.0)
    return t.eval().requires_grad_(False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--depths", default="1,2,3")
    ap.add_argument("--taps", default="14", help="target layers the drafter reads (the zoo's recipe: one)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--new-ctx", type=int, default=4, help="context taps a draft call adds (about tau)")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--draft-vocab", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    depths = [int(x) for x in a.depths.split(",")]
    taps = tuple(int(x) for x in a.taps.split(","))
    target = target_at(a.shape, taps)
    drafters = {n: DFlashDrafter(new_drafter_config(target, num_layers=n, block_size=a.block, mask_token_id=0,
                                                    target_layer_ids=list(taps)), target).eval().requires_grad_(False)
                for n in depths}
    P, B, C = a.context, a.block, a.new_ctx
    pk, pv = target.empty_past(1, P)
    plen = torch.tensor([P])
    one, chain = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, B, dtype=torch.long)
    d_ctx = torch.randn(1, C, len(taps) * target.config.hidden_size)
    ctx_pos = torch.arange(P, P + C).unsqueeze(0)
    blk_pos = torch.arange(P + C - 1, P + C - 1 + B).unsqueeze(0)
    sub = target.lm_head.weight[: a.draft_vocab].clone()
    h = torch.randn(1, B - 1, target.config.hidden_size)
    past = {n: d.empty_past(1, P) for n, d in drafters.items()}

    calls = {
        "decode": lambda: target(one, torch.tensor([[P]]), pk, pv, plen),
        "verify": lambda: target(chain, torch.arange(P, P + B).unsqueeze(0), pk, pv, plen),
        "head_full": lambda: target.logits(h),
        "head_subset": lambda: torch.nn.functional.linear(h, sub),
    }
    for n, d in drafters.items():
        calls[f"draft_{n}"] = (lambda d=d, n=n: d(d_ctx, ctx_pos, *past[n], plen, chain, blk_pos))
    times: dict[str, list[float]] = {k: [] for k in calls}
    with torch.no_grad():
        for fn in calls.values():
            fn()  # warm-up
        for _ in range(a.reps):  # interleaved
            for k, fn in calls.items():
                t0 = clock()
                fn()
                times[k].append((clock() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    dec = med["decode"]
    rows = {}
    for n in depths:
        full = med[f"draft_{n}"]
        body = full - med["head_full"]
        rows[n] = {"draft_ms": round(full, 2), "layers_ms": round(body, 2),
                   "draft_full_head_decodes": round(full / dec, 3),
                   "draft_subset_head_decodes": round((body + med["head_subset"]) / dec, 3)}
    rep = {"shape": a.shape, "threads": a.threads, "clock": a.clock, "context": P, "block": B, "new_ctx": C,
           "taps": list(taps),
           "draft_vocab": a.draft_vocab, "reps": a.reps, "median_ms": {k: round(v, 2) for k, v in med.items()},
           "verify_decodes": round(med["verify"] / dec, 3), "depths": rows}
    print(json.dumps(rep, indent=2))
    if a.json:
        a.json.write_text(json.dumps(rep, indent=2) + "\n")


if __name__ == "__main__":
    main()
