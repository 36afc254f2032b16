"""`python -m retrace.gpucheck.reference --zoo DIR --out FILE`: the CPU greedy outputs the GPU must match.

Held-out prompts of the zoo, ar / dflash / retrace, batch 1 and 8, fp32 on CPU: token ids, tau, tokens/s.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from retrace.gpucheck import decode
from retrace.runtime.modes import MODES

N_PROMPTS = 8
MAX_NEW_TOKENS = 48
BATCHES = (1, 8)


def build(zoo: Path, n_prompts: int = N_PROMPTS, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    cpu = torch.device("cpu")
    prompts = decode.held_out_prompts(zoo, n_prompts)
    target, drafter = decode.load(zoo, torch.float32, cpu)
    runs = {}
    for batch in BATCHES:
        for mode in MODES:
            runs[f"{mode}_b{batch}"] = decode.greedy(target, drafter, prompts, mode, batch, max_new_tokens, cpu)
    return {"zoo": str(zoo), "prompts": prompts, "max_new_tokens": max_new_tokens, "dtype": "float32",
            "torch": torch.__version__, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=N_PROMPTS)
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    a = ap.parse_args(argv)
    ref = build(a.zoo, a.prompts, a.max_new_tokens)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(ref) + "\n")
    print(json.dumps({k: {"tau": v["tau"], "tokens_per_s": v["tokens_per_s"]} for k, v in ref["runs"].items()}))


if __name__ == "__main__":
    main()
