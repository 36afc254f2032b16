"""One benchmark run: build every system, warm each up, then time them interleaved across K runs.

The systems are timed in a rotating order inside every run (run k starts k/K of the way down the list), so
slow drifts of the machine (other jobs, thermal state) hit all systems alike; results are medians and
ranges over the K runs, compared as ratios measured in the same benchmark.

Each group of systems runs in its own worker process under the threading environment it is fastest with
(retrace.bench.envs, retrace.bench.isolate; `--peer-env inherit` keeps everything in this process). One
worker runs at a time, timing inside itself; the others wait on their input pipe, and the CPU time they
use meanwhile is recorded (`machine.idle_workers`) to show that no idle worker spins.

The parts: retrace.bench.config (what to run, the names), lineup (building the systems), isolate and worker
(the worker processes), analysis (the results document), report and plots (printing it), machine, profiling.
"""

from __future__ import annotations

import os
from pathlib import Path

from retrace.bench import report
from retrace.bench.analysis import assemble
from retrace.bench.config import BenchConfig
from retrace.bench.lineup import Built, build_systems
from retrace.bench.machine import default_threads, machine_info
from retrace.bench.profiling import profile_run
from retrace.bench.prompts import BenchPrompt, load_prompts
from retrace.bench.systems import RunOut
from retrace.errors import RetraceError


def _order(pairs: list, k: int, runs: int) -> list:
    shift = (k * len(pairs)) // runs if pairs else 0
    return pairs[shift:] + pairs[:shift]


def wide_console():
    """A stderr console; when it is not a terminal, wide enough for the results table."""
    from rich.console import Console

    c = Console(stderr=True)
    return c if c.is_terminal else Console(stderr=True, width=200)


def run_bench(cfg: BenchConfig, console=None, show_progress: bool = True) -> dict:
    """Run the benchmark described by `cfg` and return the results (the JSON document)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg.validate()
    console = console or wide_console()
    threads = cfg.threads or default_threads()
    machine = machine_info(threads)

    def log(msg: str) -> None:
        if show_progress:
            console.print(f"[dim]bench:[/dim] {msg}")

    from retrace.models.config import DrafterConfig, Qwen3Config
    from retrace.runtime.tokenizer import TextCodec

    tcfg = Qwen3Config.from_dir(cfg.target)
    dcfg = DrafterConfig.from_dir(cfg.drafter)
    N = cfg.max_new_tokens
    B = dcfg.block_size
    ctx = int(tcfg.max_position_embeddings)
    tree_max = max((cfg.tree_budget, *cfg.tree_fixed))
    max_prompt = ctx - N - max(B, tree_max) - 2
    if max_prompt < 1:
        raise RetraceError(f"--max-new-tokens {N} + block {B} does not fit the target's context of {ctx} tokens")
    prompts: list[BenchPrompt] = load_prompts(cfg.prompts, TextCodec.find(cfg.target), cfg.limit,
                                              tcfg.vocab_size, max_prompt)
    ids = [p.ids for p in prompts]
    max_seq_len = max(len(i) for i in ids) + N + max(B, tree_max) + 2
    batch_sizes = tuple(sorted(set(cfg.batch_sizes)))

    # a bundle built here is sized for the benchmark: the batch and the target's whole context
    built = _build(cfg, threads, max_seq_len, max(batch_sizes), log, min(ctx, 2048), ids[:2], batch_sizes, machine)
    built.block_size = B
    if not built.systems:
        raise RetraceError("no system could be built: "
                           + "; ".join(f"{s['name']}: {s['reason']}" for s in built.skipped))

    pairs = [(s, b) for b in batch_sizes for s in built.systems if s.supports(b) is None]
    runs: dict[tuple[str, int], list[RunOut]] = {(s.name, b): [] for s, b in pairs}
    per_pair_tokens = N * len(ids)
    warm_tokens = sum(N * min(b, len(ids)) for _, b in pairs) if cfg.warmup else 0
    total = warm_tokens + cfg.runs * per_pair_tokens * len(pairs)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not show_progress) as bar:
        task = bar.add_task("bench", total=total)

        def advance(n: int) -> None:
            bar.advance(task, n)

        try:
            if cfg.warmup:
                for s, b in pairs:
                    bar.update(task, description=f"warm-up {s.name} b={b}")
                    s.run(ids[:b], N, b, advance)
            from retrace.bench.isolate import IdleMeter

            meter = IdleMeter(built.workers)
            for k in range(cfg.runs):
                for s, b in _order(pairs, k, cfg.runs):
                    bar.update(task, description=f"run {k + 1}/{cfg.runs} {s.name} b={b}")
                    done = meter.around(getattr(s, "worker", None))
                    runs[(s.name, b)].append(s.run(ids, N, b, advance))
                    done()

            profile = None
            if cfg.profile:
                profile = profile_run(cfg.profile, built.systems, ids, N, log)
        except BaseException:
            _close(built)
            raise

    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    machine["idle_workers"] = meter.report() if built.workers else None
    results = assemble(cfg, built, runs, prompts, batch_sizes, machine, threads)
    results["profile"] = profile
    _close(built)
    return results


def _close(built: Built) -> None:
    for s in built.systems:
        s.close()
    for w in built.workers:
        w.close()
    built.workers = []


def _build(cfg: BenchConfig, threads: int, max_seq_len: int, max_batch: int, log, bundle_seq_len: int,
           tune_prompts, batch_sizes, machine: dict) -> Built:
    """In this process (--peer-env inherit) or in one worker process per group (retrace.bench.isolate)."""
    from dataclasses import asdict

    from retrace.bench.isolate import build_isolated, in_process_env

    if cfg.peer_env == "inherit":
        built = build_systems(cfg, threads, max_seq_len, max_batch, log, bundle_seq_len=bundle_seq_len,
                              tune_prompts=tune_prompts)
        for s in built.systems:
            s.env = in_process_env(threads)
        return built
    cache = cfg.cache()
    from retrace.digest import dir_digest

    conf = {k: v for k, v in asdict(cfg).items() if k not in ("extra",)}
    request = {"op": "build", "config": conf, "max_seq_len": max_seq_len, "max_batch": max_batch,
               "bundle_seq_len": bundle_seq_len, "tune_prompts": tune_prompts, "batch_sizes": list(batch_sizes),
               "cpu": machine["cpu"], "model_digest": dir_digest(cfg.target, cfg.drafter)}
    built = Built()
    built.systems, built.skipped, built.builds, built.workers = build_isolated(cfg, threads, request, cache, log,
                                                                               tune_prompts)
    return built



def run_and_report(cfg: BenchConfig, json_out: str | None, plot_out: str | None, readme: bool, console=None,
                   markdown_out: str | None = None) -> dict:
    """The `retrace bench` command: run, write JSON and plots, print the table (and the README table)."""
    import json

    console = console or wide_console()
    results = run_bench(cfg, console)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(results, indent=2) + "\n")
    if plot_out:
        from retrace.bench.plots import plot_results

        results["plots"] = plot_results(results, plot_out)
        if json_out:
            Path(json_out).write_text(json.dumps(results, indent=2) + "\n")
    report.print_results(results, console)
    md = report.render_markdown(results)
    if markdown_out:
        Path(markdown_out).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_out).write_text(md)
    if readme:
        print(md)
    return results
