"""One pair's bundles that differ only in the drafter's precision (`retrace-export build --drafter-weights`),
run on the same prompts one at a time, interleaved prompt by prompt (not a test):

    python benchmarks/drafter_precision.py --bundles A,B[,C] --prompts zoo/prompts --limit 32 \
        [--max-new-tokens 96] [--threads 2] [--mode retrace] [--json out.json]

Prints, per bundle, tokens/s over the generation calls, tau (committed tokens per target call after the
prefill), the drafting time per round, and whether every output equals the first bundle's token for token
(the targets of the bundles must be the same graph for that: same --weights). ONNX Runtime, batch 1, the
bundles' own adaptive policy and no prompt lookup (the drafter's effect alone); the machine state moves
every bundle alike, the reason for interleaving.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from retrace.bench.prompts import load_prompts
from retrace.runtime import Runtime, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundles", required=True, help="comma list of bundle directories")
    ap.add_argument("--prompts", type=Path, required=True, help="a JSONL file or a folder of them")
    ap.add_argument("--limit", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="retrace")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    paths = [p.strip() for p in a.bundles.split(",") if p.strip()]
    rts = {p: Runtime.from_bundle(p, threads=a.threads, max_batch=1, prompt_lookup=False) for p in paths}
    first = rts[paths[0]]
    files = sorted(a.prompts.glob("*.jsonl")) if a.prompts.is_dir() else [a.prompts]
    prompts = load_prompts(files, first.codec, limit=a.limit, vocab_size=first.backend.target_config.vocab_size)
    params = SamplingParams(max_new_tokens=a.max_new_tokens)
    acc = {p: {"tokens": 0, "seconds": 0.0, "rounds": 0, "draft_s": 0.0, "outputs": []} for p in paths}
    for prompt in prompts:
        for p, rt in rts.items():
            rt.reset_stats()
            t0 = time.perf_counter()
            out = rt.generate([prompt.ids], params, a.mode)[0]
            acc[p]["seconds"] += time.perf_counter() - t0
            s = rt.run_stats()
            acc[p]["tokens"] += len(out.token_ids)
            acc[p]["rounds"] += s["rounds"]
            acc[p]["draft_s"] += s["time"]["draft_s"]
            acc[p]["outputs"].append(out.token_ids)
    report = {"prompts": len(prompts), "max_new_tokens": a.max_new_tokens, "threads": a.threads, "mode": a.mode,
              "bundles": {}}
    for p in paths:
        r = acc[p]
        m = json.loads((Path(p) / "manifest.json").read_text())
        row = {"target_weights": m.get("weights", "fp32"), "drafter_weights": m.get("drafter_weights",
                                                                                      m.get("weights", "fp32")),
               "tokens_per_s": r["tokens"] / r["seconds"], "tau": r["tokens"] / max(1, r["rounds"]),
               "draft_ms_per_round": 1e3 * r["draft_s"] / max(1, r["rounds"]),
               "token_exact_vs_first": r["outputs"] == acc[paths[0]]["outputs"]}
        report["bundles"][p] = row
        print(f"{p}: target {row['target_weights']}, drafter {row['drafter_weights']}: {row['tokens_per_s']:.2f} "
              f"tok/s, tau {row['tau']:.3f}, drafting {row['draft_ms_per_round']:.2f} ms a round, token-exact vs "
              f"the first: {row['token_exact_vs_first']}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
