"""Sampled decoding with and without prompt lookup, one bundle, one process, runs interleaved (not a test).

    python benchmarks/lookup_sampling.py --engine BUNDLE --prompts ZOO/prompts [--limit 16] [--max-new-tokens 96]
        [--batch 1] [--runs 2] [--temperature 0.7 --top-p 0.8 --top-k 20] [--threads 2] [--json F]

`retrace bench` decodes greedily. Production chat samples (Qwen3's suggested settings: temperature 0.7,
top-p 0.8, top-k 20 without thinking), and prompt lookup's copied tokens are then verified by speculative
sampling as point masses (runtime/prompt_lookup.py). This runs the same seeded requests as `ar`, `retrace`
without lookup and `retrace` with lookup first (the runtime's default), each a fresh scheduler on the same
backend, in turns, and reports tokens per second (prefill included, as the bench does), tau and the lookup's
own counts. Outputs differ between systems (each samples with its own draws), so no agreement is checked here:
the distribution tests are tests/test_lookup_sampling.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `retrace` CLI sets it, before torch loads libgomp
import torch  # noqa: E402

from retrace.bench.prompts import load_prompts  # noqa: E402
from retrace.runtime import Runtime, SamplingParams  # noqa: E402
from retrace.runtime.prompt_lookup import PromptLookup  # noqa: E402

SYSTEMS = {"ar": ("ar", False), "retrace": ("retrace", False), "retrace-lookup-first": ("retrace", True)}


def run(base: Runtime, name: str, prompts: list[list[int]], params: dict) -> dict:
    """All prompts queued at once through the backend's slots (--batch)."""
    mode, first = SYSTEMS[name]
    lookup = PromptLookup(first=True) if first else False
    rt = Runtime(base.backend, base.codec, prompt_lookup=lookup)
    sched = rt.scheduler()
    t0 = time.perf_counter()
    reqs = [sched.add(p, SamplingParams(seed=i, **params), mode) for i, p in enumerate(prompts)]
    while sched.has_work:
        sched.step()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) for r in reqs)
    stats = rt.run_stats()
    row = {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "tau": stats.get("tau")}
    if lookup:
        row["lookup"] = lookup.to_dict()
    return row


def run_genai(model, name: str, prompts: list[list[int]], params: dict) -> dict:
    """onnxruntime-genai sampled at the same settings, batch 1, in this process (its own threads: the model
    directory's genai_config.json); `ortgenai-ngram` its n-gram speculation (ngram 4, 2 drafts: what the
    greedy bench's tuning chose on this shape, docs/bench/qwen3-0.6b-int4-intel-2026-12-07.md)."""
    import numpy as np
    import onnxruntime_genai as og

    t0, tokens = time.perf_counter(), 0
    for i, p in enumerate(prompts):
        gp = og.GeneratorParams(model)
        gp.set_search_options(max_length=len(p) + params["max_new_tokens"], do_sample=True, random_seed=i,
                              temperature=params["temperature"], top_p=params["top_p"], top_k=params["top_k"])
        if name == "ortgenai-ngram":
            gp.set_speculative_options(ngram_size=4, max_draft_tokens=2, min_adaptive_k=0)
        gen = og.Generator(model, gp)
        gen.append_tokens(np.array([p], dtype=np.int32))
        while not gen.is_done():
            gen.generate_next_token()
        tokens += len(gen.get_sequence(0)) - len(p)
        del gen
    wall = time.perf_counter() - t0
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "tau": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--genai", help="an onnxruntime-genai model directory: also run ortgenai-ar and -ngram sampled")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    base = Runtime.from_bundle(a.engine, max_batch=a.batch, threads=a.threads)
    prompts = [p.ids for p in load_prompts([a.prompts], base.codec, a.limit)]
    params = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k)
    names = a.systems.split(",")
    genai = None
    if a.genai:
        import onnxruntime_genai as og

        genai = og.Model(a.genai)
        names += ["ortgenai-ar", "ortgenai-ngram"]
    run(base, names[0], prompts[:1], params)  # warm-up
    results: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(a.runs):
        for n in names:
            results[n].append(run_genai(genai, n, prompts, params) if n.startswith("ortgenai")
                              else run(base, n, prompts, params))
            r = results[n][-1]
            print(f"{n:22s} {r['tokens_per_s']:6.1f} tok/s  tau {r['tau'] or 0:.2f}"
                  + (f"  lookup rounds {r['lookup']['rounds']}, accepted {r['lookup']['accepted']} of "
                     f"{r['lookup']['verified']}" if "lookup" in r else ""), flush=True)
    ar = statistics.median(r["tokens_per_s"] for r in results.get("ar", [])) if "ar" in results else None
    summary = {n: {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                   "x_ar": (statistics.median(r["tokens_per_s"] for r in rs) / ar) if ar else None} for n, rs in
               results.items()}
    for n, s in summary.items():
        print(f"{n:22s} median {s['median_tokens_per_s']:.1f} tok/s" + (f" = {s['x_ar']:.2f}x ar" if ar else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": vars(a), "params": params, "runs": results, "summary": summary,
                       "load_avg": os.getloadavg()[0]}, f, indent=1)


if __name__ == "__main__":
    main()
