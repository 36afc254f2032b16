"""Tiny deterministic runs of the four trainers (DFlash drafter with a stop and --resume, conditioner with a
stop and --resume, zoo target, AR draft) -> the sha256 of the files each writes that hold no timings.

Run as `python tests/golden_training.py OUT` under numerics.PORTABLE_ENV (test_train_golden.py does): it
prints the digests as JSON. Also a tool: run it on two checkouts to see that a change keeps trained bytes.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

DFLASH = dict(block_size=8, num_layers=1, mask_token_id=127, steps=12, batch_size=4, blocks_per_seq=6, val_prompts=8,
              max_new_tokens=16, gen_batch=40, eval_every=6, save_every=4, eval_tau_prompts=4, eval_tau_new_tokens=12,
              warmup=2, lr=3e-3, device="cpu", threads=1)
CONDITIONER = dict(phases=2, steps_per_phase=6, rollout_prompts=12, rollout_batch=12, max_new_tokens=16, val_prompts=8,
                   eval_prompts=4, eval_new_tokens=12, blocks_per_seq=6, batch_size=4, warmup=2, diagnose_seqs=4,
                   device="cpu", threads=1, rollout_temperatures=(0.0, 1.0))
# no timings in these (the *_train.json logs and draft_ar.json hold seconds)
KEPT = ("model.safetensors", "retrace.safetensors", "config.json", "retrace_config.json", "state.safetensors",
        "state.json", "responses.json", "taps.safetensors")


def digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in sorted(root.rglob("*")) if p.is_file() and p.name in KEPT}


def write_prompts(path: Path, n: int = 40, vocab: int = 128) -> Path:
    r = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt_ids": [r.randrange(3, vocab - 1) for _ in range(r.randint(4, 12))]}) + "\n")
    return path


def run(out: Path) -> dict[str, dict[str, str]]:
    import torch
    from helpers import write_drafter, write_target

    from retrace.train import numerics, target_lm
    from retrace.train.conditioner import ConditionerConfig, train_conditioner
    from retrace.train.dflash import DFlashConfig, train_dflash
    from retrace.train.draft_ar import DraftArConfig, train_draft_ar

    torch.set_num_threads(1)
    res = {}
    with numerics.deterministic():
        t = write_target(out / "target", vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
        p = write_prompts(out / "p.jsonl")
        train_dflash(t, out / "dflash", p, DFlashConfig(**DFLASH), progress=False)
        train_dflash(t, out / "dflash_resumed", p, DFlashConfig(**DFLASH, stop_after=5), progress=False)
        train_dflash(t, out / "dflash_resumed", p, DFlashConfig(**DFLASH), resume=True, progress=False)
        dr = write_drafter(out / "drafter", t, layers=1, block_size=8, conditioner=None)
        train_conditioner(t, dr, p, out / "conditioner", ConditionerConfig(**CONDITIONER), progress=False)
        train_conditioner(t, dr, p, out / "conditioner_resumed", ConditionerConfig(**CONDITIONER, stop_after=1),
                          progress=False)
        train_conditioner(t, dr, p, out / "conditioner_resumed", ConditionerConfig(**CONDITIONER), resume=True,
                          progress=False)
        preset = target_lm.get_preset("test", steps=12, warmup_steps=3, seq_len=32, batch_size=8)
        model = target_lm.build_model(target_lm.make_config(preset, 128), seed=0)
        target_lm.train_target(model, torch.arange(4000) % 89 + 3, preset, seed=0, progress=False)
        target_lm.save_target(model, out / "zoo_target")
        train_draft_ar(t, out / "draft_ar", p, DraftArConfig(seconds=1e9, max_steps=12, num_prompts=32,
                                                             max_new_tokens=16, batch_size=8, threads=1),
                       progress=False)
    for k in ("dflash", "dflash_resumed", "conditioner", "conditioner_resumed", "zoo_target", "draft_ar"):
        res[k] = digests(out / k)
    return res


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1])), indent=1, sort_keys=True))
