"""`retrace eval`: acceptance length tau of dflash vs retrace on the same prompts, with paired statistics.

tau per round = accepted drafts + 1 (the bonus). Reported per mode: `tau` = the mean over prompts of each
prompt's tau (per-prompt mean), `tau_pooled` = all accepted tokens / all rounds, and the per-prompt list.
`paired` = the per-prompt differences retrace - dflash: their mean, standard error (sd / sqrt(n)) and n.
Both modes see the same prompts, and at T > 0 the same per-prompt seeds. Greedy outputs of the two modes
must be identical (lossless); `outputs_equal` says whether they were.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from retrace.errors import RetraceError
from retrace.models.drafter import load_pair
from retrace.runtime.device import resolve_dtype
from retrace.runtime.tokenizer import TextCodec
from retrace.train import common as cm
from retrace.train.rollout import make_backend, run_requests


def paired_stats(a: list[float | None], b: list[float | None]) -> dict:
    """Differences b - a over the prompts where both exist: mean, standard error, n."""
    d = [y - x for x, y in zip(a, b, strict=True) if x is not None and y is not None]
    n = len(d)
    if n == 0:
        return {"mean_diff": None, "se": None, "n": 0}
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1)) if n > 1 else 0.0
    return {"mean_diff": round(mean, 5), "se": round(sd / math.sqrt(n), 5), "n": n}


def runtime_tau(target, drafter, prompts, max_new_tokens, mode, device, block_size=None, batch=32,
                temperature=0.0, seed=0) -> dict:
    """Real tau from the runtime loop (greedy): per-prompt mean and pooled."""
    if not prompts:
        return {}
    was = drafter.training
    drafter.eval()
    B = block_size or drafter.config.block_size
    be = make_backend(target, drafter, min(batch, len(prompts)), max(len(p) for p in prompts) + max_new_tokens + B + 2,
                      device)
    outs, sched = run_requests(be, prompts, mode, max_new_tokens, temperature, seed, block_size=B)
    drafter.train(was)
    per = [o.tau for o in outs if o.tau is not None]
    st = sched.stats[mode]
    return {"tau_mean": round(sum(per) / len(per), 4) if per else None, "tau_pooled": round(st.tau or 0.0, 4),
            "n": len(per)}


def tau_by_mode(target, drafter, prompts: list[list[int]], modes=("dflash", "retrace"), max_new_tokens: int = 96,
                temperature: float = 0.0, block_size: int | None = None, max_batch: int = 32, seed: int = 0,
                device="cpu", verify_policy: str = "fixed", tree_budget: int = 0,
                tree_sources: str = "topk,suffix,target") -> dict:
    """Run every mode on the same prompts; returns the JSON-able report (see the module docstring).
    verify_policy "fixed" (the default) verifies the whole block: tau then measures the drafter alone.
    tree_budget > 0: every mode verifies draft trees instead (runtime/draft_tree.py)."""
    if not prompts:
        raise RetraceError("no prompts to evaluate")
    B = block_size or drafter.config.block_size
    if not 2 <= B <= drafter.config.block_size:
        raise RetraceError(f"block size {B} must be in 2..{drafter.config.block_size} (the drafter's block_size)")
    if "retrace" in modes and drafter.conditioner is None:
        raise RetraceError("mode 'retrace' needs a ReTrace conditioner beside the drafter")
    was = drafter.training
    drafter.eval()
    max_len = max(len(p) for p in prompts) + max_new_tokens + max(B, tree_budget) + 2
    out: dict = {"modes": {}}
    outputs = {}
    for mode in modes:
        be = make_backend(target, drafter, min(max_batch, len(prompts)), max_len, device)
        t0 = time.perf_counter()
        rolls, sched = run_requests(be, prompts, mode, max_new_tokens, temperature, seed, block_size=B,
                                    verify_policy=verify_policy, tree_budget=tree_budget,
                                    tree_sources=tree_sources)
        wall = time.perf_counter() - t0
        per = [None if r.tau is None else round(r.tau, 5) for r in rolls]
        vals = [t for t in per if t is not None]
        st = sched.stats[mode]
        out["modes"][mode] = {
            "tau": round(sum(vals) / len(vals), 5) if vals else None,
            "tau_pooled": round(st.tau, 5) if st.tau is not None else None,
            "per_prompt": per, "rounds": st.rounds, "tokens": st.tokens,
            "accepted_hist": list(st.accepted_hist), "verify_hist": list(st.verify_hist), "wall_s": round(wall, 3),
        }
        outputs[mode] = [r.output_ids for r in rolls]
    drafter.train(was)
    if "dflash" in modes and "retrace" in modes:
        out["paired"] = paired_stats(out["modes"]["dflash"]["per_prompt"], out["modes"]["retrace"]["per_prompt"])
        base = out["modes"]["dflash"]["tau"]
        if base and out["paired"]["mean_diff"] is not None:
            out["paired"]["rel_gain"] = round(out["paired"]["mean_diff"] / base, 5)
    if temperature == 0 and len(outputs) > 1:
        first = next(iter(outputs.values()))
        out["outputs_equal"] = all(o == first for o in outputs.values())
    out["tau_kind"] = "tau = per-prompt mean; tau_pooled = accepted tokens / rounds over all prompts"
    out["settings"] = {"n_prompts": len(prompts), "max_new_tokens": max_new_tokens, "temperature": temperature,
                       "block_size": B, "seed": seed, "max_batch": max_batch, "verify_policy": verify_policy,
                       **({"tree_budget": tree_budget, "tree_sources": tree_sources} if tree_budget else {})}
    return out


def tau_worker(target_dir: str, drafter_dir: str, prompts: list[list[int]], modes, max_new_tokens: int,
               temperature: float, block_size: int | None, max_batch: int, seed: int) -> dict:
    """tau_by_mode in a worker process (loads the pair itself; CPU)."""
    target, drafter = load_pair(target_dir, drafter_dir)
    return tau_by_mode(target, drafter, prompts, tuple(modes), max_new_tokens, temperature, block_size, max_batch, seed)


def evaluate(target_dir: str | Path, drafter_dir: str | Path, prompts_files: list[str | Path], max_new_tokens: int = 96,
             temperature: float = 0.0, block_size: int | None = None, modes=("dflash", "retrace"), max_batch: int = 32,
             seed: int = 0, limit: int | None = None, threads: int | None = None, device: str = "cpu",
             verify_policy: str = "fixed", tree_budget: int = 0, tree_sources: str = "topk,suffix,target",
             dtype: str = "float32") -> dict:
    """Load the pair, read prompts (JSONL: 'prompt' text or 'prompt_ids'), report tau (see tau_by_mode)."""
    dev = cm.resolve_device(device)
    with cm.torch_threads(threads):
        target, drafter = load_pair(target_dir, drafter_dir, dtype=resolve_dtype(dtype), device=dev)
        codec = TextCodec.find(target_dir)
        rows = []
        for f in prompts_files:
            rows += cm.read_prompts_jsonl(f)
        if limit:
            rows = rows[:limit]
        prompts = cm.encode_prompts(rows, codec)
        rep = tau_by_mode(target, drafter, prompts, modes, max_new_tokens, temperature, block_size, max_batch, seed,
                          dev, verify_policy, tree_budget, tree_sources)
    domains = [r.get("domain") for r in rows]
    if any(domains):
        rep["by_domain"] = {}
        for dom in sorted({d for d in domains if d}):
            ix = [i for i, d in enumerate(domains) if d == dom]
            entry = {}
            for m, v in rep["modes"].items():
                vals = [v["per_prompt"][i] for i in ix if v["per_prompt"][i] is not None]
                entry[m] = round(sum(vals) / len(vals), 5) if vals else None
            if "paired" in rep:
                entry["paired"] = paired_stats([rep["modes"]["dflash"]["per_prompt"][i] for i in ix],
                                               [rep["modes"]["retrace"]["per_prompt"][i] for i in ix])
            rep["by_domain"][dom] = entry
    rep["settings"]["prompts_files"] = [str(f) for f in prompts_files]
    return rep


def format_report(rep: dict) -> str:
    lines = [f"tau (per-prompt mean; pooled in brackets) over {rep['settings']['n_prompts']} prompts, "
             f"T={rep['settings']['temperature']}, B={rep['settings']['block_size']}, "
             f"{rep['settings']['max_new_tokens']} new tokens:"]
    for m, v in rep["modes"].items():
        lines.append(f"  {m:8s} {v['tau']:.3f}  [{v['tau_pooled']:.3f}]  ({v['rounds']} rounds, {v['wall_s']:.1f}s)")
    if "paired" in rep and rep["paired"]["n"]:
        p = rep["paired"]
        lines.append(f"  retrace - dflash: {p['mean_diff']:+.3f} +- {p['se']:.3f} (paired SE, n={p['n']}, "
                     f"{100 * p.get('rel_gain', 0):+.1f}%)")
    for dom, e in rep.get("by_domain", {}).items():
        parts = [f"{m} {e[m]:.3f}" for m in rep["modes"] if e.get(m) is not None]
        if "paired" in e and e["paired"]["n"]:
            parts.append(f"diff {e['paired']['mean_diff']:+.3f} +- {e['paired']['se']:.3f}")
        lines.append(f"  [{dom}] " + ", ".join(parts))
    if "outputs_equal" in rep:
        lines.append(f"  greedy outputs identical across modes: {rep['outputs_equal']}")
    return "\n".join(lines)


__all__ = ["evaluate", "runtime_tau", "tau_by_mode", "paired_stats", "format_report"]
