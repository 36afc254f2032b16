"""Benchmark results as a terminal table (rich) and as a markdown table for the README."""

from __future__ import annotations

PEER_COLUMNS = (("hf-ar", "x hf-ar"), ("hf-dflash", "x hf-dflash"), ("ortgenai-ar", "x ortgenai-ar"),
                ("ortgenai-ngram", "x ortgenai-ngram"), ("ortgenai-draft", "x ortgenai-draft"),
                ("fastest-peer", "x fastest peer"))


def _f(x, fmt: str = "{:.1f}", none: str = "n/a") -> str:
    return none if x is None else fmt.format(x)


def _ratio(results: dict, name: str, b: int, peer: str) -> float | None:
    return next((r["ratio"] for r in results.get("ratios", [])
                 if r["system"] == name and r["peer"] == peer and r["batch_size"] == b), None)


def _split(ts: dict | None) -> str:
    if not ts:
        return ""
    return (f"{100 * ts['draft_share']:.0f}/{100 * ts['verify_share']:.0f}/"
            f"{100 * (ts['prefill_share']):.0f}/{100 * ts['other_share']:.0f}")


def rows(results: dict) -> list[dict]:
    """One display row per (system, batch size), in the order of results['systems']."""
    out = []
    for s in results["systems"]:
        b = s["batch_size"]
        row = {
            "system": s["name"], "batch": b, "status": s["status"], "reason": s.get("reason"),
            "tok_s": s["tokens_per_s"],
            "range": (f"{s['spread']['min']:.1f}-{s['spread']['max']:.1f}" if s.get("spread") else ""),
            "tau": s.get("tau"), "rounds": s.get("rounds"),
            "split": _split(s.get("time_split")),
            "outside": (s["time_split"]["outside_forward_share"] if s.get("time_split") else None),
            "agree": (f"{results['config']['n_prompts'] - s['agreement']['prompts_mismatched']}/"
                      f"{results['config']['n_prompts']}" if s.get("agreement") else ""),
        }
        for peer, col in PEER_COLUMNS:
            row[col] = _ratio(results, s["name"], b, peer) if s["family"] == "retrace" else None
        out.append(row)
    return out


def tau_lines(results: dict) -> list[str]:
    """tau pooled and per prompt for each drafting system at batch 1 (pooled: tokens per round over all
    the prompts' rounds; per prompt: each prompt's own, summarised)."""
    out = []
    for s in results["systems"]:
        per = s.get("tau_per_prompt")
        if s["status"] != "ok" or s["batch_size"] != 1 or not per or s["mode"] == "ar":
            continue
        out.append(f"{s['name']}: pooled {s['tau']:.2f}, per prompt mean {s['tau_prompt_mean']:.2f}, median "
                   f"{s['tau_prompt_median']:.2f}, range {min(per):.2f}-{max(per):.2f} over {len(per)} prompts")
    return out


def draft_cost_lines(results: dict) -> list[str]:
    """Each of our drafting systems' draft call against a decode step at batch 1 (issue 26's measure): the
    drafter's forward time per call over the forward time per decode step of plain decoding on the same backend
    and precision (its target calls after each prompt's one prefill call). The calls are at the draft widths
    the system's policy chose, which a 16-slot block bounds from above."""
    from retrace.bench.precision import of_name

    ok = {s["name"]: s for s in results["systems"] if s["status"] == "ok" and s["batch_size"] == 1}
    n = results["config"]["n_prompts"]
    out = []
    for s in ok.values():
        t, ar = s.get("time_split") or {}, ok.get(f"retrace-{s.get('backend')}-ar{of_name(s['name'])}")
        a = (ar or {}).get("time_split") or {}
        if s["family"] != "retrace" or not t.get("draft_calls") or not a or a["target_calls"] <= n:
            continue
        decode = 1000 * (a["target_forward_s"] - a["prefill_s"]) / (a["target_calls"] - n)
        out.append(f"{s['name']} {t['draft_ms_per_call']:.2f} ms = {t['draft_ms_per_call'] / decode:.2f} of "
                   f"{ar['name']}'s {decode:.2f} ms decode step ({t['draft_calls']:.0f} calls a run)")
    return out


def fidelity_line(results: dict) -> str:
    f = results.get("fidelity")
    if not f and not results["config"].get("greedy", True):
        return "fidelity: n/a (a greedy run's check: per-round acceptance is random when sampling)"
    if not f:
        return "fidelity: n/a (needs retrace-torch-dflash-fixed and hf-dflash at batch 1)"
    verdict = "within 1%" if f["within_1pct"] else "NOT within 1%"
    return (f"fidelity (T=0, same weights): our dflash tau {f['tau_ours']:.4f} vs transformers' DFlash "
            f"{f['tau_hf']:.4f} ({100 * f['rel_gap']:+.2f}%, {verdict}); counted as tokens kept per round "
            f"{f['tau_ours_tokens_kept']:.4f} ({100 * f['rel_gap_tokens_kept']:+.2f}%); rounds {f['rounds_ours']} vs "
            f"{f['rounds_hf']}; identical per-round acceptance on {f['prompts_identical_rounds']}/{f['prompts']} "
            f"prompts. {f['explanation']}.")


def goal_lines(results: dict) -> list[str]:
    g = results.get("goals") or {}
    out = []
    for c in g.get("checks", []):
        mark = "met" if c["met"] else f"MISSED (x{c['shortfall']:.2f} short)"
        val = f"{100 * c['value']:.1f}%" if "outside" in c["what"] else f"{c['value']:.2f}x"
        goal = f"<= {100 * c['goal']:.0f}%" if "outside" in c["what"] else f">= {c['goal']:.1f}x"
        out.append(f"{c['what']}: {val} (goal {goal}) {mark}")
    return out


def analysis_lines(results: dict, batch_sizes: tuple[int, ...] = (1,)) -> list[str]:
    out = []
    for a in results.get("analysis") or []:
        if a["batch_size"] not in batch_sizes or a["verify_ms"] is None:
            continue
        out.append(
            f"{a['system']} b={a['batch_size']}: a round takes {a['round_ms']:.2f} ms (verify {a['verify_ms']:.2f}, "
            f"draft {_f(a['draft_ms'], '{:.2f}', 'none')}, outside the forwards "
            f"{a['outside_forward_ms_per_round']:.2f}) for tau "
            f"{a['tau']:.2f} tokens per row; {a['peer']} takes {a['peer_ms_per_step']:.2f} ms per step of "
            f"{a['batch_size']} token(s), so one verify costs {a['verify_over_peer_step']:.1f} of its steps; ratio "
            f"{a['ratio']:.2f}x, "
            f"{a['ratio_bound_zero_overhead']:.2f}x with zero loop overhead; {a['goal']:.1f}x needs tau "
            f"{a['tau_needed_for_goal']:.1f} at this round cost or a round of {a['round_ms_needed_for_goal']:.2f} ms "
            "at this tau")
    return out


def env_lines(results: dict) -> list[str]:
    """The threading environment each system ran with, one line per distinct environment."""
    by: dict[str, list[str]] = {}
    for s in results["systems"]:
        e = s.get("env")
        if not e or s["batch_size"] != results["systems"][0]["batch_size"]:
            continue
        key = f"{e['describe']} ({e['process']}, {e['chosen_by']})"
        by.setdefault(key, []).append(s["name"])
    return [f"{', '.join(names)}: {key}" for key, names in by.items()]


def speculative_lines(results: dict) -> list[str]:
    """The peers' own speculative modes (onnxruntime-genai, llama.cpp): settings and own acceptance statistics."""
    out = []
    for s in results["systems"]:
        st = s.get("speculative_stats")
        if not st:
            continue
        opt = (s.get("settings") or {}).get("speculative") or {}
        acc = st["acceptance_rate"]
        how = ", ".join(f"{k} {v}" for k, v in opt.items())
        out.append(f"{s['name']} at batch {s['batch_size']} ({how}): acceptance "
                   f"{'n/a' if acc is None else f'{acc:.2f}'}, {_f(st['tokens_per_round'], '{:.2f}')} tokens per "
                   f"round over {st['rounds']} rounds" + ("" if st.get("standard_fallback_steps") is None
                                                          else f", {st['standard_fallback_steps']} plain steps"))
    return out


def machine_line(results: dict) -> str:
    m = results["machine"]
    v = m["versions"]
    load = m.get("loadavg_start")
    return (f"{m['cpu']}, {m['usable_cores']} cores, {m['threads']} threads; torch {v.get('torch')}, transformers "
            f"{v.get('transformers')}, onnxruntime {v.get('onnxruntime')}, onnxruntime-genai "
            f"{v.get('onnxruntime-genai')}" + (f"; load average {load[0]:.1f} at start" if load else ""))


def print_results(results: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    c = results["config"]
    t = Table(title=f"retrace bench: {c['n_prompts']} prompts x {c['max_new_tokens']} new tokens, {decoding_text(c)}, "
                    f"{c['runs']} runs, {c['threads']} threads")
    for col, just in (("system", "left"), ("batch", "right"), ("tok/s", "right"), ("range", "right"),
                      ("tau", "right"), ("rounds", "right"), ("draft/verify/prefill/other %", "right"),
                      ("outside fwd", "right"), *((col, "right") for _, col in PEER_COLUMNS), ("agree", "right")):
        t.add_column(col, justify=just)
    for r in rows(results):
        if r["status"] != "ok":
            reason = r["reason"] or ""
            t.add_row(r["system"], str(r["batch"]), r["status"], "", "", "",
                      reason if len(reason) <= 70 else reason[:67] + "...", "", *([""] * len(PEER_COLUMNS)), "",
                      style="dim")
            continue
        t.add_row(r["system"], str(r["batch"]), _f(r["tok_s"]), r["range"], _f(r["tau"], "{:.2f}", ""),
                  _f(r["rounds"], "{}", ""), r["split"], _f(r["outside"], "{:.1%}", ""),
                  *(_f(r[col], "{:.2f}x", "") for _, col in PEER_COLUMNS), r["agree"])
    console.print(t)
    console.print(fidelity_line(results))
    for line in tau_lines(results):
        console.print(f"tau at batch 1, {line}")
    for line in draft_cost_lines(results):
        console.print(f"draft call at batch 1, {line}")
    a = results.get("agreement") or {}
    if a.get("sampled"):
        console.print(a["note"])
    elif a:
        console.print(f"agreement with {a['reference']}: {a['total_mismatched_prompts']} mismatched prompt outputs "
                      f"over {a['checked']} system/batch results; exact length everywhere: {a['all_exact_length']}")
    for line in goal_lines(results):
        console.print(line)
    for line in analysis_lines(results):
        console.print(line)
    for line in speculative_lines(results):
        console.print(line)
    for line in env_lines(results):
        console.print(f"env: {line}")
    prof = results.get("profile")
    if prof:
        console.print(f"profile of one {prof['system']} run at batch 1 ({prof['wall_s']:.2f} s under cProfile, "
                      f"written to {prof['path']}); top functions by own time:")
        for r in prof["top_tottime"][:12]:
            console.print(f"  {r['tottime_s']:8.3f} s own {r['cumtime_s']:8.3f} s cum {r['ncalls']:7d} calls  "
                          f"{r['function']}", markup=False, highlight=False)
    console.print(machine_line(results))


def decoding_text(config: dict) -> str:
    """How the run's systems picked tokens (retrace.bench.decoding; JSON from before sampled runs: greedy)."""
    return config.get("decoding_text", "greedy")


def render_markdown(results: dict) -> str:
    """The results as a markdown table (for the README), with the fidelity and machine lines under it."""
    c = results["config"]
    head = ["system", "batch", "tokens/s (median)", "range", "tau", "draft/verify/prefill/other %",
            *(col for _, col in PEER_COLUMNS), "same output"]
    text = decoding_text(c)
    lines = [f"{text[0].upper() + text[1:]}, {c['n_prompts']} prompts x {c['max_new_tokens']} new tokens, median of "
             f"{c['runs']} "
             f"interleaved runs, {c['threads']} threads.", "",
             "| " + " | ".join(head) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
    for r in rows(results):
        if r["status"] != "ok":
            cells = [f"`{r['system']}`", str(r["batch"]), "n/a", "", "", r["reason"] or "",
                     *([""] * len(PEER_COLUMNS)), ""]
        else:
            cells = [f"`{r['system']}`", str(r["batch"]), _f(r["tok_s"]), r["range"], _f(r["tau"], "{:.2f}", ""),
                     r["split"], *(_f(r[col], "{:.2f}x", "") for _, col in PEER_COLUMNS), r["agree"]]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", fidelity_line(results), ""]
    taus = tau_lines(results)
    if taus:
        lines += ["tau at batch 1 (pooled over all rounds, and per prompt): " + "; ".join(taus) + ".", ""]
    drafts = draft_cost_lines(results)
    if drafts:
        lines += ["The draft call against a decode step at batch 1 (forward time per call; at the draft widths each "
                  "policy chose): " + "; ".join(drafts) + ".", ""]
    spec = speculative_lines(results)
    if spec:
        lines += ["The peers' own speculative modes: " + "; ".join(spec) + ".", ""]
    env = env_lines(results)
    if env:
        lines += ["Threading environment per system: " + "; ".join(env) + ".", ""]
    lines += [f"Machine: {machine_line(results)}.", ""]
    if results.get("command"):
        lines += [f"Regenerate: `{results['command']}`", ""]
    return "\n".join(lines)
