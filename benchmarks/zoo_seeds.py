"""The zoo's figures over several seeds: what a newcomer's `retrace zoo tiny` gives, as a spread.

    python benchmarks/zoo_seeds.py --size small --seeds 0,1,2 --root zoo-seeds \
        --json bench-out/zoo-seeds.json --markdown bench-out/zoo-seeds.md --plot bench-out/zoo-seeds.png

Each seed is built by `retrace zoo tiny --out ROOT/seed-N` (portable numerics, cached: a finished seed is
not rebuilt), one after the other; the table gives each seed's target perplexity, the drafter's runtime
tau on its validation prompts, and tau of dflash and retrace on the held-out prompts at T=0 and T=1
(per-prompt means; at T=0 also pooled, tokens / rounds, which is what sets the speed) with the paired
retrace - dflash difference, then mean, sample standard deviation and
range over the seeds.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import click

COLUMNS = [  # (key, header, getter on the manifest's metrics)
    ("target_ppl", "target ppl", lambda m: m["target_ppl"]),
    ("drafter_val_tau", "drafter val tau", lambda m: (m.get("drafter_val_runtime_tau") or {}).get("tau_mean")),
    ("T0_dflash", "T=0 dflash", lambda m: m["tau"]["T0"]["dflash"]),
    ("T0_retrace", "T=0 retrace", lambda m: m["tau"]["T0"]["retrace"]),
    ("T0_diff", "T=0 retrace - dflash", lambda m: m["tau"]["T0"]["paired"]["mean_diff"]),
    # pooled (all tokens / all rounds): what sets the speed; the per-prompt mean weighs repetitive prompts up
    ("T0_dflash_pooled", "T=0 dflash pooled", lambda m: m["tau"]["T0"].get("dflash_pooled")),
    ("T0_retrace_pooled", "T=0 retrace pooled", lambda m: m["tau"]["T0"].get("retrace_pooled")),
    ("T1_dflash", "T=1 dflash", lambda m: m["tau"]["T1"]["dflash"]),
    ("T1_retrace", "T=1 retrace", lambda m: m["tau"]["T1"]["retrace"]),
    ("T1_diff", "T=1 retrace - dflash", lambda m: m["tau"]["T1"]["paired"]["mean_diff"]),
]


def build(root: Path, size: str, seed: int, numerics: str) -> dict:
    out = root / f"seed-{seed}"
    cmd = [sys.executable, "-m", "retrace", "zoo", "tiny", "--out", str(out), "--size", size, "--seed", str(seed),
           "--numerics", numerics, "--train"]  # seed 0 too: what the recipe builds, not what ships
    click.echo(f"[zoo-seeds] seed {seed}: {' '.join(cmd[2:])}", err=True)
    subprocess.run(cmd, check=True)
    return json.loads((out / "manifest.json").read_text())


def summarize(rows: list[dict]) -> dict:
    out = {}
    for key, _, _ in COLUMNS:
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals:
            out[key] = {"mean": statistics.fmean(vals), "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                        "min": min(vals), "max": max(vals), "n": len(vals)}
    return out


def markdown(rows: list[dict], summary: dict) -> str:
    head = "| seed | " + " | ".join(h for _, h, _ in COLUMNS) + " | build |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in rows:
        cells = [_f(r.get(k)) for k, _, _ in COLUMNS]
        lines.append(f"| {r['seed']} | " + " | ".join(cells) + f" | {r['build_min']:.0f} min |")
    cells = [f"{_f(summary[k]['mean'])} +- {_f(summary[k]['sd'])}" if k in summary else "" for k, _, _ in COLUMNS]
    lines.append("| mean +- sd | " + " | ".join(cells) + " | |")
    cells = [f"{_f(summary[k]['min'])} .. {_f(summary[k]['max'])}" if k in summary else "" for k, _, _ in COLUMNS]
    lines.append("| range | " + " | ".join(cells) + " | |")
    return "\n".join(lines) + "\n"


def _f(v) -> str:
    return "" if v is None else f"{v:.3f}"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("T0_dflash", "dflash T=0"), ("T0_retrace", "retrace T=0"), ("T1_dflash", "dflash T=1"),
            ("T1_retrace", "retrace T=1")]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        ax.bar([j + i * width for j in range(len(keys))], [r[k] for k, _ in keys], width, label=f"seed {r['seed']}")
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(keys))], [lbl for _, lbl in keys])
    ax.set_ylabel("tau (held-out prompts)")
    ax.set_title("zoo tiny: tau per seed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


@click.command()
@click.option("--size", type=click.Choice(["test", "small"]), default="small", show_default=True)
@click.option("--seeds", default="0,1,2", show_default=True)
@click.option("--root", type=click.Path(file_okay=False), default="zoo-seeds", show_default=True)
@click.option("--numerics", type=click.Choice(["portable", "native"]), default="portable", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None)
def main(size, seeds, root, numerics, json_out, md_out, plot_out) -> None:
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        raise click.BadParameter(f"--seeds must be comma-separated integers, got {seeds!r}") from None
    if len(seed_list) < 2 or len(set(seed_list)) != len(seed_list):
        raise click.BadParameter("--seeds needs at least two distinct seeds")
    rows = []
    for seed in seed_list:
        man = build(Path(root), size, seed, numerics)
        m = man["metrics"]
        row = {"seed": seed, "build_min": man["timings"]["total_s"] / 60, "numerics": man.get("numerics")}
        row.update({k: get(m) for k, _, get in COLUMNS})
        rows.append(row)
    summary = summarize(rows)
    table = markdown(rows, summary)
    click.echo(table)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps({"size": size, "rows": rows, "summary": summary}, indent=2) + "\n")
    if md_out:
        Path(md_out).parent.mkdir(parents=True, exist_ok=True)
        Path(md_out).write_text(table)
    if plot_out:
        plot(rows, Path(plot_out))


if __name__ == "__main__":
    main()
