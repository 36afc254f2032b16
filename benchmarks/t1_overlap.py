"""How far a drafter is from T=1 acceptance on a target: the target's entropy on its own T=1 samples, and each
drafter's per-slot overlap sum_x min(p(x), q(x)) with the target's distribution at each block slot.

    python benchmarks/t1_overlap.py --target Z/target --drafter Z/drafter [--drafter D2 ...] \
        --prompts heldout128.jsonl --limit 16 --json out.json

The target samples --new-tokens tokens at T=1 (seed --seed) after each of the first --limit prompts; blocks are
anchored every --stride tokens along those samples, and slot k's overlap compares the drafter's distribution
there with the target's at the same position. Slot 1's overlap is exactly the T=1 acceptance probability of a
round's first draft; 1 + sum_k prod_{j<=k} overlap_j approximates the T=1 tau (teacher-forced along the target's
samples). The drafter's ReTrace conditioner is not used (no rejected suffix).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from retrace.models.drafter import load_pair
from retrace.runtime.tokenizer import TextCodec
from retrace.train import blocks as bl
from retrace.train import common as cm
from retrace.train.taps import target_taps


def sample(target, prompts, new_tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        for _ in range(new_tokens):
            _, lg = target_taps(target, ids, torch.tensor([[ids.shape[1] - 1]]))
            ids = torch.cat([ids, torch.multinomial(lg[0, -1].float().softmax(-1), 1, generator=g).view(1, 1)], 1)
        out.append(ids)
    return out


def measure(target, drafter, seqs, prompt_lens, stride: int) -> dict:
    B = drafter.config.block_size
    ent, top1, ov = [], [], []
    for ids, pl in zip(seqs, prompt_lens, strict=True):
        S = ids.shape[1]
        taps, lg = target_taps(target, ids, torch.arange(S).view(1, S))
        P = lg[0].float().softmax(-1)  # P[t]: the target's distribution of token t+1
        resp = P[pl - 1:S - 1]
        ent.append(-(resp * resp.clamp_min(1e-30).log()).sum(-1))
        top1.append(resp.max(-1).values)
        anchors = torch.tensor([list(range(pl - 1, S - B, stride))])
        block_ids, _ = bl.block_inputs(ids, anchors, B, drafter.config.mask_token_id)
        _, q = bl.block_forward(drafter, taps.float(), anchors, block_ids)
        pos = anchors[0].view(-1, 1) + torch.arange(B - 1).view(1, -1)  # slot k+1 predicts the token at pos+1
        ov.append(torch.minimum(q[0].float().softmax(-1), P[pos]).sum(-1))
    ov_all = torch.cat(ov)
    return {"target_entropy_nats": round(float(torch.cat(ent).mean()), 4),
            "target_mean_top1_prob": round(float(torch.cat(top1).mean()), 4),
            "overlap_by_slot": [round(float(x), 4) for x in ov_all.mean(0)],
            "one_plus_sum_prod_overlap": round(1 + float(torch.cumprod(ov_all, -1).sum(-1).mean()), 4),
            "blocks": int(ov_all.shape[0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", action="append", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--stride", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = cm.read_prompts_jsonl(a.prompts)[: a.limit]
    prompts = cm.encode_prompts(rows, TextCodec.find(a.target))
    report = {"prompts": len(prompts), "new_tokens": a.new_tokens, "seed": a.seed, "drafters": {}}
    with torch.no_grad():
        target, _ = load_pair(a.target, None)
        seqs = sample(target, prompts, a.new_tokens, a.seed)
        for d in a.drafter:
            target, drafter = load_pair(a.target, d, load_conditioner=False)
            report["drafters"][d] = measure(target, drafter, seqs, [len(p) for p in prompts], a.stride)
            print(json.dumps({d: report["drafters"][d]}), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
