"""The results of a benchmark run (`assemble`: the JSON document) and what is derived from the timed runs:
tokens/s medians and spreads, tau (tokens per round) pooled, per prompt and per domain, acceptance histograms,
where the time went, agreement of greedy outputs with the reference (a sampled run compares none), fidelity of our
dflash mode against transformers' DFlash (greedy runs), ratios against every peer, the round analysis and the
goals."""

from __future__ import annotations

import statistics

from retrace.bench.config import GOALS, HEADLINE, PEERS, BenchConfig
from retrace.bench.decoding import Decoding
from retrace.bench.lineup import Built
from retrace.bench.precision import of_name, width_of
from retrace.bench.prompts import BenchPrompt
from retrace.bench.systems import RunOut


def _spread(xs: list[float]) -> dict:
    med = statistics.median(xs)
    return {"min": min(xs), "max": max(xs), "rel_range": (max(xs) - min(xs)) / med if med else None}


def _tau(accepted: list[list[int]] | None) -> tuple[float | None, int]:
    if not accepted:
        return None, 0
    rounds = sum(len(a) for a in accepted)
    if not rounds:
        return None, 0
    return sum(x + 1 for a in accepted for x in a) / rounds, rounds


def per_prompt_tau(accepted: list[list[int]] | None) -> dict:
    """tau of each prompt (its own tokens per round) and their mean and median: {} without round counts."""
    per = [t for t in (_tau([a])[0] for a in accepted or []) if t is not None]
    if not per:
        return {}
    return {"tau_per_prompt": per, "tau_prompt_mean": statistics.fmean(per),
            "tau_prompt_median": statistics.median(per)}


def _hist(accepted: list[list[int]]) -> list[int]:
    h: list[int] = []
    for a in accepted:
        for x in a:
            if x >= len(h):
                h.extend([0] * (x + 1 - len(h)))
            h[x] += 1
    return h


def _time_split(rs: list[RunOut]) -> dict | None:
    if not rs or rs[0].time is None:
        return None
    keys = rs[0].time.keys()
    mean = {k: statistics.fmean(r.time[k] for r in rs) for k in keys}
    w = mean["wall_s"] or 1e-12
    for k in ("prefill", "draft", "verify", "other"):
        mean[f"{k}_share"] = mean[f"{k}_s"] / w
    mean["forward_share"] = mean["forward_s"] / w
    mean["outside_forward_share"] = mean["outside_forward_s"] / w
    mean["target_ms_per_call"] = (1000 * mean["target_forward_s"] / mean["target_calls"] if mean["target_calls"]
                                  else None)
    mean["draft_ms_per_call"] = 1000 * mean["draft_forward_s"] / mean["draft_calls"] if mean["draft_calls"] else None
    return mean


def _compare(outputs: list[list[int]], ref: list[list[int]]) -> dict:
    bad = []
    for i, (o, r) in enumerate(zip(outputs, ref, strict=True)):
        if o != r:
            first = next((j for j, (x, y) in enumerate(zip(o, r, strict=False)) if x != y), min(len(o), len(r)))
            bad.append({"prompt": i, "first_divergence": first})
    return {"prompts_mismatched": len(bad), "mismatches": bad}


def assemble(cfg: BenchConfig, built: Built, runs: dict, prompts: list[BenchPrompt], batch_sizes, machine: dict,
             threads: int) -> dict:
    N = cfg.max_new_tokens
    expected = N * len(prompts)
    decoding = Decoding.of(cfg)
    ref_key = ("hf-ar", 1) if ("hf-ar", 1) in runs else next(iter(runs))
    ref = runs[ref_key][0].outputs

    systems: list[dict] = []
    for b in batch_sizes:
        for s in built.systems:
            entry = {"name": s.name, "family": s.family, "backend": s.backend, "mode": s.mode, "batch_size": b,
                     "env": getattr(s, "env", None), "settings": getattr(s, "settings", None)}
            why = s.supports(b)
            if why is not None:
                systems.append({**entry, "status": "n/a", "reason": why, "tokens_per_s": None,
                                "tokens_per_s_runs": [], "tau": None, "time_split": None})
                continue
            rs = runs[(s.name, b)]
            tps = [sum(len(o) for o in r.outputs) / r.wall_s for r in rs]
            tau, rounds = _tau(rs[0].accepted)
            spec = rs[0].stats
            if spec is not None:  # onnxruntime-genai's own count: tokens emitted per speculative round
                tau, rounds = spec["tokens_per_round"], spec["rounds"]
            lengths_ok = all(len(o) == N for r in rs for o in r.outputs)
            stable = all(r.outputs == rs[0].outputs for r in rs[1:])
            systems.append({
                **entry, "status": "ok",
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_runs": tps,
                "spread": _spread(tps),
                "wall_s_runs": [r.wall_s for r in rs],
                "tokens_per_run": sum(len(o) for o in rs[0].outputs),
                "tau": tau,  # pooled: tokens per round over every prompt's rounds
                **per_prompt_tau(rs[0].accepted),
                "rounds": rounds if rs[0].accepted is not None or spec is not None else None,
                "speculative_stats": spec,
                "accepted_hist": _hist(rs[0].accepted) if rs[0].accepted is not None else None,
                "verify_hist": rs[0].verify_hist,
                "time_split": _time_split(rs),
                "exact_length": lengths_ok,
                "deterministic_across_runs": stable,
                "agreement": ({"reference": f"{ref_key[0]}@b{ref_key[1]}", **_compare(rs[0].outputs, ref)}
                              if decoding.greedy else None),  # sampled: each system draws its own tokens
            })
        for sk in built.skipped:
            systems.append({"name": sk["name"], "family": "retrace" if sk["name"].startswith("retrace-") else "peer",
                            "backend": None, "mode": None, "batch_size": b, "status": "skipped",
                            "reason": sk["reason"], "tokens_per_s": None, "tokens_per_s_runs": [], "tau": None,
                            "time_split": None})

    results = {
        "command": cfg.command,
        "config": {"target": str(cfg.target), "drafter": str(cfg.drafter), "engine": cfg.engine,
                   "prompts": [str(p) for p in cfg.prompts], "n_prompts": len(prompts),
                   "prompt_tokens": [len(p.ids) for p in prompts],
                   "truncated_prompts": sum(p.truncated > 0 for p in prompts),
                   "max_new_tokens": N, "batch_sizes": list(batch_sizes), "runs": cfg.runs, "threads": threads,
                   "block_size": built.block_size, "row_invariant": cfg.row_invariant,
                   **({"drafter_weights": cfg.drafter_weights} if cfg.drafter_weights else {}),
                   "greedy": decoding.greedy, "decoding": decoding.to_dict(), "decoding_text": decoding.describe(),
                   "eos": "ignored by every system (exactly max_new_tokens each)",
                   "expected_tokens_per_run": expected},
        "machine": machine,
        "builds": built.builds,
        "systems": systems,
        "skipped": built.skipped,
    }
    results["ratios"] = ratios(systems)
    results["agreement"] = agreement_summary(systems) if decoding.greedy else {
        "sampled": True, "checked": 0,
        "note": "sampled: every system draws its own tokens, so outputs are not compared; that speculative sampling "
                "keeps the target's distribution is checked by the test suite's chi-square tests"}
    results["fidelity"] = (fidelity(runs, N) if decoding.greedy and ("hf-dflash", 1) in runs and (FIDELITY, 1) in runs
                           else None)
    results["per_domain"] = per_domain(runs, prompts)
    results["goals"] = goals(systems, results["ratios"])
    results["analysis"] = round_analysis(systems, len(prompts))
    results["per_prompt"] = [{"source": p.source, "domain": p.domain, "prompt_tokens": len(p.ids)} for p in prompts]
    return results


FASTEST_PEER = "fastest-peer"


def ratios(systems: list[dict]) -> list[dict]:
    """tokens/s of every retrace configuration over every peer at the same batch size and weight precision
    (the peer's name with the system's precision suffix, retrace.bench.precision; None where n/a), and over
    the fastest peer system that ran at that batch size and weight width, whoever it is (peer FASTEST_PEER,
    its name in `peer_name`: onnxruntime-genai's or llama.cpp's modes alike)."""
    ok = {(s["name"], s["batch_size"]): s for s in systems if s["status"] == "ok"}
    fastest: dict[tuple[int, str], dict] = {}
    for s in ok.values():
        key = (s["batch_size"], width_of(s["name"]))
        if s["family"] != "retrace" and s["tokens_per_s"] and (
                key not in fastest or s["tokens_per_s"] > fastest[key]["tokens_per_s"]):
            fastest[key] = s
    out = []
    for s in systems:
        if s["family"] != "retrace" or s["status"] != "ok":
            continue
        for peer in PEERS:
            p = ok.get((peer + of_name(s["name"]), s["batch_size"]))
            out.append({"system": s["name"], "batch_size": s["batch_size"], "peer": peer,
                        "ratio": s["tokens_per_s"] / p["tokens_per_s"] if p and p["tokens_per_s"] else None})
        f = fastest.get((s["batch_size"], width_of(s["name"])))
        out.append({"system": s["name"], "batch_size": s["batch_size"], "peer": FASTEST_PEER,
                    "peer_name": f["name"] if f else None,
                    "ratio": s["tokens_per_s"] / f["tokens_per_s"] if f else None})
    return out


def agreement_summary(systems: list[dict]) -> dict:
    ok = [s for s in systems if s["status"] == "ok"]
    return {
        "reference": ok[0]["agreement"]["reference"] if ok else None,
        "checked": len(ok),
        "mismatched_prompts": {f"{s['name']}@b{s['batch_size']}": s["agreement"]["prompts_mismatched"] for s in ok},
        "total_mismatched_prompts": sum(s["agreement"]["prompts_mismatched"] for s in ok),
        "all_exact_length": all(s["exact_length"] for s in ok),
        "note": "greedy outputs compared token for token with the reference; fp32 kernels that sum in a different "
                "order can flip a near-tie argmax, after which the continuations differ (counted, not fatal)",
    }


def _committed(acc: list[int], n: int) -> list[int]:
    """Per-round accepted lengths as tokens kept: the final round is cut to what max_new_tokens allowed."""
    if not acc:
        return []
    out = list(acc)
    kept_before = sum(a + 1 for a in out[:-1])
    out[-1] = (n - 1 - kept_before) - 1
    return out


FIDELITY = "retrace-torch-dflash-fixed"  # whole blocks, like transformers' DFlash


def fidelity(runs: dict, n: int) -> dict:
    """Our dflash mode (the fixed verify policy) against transformers' DFlash on the same weights, T=0,
    batch 1."""
    ours = runs[(FIDELITY, 1)][0]
    hf = runs[("hf-dflash", 1)][0]
    tau_ours, rounds_ours = _tau(ours.accepted)
    tau_hf, rounds_hf = _tau(hf.accepted)
    committed = [_committed(a, n) for a in ours.accepted]
    tau_ours_kept, _ = _tau(committed)
    same_prompts = sum(c == h for c, h in zip(committed, hf.accepted, strict=True))
    diverged = []
    for i, (c, h) in enumerate(zip(committed, hf.accepted, strict=True)):
        if c != h:
            j = next((k for k, (x, y) in enumerate(zip(c, h, strict=False)) if x != y), min(len(c), len(h)))
            diverged.append({"prompt": i, "first_round": j, "ours": c[j:j + 3], "hf": h[j:j + 3]})
    truncated = sum(1 for a, c in zip(ours.accepted, committed, strict=True) if a and a[-1] != c[-1])
    outputs_equal = ours.outputs == hf.outputs
    rel = (tau_ours / tau_hf - 1.0) if tau_ours and tau_hf else None
    rel_kept = (tau_ours_kept / tau_hf - 1.0) if tau_ours_kept and tau_hf else None
    why = []
    if truncated:
        why.append(f"in {truncated} of {len(committed)} prompts the final round accepted more drafts than "
                   "max_new_tokens let it keep: the runtime's tau counts that round's full accepted length "
                   "(a+1), transformers' hook counts only the tokens kept; counted the same way (tokens kept "
                   f"per round) ours is {tau_ours_kept:.4f}")
    why.append("the prefill is not a round in either count (transformers' first hook call, num_matches=0 after "
               "the prefill, is excluded); counting it would give n/(rounds+1) instead of (n-1)/rounds")
    if diverged:
        why.append(f"{len(diverged)} prompts' per-round acceptance differs: fp32 drafter logits computed by "
                   "different kernels flip a near-tie draft argmax; after the first such round the blocks start "
                   "at different positions, so later rounds differ too"
                   + ("" if outputs_equal else "; the outputs differ as well (target numerics, see agreement)"))
    else:
        why.append(f"per-round acceptance is identical on all {len(committed)} prompts ({rounds_hf} rounds)")
    return {
        "tau_ours": tau_ours, "tau_hf": tau_hf, "tau_ours_tokens_kept": tau_ours_kept,
        "rounds_ours": rounds_ours, "rounds_hf": rounds_hf,
        "rel_gap": rel, "rel_gap_tokens_kept": rel_kept,
        "within_1pct": rel is not None and abs(rel) <= 0.01,
        "prompts_identical_rounds": same_prompts, "prompts": len(committed),
        "diverged": diverged[:10], "outputs_equal": outputs_equal,
        "explanation": "; ".join(why),
    }


def per_domain(runs: dict, prompts: list[BenchPrompt]) -> dict:
    """tau per prompt domain at batch 1 for every drafting system: pooled (tokens per round over all the
    domain's rounds) and the mean of per-prompt taus."""
    out: dict = {}
    domains = sorted({p.domain for p in prompts})
    for (name, b), rs in runs.items():
        if b != 1 or not rs or rs[0].accepted is None:
            continue
        d_out = {}
        for d in domains:
            acc = [a for a, p in zip(rs[0].accepted, prompts, strict=True) if p.domain == d]
            pooled, rounds = _tau(acc)
            per = [t for t in (_tau([a])[0] for a in acc) if t is not None]
            d_out[d] = {"tau_pooled": pooled, "tau_prompt_mean": statistics.fmean(per) if per else None,
                        "rounds": rounds, "prompts": len(acc)}
        out[name] = d_out
    return out


def round_analysis(systems: list[dict], n_prompts: int) -> list[dict]:
    """Where a round's time goes, per drafting system, against the fastest autoregressive peer at the same
    batch size. With r = our tokens/s over the peer's, t_round the wall time of one (batched) verify round
    and t_fwd its time inside the two forwards: r with zero loop overhead would be r x t_round / t_fwd, and
    the goal needs tau x goal / r at this round cost, or a round of t_round x r / goal at this tau."""
    ok = {(s["name"], s["batch_size"]): s for s in systems if s["status"] == "ok"}
    out = []
    for (name, b), s in ok.items():
        ts = s.get("time_split")
        if s["family"] != "retrace" or s["mode"] == "ar" or not ts or not s.get("tau"):
            continue
        peer = ok.get(("ortgenai-ar", b)) or ok.get(("hf-ar", b))
        if peer is None:
            continue
        rounds = ts["target_calls"] - -(-n_prompts // b)  # verify calls = target calls - one prefill per chunk
        if rounds <= 0:
            continue
        t_round = 1000 * ts["wall_s"] / rounds
        t_fwd = 1000 * (ts["target_forward_s"] + ts["draft_forward_s"]) / rounds
        r = s["tokens_per_s"] / peer["tokens_per_s"]
        goal = GOALS["vs_ortgenai_ar"] if peer["name"] == "ortgenai-ar" else 1.0
        t_peer = 1000 * b / peer["tokens_per_s"]  # ms per peer step of b tokens
        out.append({
            "system": name, "batch_size": b, "peer": peer["name"], "tau": s["tau"], "ratio": r,
            "peer_ms_per_step": t_peer, "round_ms": t_round, "rounds": rounds,
            "verify_ms": ts.get("target_ms_per_call"), "draft_ms": ts.get("draft_ms_per_call"),
            "outside_forward_ms_per_round": t_round - t_fwd,
            "verify_over_peer_step": ts["target_ms_per_call"] / t_peer if ts.get("target_ms_per_call") else None,
            "ratio_bound_zero_overhead": r * t_round / t_fwd if t_fwd else None,
            "goal": goal, "tau_needed_for_goal": s["tau"] * goal / r,
            "round_ms_needed_for_goal": t_round * r / goal,
        })
    return out


def goals(systems: list[dict], rat: list[dict]) -> dict:
    ok = {(s["name"], s["batch_size"]): s for s in systems if s["status"] == "ok"}
    head = (HEADLINE if (HEADLINE, 1) in ok
            else ("retrace-torch-retrace" if ("retrace-torch-retrace", 1) in ok else None))
    res: dict = {"system": head, "targets": GOALS}
    if head is None:
        return res

    def r(peer: str, b: int) -> float | None:
        return next((x["ratio"] for x in rat if x["system"] == head and x["peer"] == peer and x["batch_size"] == b),
                    None)

    checks = []
    for b in sorted({k[1] for k in ok}):
        for peer, key in (("ortgenai-ar", "vs_ortgenai_ar"), ("hf-dflash", "vs_hf_dflash")):
            x = r(peer, b)
            if x is not None:
                checks.append({"what": f"{head} / {peer} at batch {b}", "value": x, "goal": GOALS[key],
                               "met": x >= GOALS[key], "shortfall": None if x >= GOALS[key] else GOALS[key] / x})
    for (name, b), s in ok.items():
        ts = s.get("time_split")
        if s["family"] == "retrace" and ts:
            x = ts["outside_forward_share"]
            checks.append({"what": f"time outside model forwards, {name} at batch {b}", "value": x,
                           "goal": GOALS["max_outside_forward_share"], "met": x <= GOALS["max_outside_forward_share"],
                           "shortfall": None if x <= GOALS["max_outside_forward_share"]
                           else x / GOALS["max_outside_forward_share"]})
    res["checks"] = checks
    res["all_met"] = all(c["met"] for c in checks) if checks else None
    return res

