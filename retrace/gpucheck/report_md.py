"""The short Markdown report written beside gpu_check.json."""

from __future__ import annotations


def _f(x, nd=3):
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render(data: dict) -> str:
    s = data["sections"]
    lines = [f"# gpu_check ({'dry run, CPU' if data['settings'].get('dry_run') else 'device'}), "
             f"{data.get('elapsed_s', 0):.0f} s", ""]
    lines += ["| section | status | seconds | note |", "|---|---|---|---|"]
    for name, sec in s.items():
        note = sec.get("error") or sec.get("reason") or ""
        lines.append(f"| {name} | {sec['status']} | {_f(sec.get('elapsed_s'), 1)} | {note[:160]} |")
    env = s.get("environment", {}).get("result", {})
    if env:
        lines += ["", f"GPU: {env.get('gpu', 'none')} cc {env.get('capability')} {env.get('gpu_memory_gib')} GiB; "
                      f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), triton {env.get('triton')}, "
                      f"transformers {env.get('transformers')}, python {env.get('python')}"]
    par = s.get("parity", {}).get("result", {})
    for dt in ("fp32", "bf16"):
        if dt in par:
            lines += ["", f"## parity {dt} ({par.get('n_prompts')} prompts x {par.get('max_new_tokens')} tokens)", "",
                      "| run | tau | tok/s | CPU tok/s | = CPU | = device AR |", "|---|---|---|---|---|---|"]
            for k, e in par[dt].items():
                vs, va = e["vs_cpu"], e.get("vs_device_ar")
                ar = f"{va['identical']}/{va['n']}" if va else "-"
                lines.append(f"| {k} | {_f(e['tau'])} | {_f(e['tokens_per_s'], 0)} | {_f(e['cpu_tokens_per_s'], 0)} | "
                             f"{vs['identical']}/{vs['n']} | {ar} |")
    if par.get("checks"):
        lines += ["", f"checks: {par['checks']}"]
    ker = s.get("kernels", {}).get("result", {})
    if ker.get("cases"):
        bad = [k for k, v in ker["cases"].items() if not v.get("ok")]
        lines += ["", f"## kernels: {len(ker['cases']) - len(bad)}/{len(ker['cases'])} cases within tolerance"
                      + (f" (failing: {bad})" if bad else "")]
        for dt, t in ker.get("timing", {}).items():
            lines.append(f"- {dt} {t.get('shape')}: kernel {t.get('kernel_ms')} ms, "
                         f"reference {t.get('reference_ms')} ms"
                         f", speedup {t.get('speedup')}" + (f" ERROR {t['error'][:200]}" if "error" in t else ""))
    sc = s.get("scale", {}).get("result", {})
    if sc:
        tg = sc.get("target", {})
        lines += ["", "## scale", "", f"- target: {_f((tg.get('params') or {}).get('total'))} params, "
                  f"{tg.get('steps')} steps, {_f(tg.get('tokens_per_second'), 0)} tok/s, held-out ppl "
                  f"{_f(tg.get('held_out_ppl'))}", f"- dflash: {sc.get('dflash', {}).get('steps')} steps, "
                  f"val {sc.get('dflash', {}).get('val')}",
                  f"- conditioner: {sc.get('conditioner', {}).get('steps')} steps, mean gate "
                  f"{sc.get('conditioner', {}).get('mean_gate')}"]
        for key in [k for k in sc if k.startswith("tau_T")]:
            r = sc[key]
            if "modes" in r:
                p = r.get("paired", {})
                taus = ", ".join(f"{m} {_f(v.get('tau'))}" for m, v in r["modes"].items())
                lines.append(f"- {key}: {taus}, paired diff {_f(p.get('mean_diff'))} +- "
                             f"{_f(p.get('se'))} (n={p.get('n')})")
        if "lossless" in sc:
            lines.append(f"- lossless: {sc['lossless']}")
        hr = sc.get("headroom", {})
        if "tau_B" in hr:
            lines.append(f"- headroom (half B): {hr['tau_B']}")
        lines.append(f"- seconds: {sc.get('seconds')}")
    for name in ("ort_cuda", "tensorrt"):
        eng = s.get(name, {}).get("result", {})
        if eng.get("runs"):
            lines += ["", f"## {name} ({eng.get('n_prompts')} prompts x {eng.get('max_new_tokens')} tokens, "
                          f"{eng.get('attention')} attention): ran {eng.get('ran')}", "",
                      "| run | tau | tok/s | torch tok/s | = torch |", "|---|---|---|---|---|"]
            for k, e in eng["runs"].items():
                vs = e["vs_torch"]
                lines.append(f"| {k} | {_f(e['tau'])} | {_f(e['tokens_per_s'], 0)} | {_f(e['torch_tokens_per_s'], 0)} "
                             f"| {vs['identical']}/{vs['n']} |")
            lines.append(f"token-exact: {eng.get('token_exact')}")
    return "\n".join(lines) + "\n"
