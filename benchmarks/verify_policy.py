"""Verify policies side by side (not a test): tokens/s, tau, verify_hist and draft calls per policy.

    python benchmarks/verify_policy.py --engine BUNDLE [--backend onnxruntime] [--batch-sizes 1,4]
                                       [--max-new-tokens 64] [--prompts 4] [--prompt-len 32] [--threads 2]
    python benchmarks/verify_policy.py --target DIR --drafter DIR ...          (torch backend)
    python benchmarks/verify_policy.py --random-qwen3-0.6b DIR ...  (writes a random-weight Qwen3-0.6B-shaped
        pair there first: hidden 1024, 28 layers, heads 16/8, head_dim 128, MLP 3072, vocab 151936; a
        1-layer drafter, block 16; then runs it on the torch backend)

Systems, all on ONE backend (same caches, same weights), run one after another per batch size:
  ar; <mode>-fixed (the whole block every round); <mode>-adaptive (runtime/verify_policy.py, shared K);
  <mode>-ragged (the adaptive policy with a per-row K, for comparison), for mode in --modes.
Every output is compared with ar's (greedy: they must be equal). Prompts: random token ids (a random-weight
pair has no text worth the name), seeded. At the Qwen3-0.6B shape with random weights (no draft is ever
accepted) the adaptive policy must find that drafting never pays: verify_hist all at K = 0, within a few
percent of ar. On a shared machine read the figures as indicative (ratios within one run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.verify_policy import AdaptivePolicy


def random_qwen3_06b(root: Path) -> tuple[Path, Path]:
    """The Qwen3-0.6B shape with random weights and a random 1-layer drafter with a conditioner (cached)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its sibling benchmarks
    from memory import make_pair

    if (root / "drafter" / "config.json").exists():
        return root / "target", root / "drafter"
    return make_pair(root, "qwen3-0.6b")


def make_policies(block: int) -> dict:
    return {"fixed": lambda: "fixed", "adaptive": lambda: "adaptive",
            "ragged": lambda: AdaptivePolicy(block, ragged=True)}


def run(rt_base: Runtime, policy, prompts, mode: str, batch: int, max_new: int) -> dict:
    rt = Runtime(rt_base.backend, rt_base.codec, block_size=rt_base.block_size, verify_policy=policy,
                 prompt_lookup=False)
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    calls = {"draft": 0}
    inner = rt.backend.draft

    def counted(*a):
        calls["draft"] += 1
        return inner(*a)

    rt.backend.draft = counted
    try:
        outs = []
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(0, len(prompts), batch):
            outs += [r.token_ids for r in rt.generate(prompts[i:i + batch], params, mode)]
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        del rt.backend.draft
    st = rt.run_stats()
    return {"tokens_per_s": sum(len(o) for o in outs) / wall, "wall_s": wall, "cpu_s": cpu, "tau": st["tau"],
            "verify_hist": st["verify_hist"], "rounds": st["rounds"], "draft_calls": calls["draft"],
            "other_share": st["time"]["other_share"], "outputs": outs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine")
    ap.add_argument("--backend", default="onnxruntime")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--random-qwen3-0.6b", dest="random_dir")
    ap.add_argument("--batch-sizes", default="1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--modes", default="dflash")
    ap.add_argument("--policies", default="fixed,adaptive,ragged")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    if a.random_dir:
        a.target, a.drafter = random_qwen3_06b(Path(a.random_dir))
    if a.engine:
        rt = Runtime.from_bundle(a.engine, backend=a.backend, max_batch=max(batches), threads=a.threads,
                                 max_seq_len=a.prompt_len + a.max_new_tokens + 40)
    else:
        rt = Runtime.from_dirs(a.target, a.drafter, max_batch=max(batches), threads=a.threads,
                               max_seq_len=a.prompt_len + a.max_new_tokens + 40)
    V = rt.backend.target_config.vocab_size
    g = torch.Generator().manual_seed(a.seed)
    prompts = [torch.randint(0, V - 1, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    block = rt.block_size or rt.backend.drafter_config.block_size
    policies = make_policies(block)
    rt.generate(prompts[:1], SamplingParams(max_new_tokens=4), "ar")  # warm-up
    rows = []
    for b in batches:
        ar = run(rt, "fixed", prompts, "ar", b, a.max_new_tokens)
        rows.append({"system": "ar", "batch": b, **ar})
        for mode in a.modes.split(","):
            for name in a.policies.split(","):
                r = run(rt, policies[name](), prompts, mode, b, a.max_new_tokens)
                r["equal_to_ar"] = r["outputs"] == ar["outputs"]
                r["vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
                r["vs_ar_cpu"] = ar["cpu_s"] / r["cpu_s"]  # CPU seconds: steadier on a shared machine
                rows.append({"system": f"{mode}-{name}", "batch": b, **r})
    print(f"{'system':18s} {'batch':>5s} {'tok/s':>8s} {'vs ar':>6s} {'cpu vs ar':>9s} {'tau':>5s} "
          f"{'draft calls':>11s} {'rounds':>6s}  verify_hist")
    for r in rows:
        print(f"{r['system']:18s} {r['batch']:5d} {r['tokens_per_s']:8.1f} {r.get('vs_ar', 1.0):6.2f} "
              f"{r.get('vs_ar_cpu', 1.0):9.2f} "
              f"{r['tau'] or 0:5.2f} {r['draft_calls']:11d} {r['rounds']:6d}  {r['verify_hist']}"
              + ("" if r.get("equal_to_ar", True) else "  OUTPUT DIFFERS FROM AR"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in rows], f, indent=1)
    return 0 if all(r.get("equal_to_ar", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
