"""tau per tree source set and fixed budget on a zoo pair, over the prompts `retrace bench` picks (its loader,
--limit), batch 4, T=0, `dflash` mode, every configuration in a fresh runtime. An inflated pair
(`retrace zoo inflate`) gives the same greedy tokens, so the same tau, at the Qwen3 shape: measure it here.

    .venv/bin/python benchmarks/tree_sources_tau.py --zoo /work/artifacts/zoo-small \
        --prompts /tmp/inflated-0.6b/prompts --limit 4 --json docs/bench/zoo-tree-tau-sources-bench4.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from retrace.bench.prompts import load_prompts
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.torch_backend import TorchBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zoo", type=Path, default=Path("/work/artifacts/zoo-small"))
    ap.add_argument("--prompts", default="/work/artifacts/zoo-small/prompts")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--budgets", default="4,8,16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    target, drafter = args.zoo / "target", args.zoo / "drafter"
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    ids = [p.ids for p in load_prompts([args.prompts], TextCodec.find(target), args.limit, vocab, 400)]
    configs = [("chain-fixed", 0, "topk")] + [(f"tree{b}-{s}", int(b), s) for s in ("topk", "topk,suffix,target")
                                              for b in args.budgets.split(",")]
    out, ref = {}, None
    for name, budget, sources in configs:
        be = TorchBackend.from_dirs(target, drafter, max_batch=len(ids), max_seq_len=512)
        rt = Runtime(be, None, verify_policy="fixed", tree_budget=budget, tree_sources=sources)
        res = rt.generate(ids, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True), "dflash")
        tokens = [r.token_ids for r in res]
        ref = ref or tokens
        out[name] = {"tau": round(rt.run_stats()["tau"], 4), "same_as_chain": tokens == ref}
        print(name, out[name], flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
