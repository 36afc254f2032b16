"""A long prompt joining a running request, with and without chunked prefill (not a test): one request decodes
while a long prompt arrives; per variant, the running request's longest gap between two tokens, the long
request's time to first token, and the wall time until both finish. Each variant in a fresh scheduler over the
same bundle, interleaved over --runs.

    python benchmarks/prefill_chunks.py --engine BUNDLE --prompts ZOO/prompts --long 400 --chunks none,64,128 \
        [--mode ar] [--new 64] [--threads 2] [--runs 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def scenario(rt, short, long, new: int, mode: str, join_after: int = 8) -> dict:
    from retrace.runtime import SamplingParams

    sched = rt.scheduler()
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    a = sched.add(short, params, mode)
    while len(a.output_ids) < join_after:
        sched.step()
    t0 = time.perf_counter()
    b = sched.add(long, params, mode)
    last, gaps, ttft = t0, [], None
    while sched.has_work:
        n = len(a.output_ids)
        sched.step()
        now = time.perf_counter()
        if len(a.output_ids) > n:  # the running request's gaps, until it finishes
            gaps.append(now - last)
            last = now
        if ttft is None and b.output_ids:
            ttft = now - t0
    return {"max_gap_ms": 1e3 * max(gaps), "median_gap_ms": 1e3 * statistics.median(gaps), "ttft_ms": 1e3 * ttft,
            "wall_ms": 1e3 * (time.perf_counter() - t0), "tokens": [list(a.output_ids), list(b.output_ids)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", required=True, help="a zoo's prompts folder (its tokens make the prompts)")
    ap.add_argument("--long", type=int, default=400, help="tokens of the joining prompt")
    ap.add_argument("--chunks", default="none,64,128")
    ap.add_argument("--mode", default="ar")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from retrace.runtime import Runtime
    from retrace.train.datasets_io import plain_prompts, read_rows

    rts = {c: Runtime.from_bundle(a.engine, max_batch=2, threads=a.threads,
                                  prefill_chunk=None if c == "none" else int(c)) for c in a.chunks.split(",")}
    codec = next(iter(rts.values())).codec
    ids = [t for p in plain_prompts([r for f in sorted(Path(a.prompts).glob("*.jsonl")) for r in read_rows(f)],
                                    codec) for t in p]
    short, long = ids[:32], ids[32:32 + a.long]
    out = {c: [] for c in rts}
    for _ in range(a.runs):
        for c, rt in rts.items():
            out[c].append(scenario(rt, short, long, a.new, a.mode))
    ref = out[next(iter(out))][0]["tokens"]
    result = {"engine": a.engine, "long": a.long, "mode": a.mode, "new": a.new, "threads": a.threads, "variants": {}}
    for c, runs in out.items():
        same = all(r["tokens"] == ref for r in runs)
        row = {k: [round(r[k], 1) for r in runs] for k in ("max_gap_ms", "median_gap_ms", "ttft_ms", "wall_ms")}
        result["variants"][c] = {**row, "same_tokens": same}
        print(f"chunk {c:>5}: running request's longest gap {row['max_gap_ms']} ms (median {row['median_gap_ms']}), "
              f"long prompt's first token {row['ttft_ms']} ms, both done {row['wall_ms']} ms, same tokens {same}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
