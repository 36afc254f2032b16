"""The draft width's sweep rule on and off (runtime/draft_width.py `widen`), one bundle, two runtimes, the same
prompts one at a time, interleaved prompt by prompt (not a test):

    python benchmarks/width_sweep.py --bundle B --prompts zoo/prompts --limit 32 [--threads 2] [--json out.json]

Prints tokens/s, tau (committed tokens per target call after the prefill), the rounds per draft width, and
whether the outputs are identical (they must be: the width never changes the output).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from retrace.bench.prompts import load_prompts
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.draft_width import DraftWidth
from retrace.runtime.verify_policy import AdaptivePolicy


def runtime(bundle: str, threads: int, widen: bool) -> tuple[Runtime, Counter]:
    rt = Runtime.from_bundle(bundle, threads=threads, max_batch=1, prompt_lookup=False)
    block = rt.options.block_size_for(rt.backend)
    policy = AdaptivePolicy(block)
    policy.width = DraftWidth(block, widen=widen)
    widths: Counter = Counter()
    choose = policy.width.choose

    def counted(mode, rows, cost):
        s = choose(mode, rows, cost)
        widths[s] += 1
        return s

    policy.width.choose = counted
    rt = Runtime(rt.backend, rt.codec, rt.options.replace(verify_policy=policy))
    return rt, widths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    arms = {name: runtime(a.bundle, a.threads, widen) for name, widen in (("widen", True), ("no-widen", False))}
    codec = arms["widen"][0].codec
    files = sorted(a.prompts.glob("*.jsonl")) if a.prompts.is_dir() else [a.prompts]
    prompts = load_prompts(files, codec, limit=a.limit, vocab_size=arms["widen"][0].backend.target_config.vocab_size)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    acc = {n: {"tokens": 0, "seconds": 0.0, "rounds": 0, "outputs": []} for n in arms}
    for prompt in prompts:
        for n, (rt, _) in arms.items():
            rt.reset_stats()
            t0 = time.perf_counter()
            out = rt.generate([prompt.ids], params, "retrace")[0]
            acc[n]["seconds"] += time.perf_counter() - t0
            acc[n]["tokens"] += len(out.token_ids)
            acc[n]["rounds"] += rt.run_stats()["rounds"]
            acc[n]["outputs"].append(out.token_ids)
    report = {"bundle": a.bundle, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "arms": {}}
    for n, (_, widths) in arms.items():
        r = acc[n]
        row = {"tokens_per_s": r["tokens"] / r["seconds"], "tau": r["tokens"] / max(1, r["rounds"]),
               "widths": dict(sorted(widths.items())), "same_outputs": r["outputs"] == acc["widen"]["outputs"]}
        report["arms"][n] = row
        print(f"{n}: {row['tokens_per_s']:.2f} tok/s, tau {row['tau']:.3f}, widths {row['widths']}, "
              f"outputs identical: {row['same_outputs']}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
