"""The body of `retrace bench` (the click options live in retrace.cli; this keeps its imports lazy)."""

from __future__ import annotations

import json
from pathlib import Path

from retrace.errors import RetraceError


def command_line(ctx) -> str:
    """The command as typed, rebuilt from click's parsed parameters (options left at their default omitted)."""
    import shlex

    words = ["retrace", ctx.info_name or "bench"]
    for p in ctx.command.params:
        v = ctx.params.get(p.name)
        if v is None or v == p.default or (p.multiple and not v) or not p.opts:
            continue
        opt = p.opts[0]
        if getattr(p, "is_flag", False):
            if v:
                words.append(opt)
            continue
        for x in (v if p.multiple else [v]):
            words += [opt, str(x)]
    return shlex.join(words)


def parse_batch_sizes(text: str, option: str = "--batch-sizes") -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise RetraceError(f"{option} must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise RetraceError(f"{option} must be positive integers, got {text!r}")
    return sizes


def render_saved(from_json: str, plot_out: str | None, readme_table: bool, markdown_out: str | None) -> dict:
    from retrace.bench import report
    from retrace.bench.runner import wide_console

    path = Path(from_json)
    try:
        results = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RetraceError(f"{path}: cannot read benchmark results ({e})") from None
    if not isinstance(results, dict) or "systems" not in results:
        raise RetraceError(f"{path}: not a retrace bench JSON (no 'systems')")
    if plot_out:
        from retrace.bench.plots import plot_results

        plot_results(results, plot_out)
    report.print_results(results, wide_console())
    md = report.render_markdown(results)
    if markdown_out:
        Path(markdown_out).write_text(md)
    if readme_table:
        print(md)
    return results


def bench_command(*, target, drafter, engine, prompts, max_new_tokens, batch_sizes, runs, limit, threads, systems,
                  cache_dir, build_engine, json_out, plot_out, profile_out, readme_table, markdown_out, from_json,
                  command, draft_ar=None, peer_env="measure", verify_policy: str = "adaptive", tree_budget: int = 0,
                  tree_sources: str = "topk,suffix,target", tree_fixed: str = "", prompt_lookup: bool = False,
                  weights: str = "fp32", drafter_weights: str | None = None, device: str | None = None,
                  dtype: str | None = None,
                  compile_steps: bool = False, cuda_graphs: bool | None = None, row_invariant: bool = True,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0) -> dict:
    if from_json:
        return render_saved(from_json, plot_out, readme_table, markdown_out)
    if not target or not drafter:
        raise RetraceError("give --target and --drafter (or --from-json to render earlier results)")
    if not prompts:
        raise RetraceError("give --prompts (a JSONL file or a directory of them)")
    for d, what in ((target, "--target"), (drafter, "--drafter")):
        if not Path(d).is_dir():
            raise RetraceError(f"{what} {d}: not a directory")
    if engine is not None and not Path(engine).is_dir():
        raise RetraceError(f"--engine {engine}: not a directory")
    if engine is not None and drafter_weights is not None:  # the given bundle's drafter is what would run
        raise RetraceError("--drafter-weights builds our bundles; --engine runs a bundle as it was built: give one")
    from retrace.bench.config import BenchConfig
    from retrace.bench.precision import parse as parse_weights
    from retrace.bench.runner import run_and_report

    pats = tuple(p.strip() for p in systems.split(",") if p.strip()) if systems else None
    cfg = BenchConfig(target=target, drafter=drafter, prompts=list(prompts), engine=engine,
                      max_new_tokens=max_new_tokens, batch_sizes=parse_batch_sizes(batch_sizes), runs=runs,
                      limit=limit, threads=threads, systems=pats, cache_dir=cache_dir, build_engine=build_engine,
                      profile=profile_out, command=command, draft_ar=draft_ar, peer_env=peer_env,
                      verify_policy=verify_policy, tree_budget=tree_budget, tree_sources=tree_sources,
                      tree_fixed=parse_batch_sizes(tree_fixed, "--tree-fixed") if tree_fixed else (),
                      prompt_lookup=prompt_lookup, weights=parse_weights(weights), drafter_weights=drafter_weights,
                      device=device, dtype=dtype,
                      compile_steps=compile_steps, cuda_graphs=cuda_graphs, row_invariant=row_invariant,
                      temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    return run_and_report(cfg, json_out, plot_out, readme_table, markdown_out=markdown_out)
