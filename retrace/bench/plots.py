"""Benchmark plots (matplotlib, Agg): throughput per system with its spread over runs (one panel per batch
size), the histogram of accepted lengths (dflash vs retrace), and tau per prompt domain (dflash vs retrace).

`plot_results(results, "out.png")` writes the three panels together to out.png and each alone to
out-throughput.png, out-accept.png and out-domains.png.
"""

from __future__ import annotations

from pathlib import Path

from retrace.bench.report import decoding_text

COLORS = {"peer": "#8c8c8c", "hf-dflash": "#4d4d4d", "ar": "#4c72b0", "dflash": "#dd8452", "retrace": "#55a868"}


def _color(s: dict) -> str:
    if s.get("family") == "peer":
        return COLORS.get(s.get("name", ""), COLORS["peer"])
    return COLORS.get(s.get("mode") or "", "#333333")


def _throughput(ax, results: dict, b: int) -> None:
    rows = [s for s in results["systems"] if s["batch_size"] == b and s["status"] != "skipped"]
    names = [s["name"] for s in rows]
    y = range(len(rows))
    for i, s in enumerate(rows):
        if s["status"] != "ok":
            ax.text(0, i, "  n/a", va="center", fontsize=8, color="#888888")
            continue
        runs = s["tokens_per_s_runs"]
        med = s["tokens_per_s"]
        ax.barh(i, med, color=_color(s), alpha=0.85)
        ax.errorbar(med, i, xerr=[[med - min(runs)], [max(runs) - med]], fmt="none", ecolor="black", capsize=3)
        ax.scatter(runs, [i] * len(runs), s=8, color="black", zorder=3)
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median, bar: min-max over runs)")
    ax.set_title(f"batch {b}")


def _accept(ax, results: dict) -> None:
    drawn = False
    series = [s for s in results["systems"] if s["batch_size"] == 1 and s["status"] == "ok"
              and s.get("accepted_hist") and (s["mode"] in ("dflash", "retrace") or s["name"] == "hf-dflash")]
    width = 0.8 / max(len(series), 1)
    for k, s in enumerate(series):
        h = s["accepted_hist"]
        tot = sum(h) or 1
        xs = [a + 1 + (k - (len(series) - 1) / 2) * width for a in range(len(h))]
        hatch = "//" if s["backend"] == "onnxruntime" else None
        ax.bar(xs, [n / tot for n in h], width=width, color=_color(s), hatch=hatch, alpha=0.85,
               label=f"{s['name']} (tau {s['tau']:.2f})" if s.get("tau") else s["name"], edgecolor="white")
        drawn = True
    ax.set_xlabel("tokens per round (accepted drafts + 1)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("accepted length, batch 1")
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no drafting system ran", ha="center", transform=ax.transAxes)


def _domains(ax, results: dict) -> None:
    pd = results.get("per_domain") or {}
    names = [n for n in pd if n.endswith(("-dflash", "-retrace"))]
    domains = sorted({d for n in names for d in pd[n]})
    if not names or not domains:
        ax.text(0.5, 0.5, "no drafting system ran", ha="center", transform=ax.transAxes)
        return
    by = {s["name"]: s for s in results["systems"] if s["batch_size"] == 1}
    width = 0.8 / len(names)
    top = 0.0
    for k, n in enumerate(names):
        vals = [pd[n].get(d, {}).get("tau_pooled") or 0.0 for d in domains]
        top = max([top, *vals])
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(domains))]
        s = by.get(n, {"name": n, "family": "peer", "mode": None, "backend": None})
        ax.bar(xs, vals, width=width, color=_color(s), hatch="//" if s.get("backend") == "onnxruntime" else None,
               label=n, alpha=0.85, edgecolor="white")
    ax.set_xticks(range(len(domains)), domains)
    ax.set_ylabel("tau (tokens per round, pooled)")
    ax.set_title("tau per prompt domain, batch 1")
    ax.set_ylim(0, top * 1.4 or 1.0)  # room for the legend above the bars
    ax.legend(fontsize=7, loc="upper center", ncol=3)


def plot_results(results: dict, out: str | Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")
    bs = results["config"]["batch_sizes"]
    n_sys = len({s["name"] for s in results["systems"] if s["status"] != "skipped"})
    h_top = max(2.5, 0.35 * n_sys + 1)
    paths = {"combined": str(out)}

    cols = max(len(bs), 2)
    fig = plt.figure(figsize=(6 * cols, h_top + 4.2), layout="constrained")
    gs = fig.add_gridspec(2, cols, height_ratios=[h_top, 4])
    for i, b in enumerate(bs):
        _throughput(fig.add_subplot(gs[0, i]), results, b)
    half = cols // 2
    _accept(fig.add_subplot(gs[1, :half]), results)
    _domains(fig.add_subplot(gs[1, half:]), results)
    c = results["config"]
    fig.suptitle(f"retrace bench: {c['n_prompts']} prompts x {c['max_new_tokens']} tokens, {decoding_text(c)}, "
                 f"{c['runs']} runs, {c['threads']} threads")
    fig.savefig(out, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(bs), figsize=(6 * len(bs), h_top), squeeze=False, layout="constrained")
    for ax, b in zip(axes[0], bs, strict=True):
        _throughput(ax, results, b)
    paths["throughput"] = str(stem) + "-throughput.png"
    fig.savefig(paths["throughput"], dpi=110)
    plt.close(fig)

    for key, fn in (("accept", _accept), ("domains", _domains)):
        fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
        fn(ax, results)
        paths[key] = f"{stem}-{key}.png"
        fig.savefig(paths[key], dpi=110)
        plt.close(fig)
    return paths
