"""Throughput under continuous batching: many requests through a few slots (not a test).

    python benchmarks/continuous_batch.py --engine BUNDLE --prompts DIR_OR_JSONL [--requests 16] [--slots 4]
        [--max-new-tokens 48] [--runs 2] [--warmup 1] [--threads 2] [--systems ar,retrace,...] [--json F]

`retrace bench` runs closed batches (b prompts together until the slowest is done). A server refills a
finished request's slot at once, which is what the verify policy's objective (tokens per second summed over
the rows) assumes. This runs `--requests` greedy prompts through `--slots` slots of one ONNX Runtime
backend and times, interleaved over `--runs` (after `--warmup` untimed passes), each system a fresh Runtime
(adaptive policy) over the one backend; every output is checked against ar's. Systems (SYSTEMS):
ar; retrace (the drafter alone: `--prompt-lookup off`); retrace-lookup (`on`); retrace-lookup-first (`first`,
the runtime's default: up to 8 rows, each n-gram size weighed by a draw from its acceptance posterior);
retrace-lookup-first-mean (the same weighed by the posterior's mean, the rule until 2026-12-07);
retrace-lookup-first-rowsN (`first` in rounds of up to N rows; N = 1 was the default until 2026-12-06).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from retrace.bench.prompts import load_prompts
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.tokenizer import TextCodec

SYSTEMS = {  # name -> (mode, RuntimeOptions.prompt_lookup, made fresh per run)
    "ar": ("ar", lambda: False),
    "retrace": ("retrace", lambda: False),
    "retrace-lookup": ("retrace", lambda: True),
    "retrace-lookup-first": ("retrace", lambda: "first"),
    "retrace-lookup-first-mean": ("retrace", lambda: PromptLookup(first=True, explore=False)),
}


def system(name: str):
    """-> (mode, a maker of RuntimeOptions.prompt_lookup) for a name of SYSTEMS or retrace-lookup-first-rowsN."""
    if name in SYSTEMS:
        return SYSTEMS[name]
    rows = name.removeprefix("retrace-lookup-first-rows")
    if rows != name and rows.isdigit() and int(rows) > 0:
        return "retrace", lambda: PromptLookup(first=True, max_rows=int(rows))
    raise SystemExit(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}, retrace-lookup-first-rowsN")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes over every system first")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default="ar,retrace,retrace-lookup", help=f"comma list of {', '.join(SYSTEMS)}, "
                    "retrace-lookup-first-rowsN")
    ap.add_argument("--json")
    a = ap.parse_args()
    be = OnnxRuntimeBackend.from_bundle(a.engine, max_batch=a.slots, threads=a.threads)
    codec = TextCodec.find(Path(a.engine) / "tokenizer", a.engine)
    prompts = [p.ids for p in load_prompts([a.prompts], codec, limit=a.requests)]
    names = ["ar", *(n for n in a.systems.split(",") if n and n != "ar")]  # ar: the reference
    systems = {n: system(n) for n in names}
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {n: [] for n in systems}
    outs, stats = {}, {}
    for run in range(a.warmup + a.runs):
        for name, (mode, lookup) in systems.items():
            rt = Runtime(be, codec, verify_policy="adaptive", prompt_lookup=lookup())  # a fresh policy per run
            t0 = time.perf_counter()
            res = rt.generate(prompts, params, mode)
            if run >= a.warmup:
                times[name].append(time.perf_counter() - t0)
            outs[name], stats[name] = [r.token_ids for r in res], rt.run_stats()
    tokens = a.requests * a.max_new_tokens
    report = {"engine": a.engine, "requests": a.requests, "slots": a.slots, "max_new_tokens": a.max_new_tokens,
              "threads": a.threads, "systems": {}}
    for name in systems:
        tps = [tokens / t for t in times[name]]
        report["systems"][name] = {"tokens_per_s": statistics.median(tps), "runs": tps,
                                   "same_output_as_ar": outs[name] == outs["ar"],
                                   "tau": stats[name].get("tau"), "prompt_lookup": stats[name].get("prompt_lookup")}
        r = report["systems"][name]
        print(f"{name:26s} {r['tokens_per_s']:7.2f} tok/s ({min(tps):.2f}-{max(tps):.2f})  x ar "
              f"{r['tokens_per_s'] / statistics.median([tokens / t for t in times['ar']]):.2f}  "
              f"tau {r['tau'] if r['tau'] is None else round(r['tau'], 3)}  same as ar: {r['same_output_as_ar']}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
