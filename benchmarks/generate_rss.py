"""Peak RSS of one process that loads one system and generates (not a test).

    python benchmarks/generate_rss.py --write-prompt-ids IDS --prompts ZOO/prompts --tokenizer ZOO/target [--limit 4]
    python benchmarks/generate_rss.py --bundle BUNDLE --prompt-ids IDS [--mode ar|dflash|retrace] [--max-batch 1]
    python benchmarks/generate_rss.py --genai GENAI_RUN_DIR --prompt-ids IDS
        [--max-new-tokens 96] [--threads 2] [--json F]

Run it once per system, each in its own process (a process's peak never goes down): what a user's process
holds after loading the system and after generating the prompts one at a time, greedy, `--max-new-tokens`
each (ignore EOS). It reports the peak (`ru_maxrss`) after load and at the end, and the resident set by mapping
kind at the end (/proc/self/smaps: heap and anonymous maps, the model files' pages, shared libraries), so a
difference between two systems can be told apart: the model's memory, the caches, or the libraries a
runtime loads (torch's alone: ~0.21 GB resident after `import torch`). The onnxruntime-genai process imports
neither torch nor retrace (both would count): GENAI_RUN_DIR is a model directory as the bench runs it, its
config at the thread count (the bench cache's per-thread copy, CACHE/genai-*/threads2), and the prompts come
as token ids written beforehand (--write-prompt-ids).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import time


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux


def resident_by_kind() -> dict[str, float]:
    """GB resident now, by mapping: heap + anonymous, each mapped file (model data), shared libraries."""
    kinds: collections.Counter = collections.Counter()
    name = ""
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's first line
                path = head[5] if len(head) > 5 else ""
                name = ("libraries" if ".so" in path else "heap and anonymous" if not path or path.startswith("[")
                        else path)
            elif head[0] == "Rss:":
                kinds[name] += int(head[1]) / 1e6
    return {k: round(v, 3) for k, v in kinds.most_common() if v >= 0.001}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    system = ap.add_mutually_exclusive_group(required=True)
    system.add_argument("--bundle")
    system.add_argument("--genai")
    system.add_argument("--write-prompt-ids", metavar="IDS", help="write the prompts' token ids (JSON) and stop")
    ap.add_argument("--prompt-ids", metavar="IDS")
    ap.add_argument("--prompts", help="with --write-prompt-ids")
    ap.add_argument("--tokenizer", help="with --write-prompt-ids: a directory with the target's tokenizer.json")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--mode", default="ar")
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `retrace` CLI sets it
    if a.write_prompt_ids:
        if not (a.prompts and a.tokenizer):
            ap.error("--write-prompt-ids needs --prompts and --tokenizer")
        from retrace.bench.prompts import load_prompts
        from retrace.runtime.tokenizer import TextCodec

        ids = [p.ids for p in load_prompts([a.prompts], TextCodec.find(a.tokenizer), a.limit)]
        with open(a.write_prompt_ids, "w") as f:
            json.dump(ids, f)
        return
    if not a.prompt_ids:
        ap.error("--bundle / --genai need --prompt-ids (written by --write-prompt-ids)")
    with open(a.prompt_ids) as f:
        prompts = json.load(f)
    base = peak_gb()  # the interpreter and this script's imports
    t0 = time.perf_counter()
    if a.genai:
        import numpy as np
        import onnxruntime_genai as og

        model = og.Model(a.genai)
        loaded = peak_gb()
        for p in prompts:
            params = og.GeneratorParams(model)
            params.set_search_options(max_length=len(p) + a.max_new_tokens, do_sample=False)
            gen = og.Generator(model, params)
            gen.append_tokens(np.array([p], dtype=np.int32))
            while not gen.is_done():
                gen.generate_next_token()
            del gen
        system = f"onnxruntime-genai {a.genai}"
    else:
        from retrace.runtime import Runtime, SamplingParams

        # as `retrace generate` loads it: the drafter's session only for a mode that drafts
        rt = Runtime.from_bundle(a.bundle, max_batch=a.max_batch, threads=a.threads, lazy_drafter=a.mode == "ar")
        loaded = peak_gb()
        for p in prompts:
            rt.generate([p], SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True), a.mode)
        system = f"retrace {a.mode} {a.bundle}"
    out = {"system": system, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
           "peak_gb_before_load": round(base, 3), "peak_gb_after_load": round(loaded, 3),
           "peak_gb": round(peak_gb(), 3), "resident_gb_at_end": resident_by_kind(),
           "wall_s": round(time.perf_counter() - t0, 2)}
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
