"""tau of tree verification against the chain at equal verify tokens per round (issue 14), per prompt and
paired, with per-source acceptance counts. Greedy (T=0): every configuration's output must be the same
(--temperature 1: seeded sampling, tau still paired per prompt).

    .venv/bin/python benchmarks/tree_tau.py --zoo /work/artifacts/zoo-small --limit 64 --max-new-tokens 64 \
        --json /tmp/tree_tau.json

Configurations: chain (the whole block, B tokens a round: the fixed verify policy) and trees of --budget
nodes (default B, the chain's verify tokens) from each --trees source set. Paired statistics are against the
chain and against the `topk` tree (retrace.train.evaluate.paired_stats: mean per-prompt difference, its
standard error, t = mean / se). Source counts: tree nodes whose parent was accepted (tries), those
accepted, per source (a node several sources proposed counts for each), and the accepted ones no other
source proposed (accepted_only).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.prompts import read_prompts_jsonl
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.torch_backend import TorchBackend
from retrace.train.evaluate import paired_stats


def load_prompts(zoo: Path, limit: int, codec: TextCodec) -> list[list[int]]:
    files = sorted((zoo / "prompts").glob("*.jsonl"))
    per_file = [read_prompts_jsonl(f) for f in files]
    rows = [r for group in zip(*per_file, strict=False) for r in group][:limit]  # round-robin over domains
    return [[int(t) for t in r["prompt_ids"]] if "prompt_ids" in r else codec.encode(r["prompt"]) for r in rows]


def run_config(zoo: Path, prompts, mode: str, budget: int, sources: str, max_new: int, max_batch: int,
               temperature: float, policy: str = "fixed") -> dict:
    max_len = max(len(p) for p in prompts) + max_new + max(budget, 16) + 2
    be = TorchBackend.from_dirs(zoo / "target", zoo / "drafter", max_batch=max_batch, max_seq_len=max_len)
    rt = Runtime(be, None, verify_policy=policy, tree_budget=budget, tree_sources=sources, prompt_lookup=False)
    t0 = time.perf_counter()
    res = rt.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=temperature, seed=0,
                                              ignore_eos=True), mode)
    wall = time.perf_counter() - t0
    st = rt.run_stats()
    return {"tau": st["tau"], "per_prompt": [r.stats["tau"] for r in res], "rounds": st["rounds"],
            "tokens": st["tokens"], "wall_s": round(wall, 2), "tokens_per_s": round(st["tokens"] / wall, 1),
            "accepted_hist": st["accepted_hist"],
            "tree": st.get("tree"), "outputs": [r.token_ids for r in res]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zoo", type=Path, default=Path("/work/artifacts/zoo-small"))
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=0, help="tree nodes per row (default: the drafter's block)")
    ap.add_argument("--trees", default="topk;topk,suffix;topk,target;topk,suffix,target",
                    help="source sets separated by ';'")
    ap.add_argument("--modes", default="retrace,dflash")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.0, help="T > 0: sampled (seeded) outputs differ")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chain-policy", default="fixed",
                    help="verify policy of the chain (fixed: B tokens a round, the equal-verify-tokens baseline; "
                         "adaptive: the fastest chain, for tokens/s)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    codec = TextCodec.find(args.zoo / "target")
    prompts = load_prompts(args.zoo, args.limit, codec)
    block = json.loads((args.zoo / "drafter" / "config.json").read_text()).get("block_size", 16)
    budget = args.budget or block
    report = {"settings": {"zoo": str(args.zoo), "n_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                           "budget": budget, "block_size": block, "temperature": args.temperature,
                           "max_batch": args.max_batch,
                           "threads": args.threads, "chain_policy": args.chain_policy}, "modes": {}}
    for mode in args.modes.split(","):
        configs = {"chain": run_config(args.zoo, prompts, mode, 0, "topk", args.max_new_tokens, args.max_batch,
                                       args.temperature, args.chain_policy)}
        for sources in args.trees.split(";"):
            configs[f"tree:{sources}"] = run_config(args.zoo, prompts, mode, budget, sources, args.max_new_tokens,
                                                    args.max_batch, args.temperature)
        first = configs["chain"]["outputs"]
        same = all(c["outputs"] == first for c in configs.values())
        out = {"outputs_equal": same if args.temperature == 0 else None, "configs": {}, "paired": {}}
        for name, c in configs.items():
            out["configs"][name] = {k: v for k, v in c.items() if k != "outputs"}
        chain = configs["chain"]["per_prompt"]
        for name, c in configs.items():
            if name == "chain":
                continue
            for base_name in ("chain", "tree:topk"):
                if base_name == name or base_name not in configs:
                    continue
                p = paired_stats(configs[base_name]["per_prompt"], c["per_prompt"])
                p["t"] = round(p["mean_diff"] / p["se"], 2) if p["se"] else None
                base_tau = sum(configs[base_name]["per_prompt"]) / len(chain)
                p["ratio"] = round(sum(c["per_prompt"]) / len(chain) / base_tau, 4)
                out["paired"][f"{name} vs {base_name}"] = p
        report["modes"][mode] = out
        print(mode, "outputs_equal", out["outputs_equal"])
        for name, c in out["configs"].items():
            counts = c["tree"]["source_counts"] if c["tree"] else ""
            print(f"  {name:28s} tau {c['tau']:.3f}  wall {c['wall_s']:.1f}s  {c['tokens_per_s']} tok/s  {counts}")
        for name, p in out["paired"].items():
            print(f"  {name:42s} diff {p['mean_diff']:+.3f} se {p['se']:.3f} t {p['t']} ratio {p['ratio']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
