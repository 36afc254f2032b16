"""How much of the rejected suffix could a selection rule use? (an investigation tool, not a test)

    python benchmarks/suffix_headroom.py --target zoo/target --drafter zoo/drafter \
        --data zoo/data/train_prompts.jsonl [--prompts 256] [--max-new-tokens 96] [--json out.json]

Rolls out greedy draft/verify rounds (ReTrace mode with a ZERO conditioner, i.e. exactly DFlash) on the last
`--prompts` TRAINING prompts (never the held-out evaluation prompts), and on every round whose previous
round left a rejected suffix compares, per block, the greedy acceptance length (tau_est, on blocks whose
labels are all known) of:

  dflash        the fresh draft;
  oracle_mem    the fresh draft, with the remembered draft d_j wherever d_j is the right token;
  oracle_tt     the same with the target's own token at slot j-1 of the rejected verify pass;
  rule_*        hand rules that replace the fresh draft by d_j (or the target's token) when the reliability
                features say so: fresh confidence below a threshold AND (drafter confidence on d_j / target
                probability of d_j / agreement) above one.

Rule thresholds are tuned on the even-numbered sequences (half A) and reported on the odd ones (half B), so
a gain on B is a gain a learned gate could find from these features. The oracles bound what any
conditioner could get from replacing a slot; a rule that gains nothing on B says the features cannot tell
the useful memory slots from the harmful ones at this scale.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tempfile
from pathlib import Path

import torch

from retrace.models.conditioner import ReTraceConditioner
from retrace.models.config import DrafterConfig
from retrace.models.drafter import load_pair
from retrace.train import blocks as bl
from retrace.train.conditioner import ConditionerConfig, collate, collect, pick_rounds
from retrace.train.datasets_io import prepare_prompts

F_GRID = (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.01)  # fresh-draft confidence below ...
M_GRID = (0.0, 0.2, 0.4, 0.6, 0.8)  # ... and memory reliability above


def zero_conditioner_copy(drafter_dir: Path, tmp: Path) -> Path:
    """The drafter's DFlash files with a zero conditioner beside them (ReTrace mode == DFlash)."""
    for name in ("config.json", "model.safetensors"):
        shutil.copy(drafter_dir / name, tmp / name)
    cfg = DrafterConfig.from_dir(tmp)
    ReTraceConditioner(cfg.hidden_size, rms_norm_eps=cfg.layers.rms_norm_eps).save(tmp)
    return tmp


def block_rows(target_dir: Path, drafter_dir: Path, prompts: list[list[int]], max_new_tokens: int,
               seed: int, device: torch.device | str = "cpu") -> list[dict]:
    """One dict of [B-1] tensors (CPU) per recorded block whose labels are all known."""
    device = torch.device(device)
    target, drafter = load_pair(target_dir, drafter_dir)
    target.to(device)
    drafter.to(device)
    B = drafter.config.block_size
    cfg = ConditionerConfig(max_new_tokens=max_new_tokens, rollout_batch=64, rollout_temperatures=(0.0,))
    ex = collect(target, drafter, prompts, cfg, device, seed, False, False)
    use, rows = ex.usable(), []
    with torch.no_grad():
        for s in range(0, len(use), 8):
            idx = use[s : s + 8]
            picks = pick_rounds(ex, idx, 10**6, None)
            taps, block_ids, labels, anchors, bw, suffix = collate(ex, idx, picks, B, device,
                                                                   drafter.config.mask_token_id)
            _, logits = bl.block_forward(drafter, taps, anchors, block_ids, None)
            p_fresh, fresh = logits.float().softmax(-1).max(-1)
            mem = drafter.target.logits(suffix.memory[:, :, 1:]).argmax(-1)
            full = ((labels != bl.IGNORE) & (bw.unsqueeze(-1) > 0)).all(-1) & (bw > 0)
            f = suffix.features[:, :, 1:].cpu()
            labels, bw, full, fresh, p_fresh, mem = (t.cpu() for t in (labels, bw, full, fresh, p_fresh, mem))
            valid = suffix.valid[:, :, 1:].cpu() > 0
            for n, (i, pk) in enumerate(zip(idx, picks, strict=True)):
                for b, k in enumerate(pk):
                    if full[n, b]:
                        rows.append(dict(seq=i, label=labels[n, b], fresh=fresh[n, b], p_fresh=p_fresh[n, b],
                                         mem=mem[n, b], tt=ex.rolls[i].rounds[k].target_tokens[1:],
                                         valid=valid[n, b], agree=f[n, b, :, 0],
                                         target_prob=f[n, b, :, 1], draft_prob=f[n, b, :, 2]))
    return rows


def tau(rows: list[dict], choose) -> float:
    accepted = sum(float((choose(r) == r["label"]).long().cumprod(-1).sum()) for r in rows)
    return 1 + accepted / max(len(rows), 1)


def replace_where(source: str, cond):
    return lambda r: torch.where(r["valid"] & cond(r), r[source], r["fresh"])


def analyse(rows: list[dict]) -> dict:
    A = [r for r in rows if r["seq"] % 2 == 0]
    B = [r for r in rows if r["seq"] % 2 == 1]
    out = {"blocks": {"A": len(A), "B": len(B)}, "tau_B": {
        "dflash": tau(B, lambda r: r["fresh"]),
        "oracle_mem": tau(B, replace_where("mem", lambda r: r["mem"] == r["label"])),
        "oracle_tt": tau(B, replace_where("tt", lambda r: r["tt"] == r["label"])),
    }, "rules": {}}
    families = {
        f"mem_if_{key}": (lambda tf, tm, key=key: replace_where("mem", lambda r: (r["p_fresh"] < tf) & (r[key] > tm)))
        for key in ("draft_prob", "target_prob", "agree")
    }
    families["tt_if_unsure"] = lambda tf, tm: replace_where("tt", lambda r: r["p_fresh"] < tf)
    for name, make in families.items():
        best = max(itertools.product(F_GRID, M_GRID), key=lambda p: tau(A, make(*p)))
        out["rules"][name] = {"fresh_below": best[0], "memory_above": best[1], "tau_A": tau(A, make(*best)),
                              "dflash_A": tau(A, lambda r: r["fresh"]), "tau_B": tau(B, make(*best))}
    d = out["tau_B"]["dflash"]
    for r in out["rules"].values():
        r["gain_B"] = r["tau_B"] / d - 1
    out["tau_B"]["oracle_mem_gain"] = out["tau_B"]["oracle_mem"] / d - 1
    out["tau_B"]["oracle_tt_gain"] = out["tau_B"]["oracle_tt"] / d - 1
    return json.loads(json.dumps(out), parse_float=lambda x: round(float(x), 4))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True, help="TRAINING prompts JSONL (the last --prompts are used)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    train, _ = prepare_prompts(a.target, a.data, 256, None, 64, 0)
    with tempfile.TemporaryDirectory() as tmp:
        rows = block_rows(a.target, zero_conditioner_copy(a.drafter, Path(tmp)), train[-a.prompts :],
                          a.max_new_tokens, a.seed)
    res = analyse(rows)
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
