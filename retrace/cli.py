"""`retrace` command line: generate, init-conditioner, zoo, train, eval, bench."""

from __future__ import annotations

import os

# Before torch is imported: worker threads wait passively (busy-waiting costs 4-6x on a loaded 2-core machine).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import click  # noqa: E402

from retrace.cli_checks import check_finite, check_seed, check_text  # noqa: E402
from retrace.cli_errors import cli_errors  # noqa: E402
from retrace.cli_options import LOOKUP, build_runtime, runtime_flags, runtime_options  # noqa: E402
from retrace.errors import RetraceError  # noqa: E402
from retrace.request_validation import MAX_PROMPT_CHARS  # noqa: E402


@click.group()
@click.version_option(package_name="retrace")
def main() -> None:
    """ReTrace speculative decoding for Qwen3: generate, train, evaluate, benchmark."""


@main.command("init-conditioner")
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(file_okay=False),
              help="DFlash drafter directory")
@click.option("--init", "init", type=click.Choice(["zero", "random"]), default="zero", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="overwrite an existing conditioner")
@cli_errors
def init_conditioner(drafter_dir: str, init: str, seed: int, force: bool) -> None:
    """Write a ReTrace conditioner (retrace_config.json + retrace.safetensors) beside a DFlash drafter."""
    from retrace.models.conditioner import ReTraceConditioner
    from retrace.models.config import DrafterConfig

    cfg = DrafterConfig.from_dir(drafter_dir)
    if ReTraceConditioner.exists(drafter_dir) and not force:
        raise RetraceError(f"{drafter_dir}: already has a conditioner (use --force to replace it)")
    cond = ReTraceConditioner(cfg.hidden_size, rms_norm_eps=cfg.layers.rms_norm_eps)
    cond.reset(init=init, seed=seed)
    cond.save(drafter_dir)
    click.echo(f"wrote {init} conditioner (hidden {cfg.hidden_size}) to {drafter_dir}")


def _read_prompts(prompt, prompt_ids, prompts_file) -> list[str | list[int]]:
    given = [x is not None for x in (prompt, prompt_ids, prompts_file)]
    if sum(given) != 1:
        raise RetraceError("give exactly one of --prompt, --prompt-ids, --prompts-file")
    if prompt is not None:
        check_text(prompt, "--prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RetraceError(f"--prompt has {len(prompt)} characters, at most {MAX_PROMPT_CHARS} are allowed")
        return [prompt]
    if prompt_ids is not None:
        try:
            return [[int(t) for t in prompt_ids.split(",") if t.strip()]]
        except ValueError:
            raise RetraceError(f"--prompt-ids must be comma-separated integers, got {prompt_ids!r}") from None
    from retrace.runtime.prompts import read_prompts_jsonl

    return [[int(t) for t in o["prompt_ids"]] if "prompt_ids" in o else o["prompt"]
            for o in read_prompts_jsonl(prompts_file)]


def sampling_options(fn):
    opts = [
        click.option("--max-new-tokens", type=int, default=128, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True),
        click.option("--top-p", type=float, default=1.0, show_default=True),
        click.option("--top-k", type=int, default=0, show_default=True),
        click.option("--seed", type=int, default=None),
        click.option("--stop", multiple=True, help="stop string (repeatable)"),
        click.option("--min-tokens", type=int, default=0, show_default=True,
                     help="no EOS before this many new tokens (transformers' min_new_tokens)"),
        click.option("--ignore-eos", is_flag=True, help="EOS does not stop generation (runs to --max-new-tokens)"),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@main.command()
@runtime_options
@click.option("--prompt", default=None, help="prompt text")
@click.option("--prompt-ids", default=None, help="prompt token ids, e.g. 1,2,3")
@click.option("--prompts-file", default=None, help="JSONL: one {'prompt': ...} or {'prompt_ids': [...]} per line")
@click.option("--mode", default="retrace", show_default=True, help="ar | dflash | retrace")
@sampling_options
@click.option("--json", "as_json", is_flag=True, help="print one JSON object with outputs and stats")
@cli_errors
def generate(target, drafter, engine, backend, options, prompt, prompt_ids, prompts_file, mode, max_new_tokens,
             temperature, top_p, top_k, seed, stop, min_tokens, ignore_eos, as_json) -> None:
    """Generate with speculative decoding (lossless: greedy output equals the target's own)."""
    import json

    from retrace.runtime import MODES, SamplingParams

    if mode not in MODES:
        raise RetraceError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
    check_finite(temperature, "--temperature", low=0.0)
    check_seed(seed)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop), min_tokens=min_tokens, ignore_eos=ignore_eos)
    prompts = _read_prompts(prompt, prompt_ids, prompts_file)
    if options.max_batch is None and len(prompts) == 1:  # one slot: smaller caches, and on an int4 bundle no
        options = options.replace(max_batch=1)  # attention pad row (runtime/onnxruntime_backend.py)
    rt = build_runtime(target, drafter, engine, backend, options, drafts=mode != "ar")
    if as_json:
        results = rt.generate(prompts, params, mode)
    else:
        from rich.progress import Progress

        with Progress(transient=True) as bar:
            task = bar.add_task(f"{mode} generate", total=len(prompts) * max_new_tokens)
            results = rt.generate(prompts, params, mode, progress=lambda n: bar.advance(task, n))
    stats = rt.run_stats()
    if as_json:
        click.echo(json.dumps({
            "outputs": [{"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                         "stats": r.stats, **({"error": r.error} if r.error else {})} for r in results],
            "stats": stats,
        }))
        _failed(results)
        return
    for i, r in enumerate(results):
        click.echo(f"--- output {i} ({len(r.token_ids)} tokens, tau {r.stats['tau'] or 0:.2f}, {r.finish_reason})")
        click.echo(r.text if r.text is not None else ",".join(map(str, r.token_ids)))
    t = stats["time"]
    click.echo(f"--- {stats['tokens']} tokens, {stats['tokens_per_s']:.1f} tok/s, tau {stats['tau'] or 0:.2f}, "
               f"rounds {stats['rounds']}, verified drafts {stats['verify_hist']}; time draft {t['draft_s']:.2f}s "
               f"verify {t['verify_s']:.2f}s "
               f"prefill {t['prefill_s']:.2f}s other {t['other_s']:.2f}s", err=True)
    _failed(results)


def _failed(results) -> None:
    """A prompt that failed alone (its distribution could not be sampled): exit 1 naming it, after the others."""
    bad = [f"prompt {i}: {r.error}" for i, r in enumerate(results) if r.error]
    if bad:
        raise RetraceError("; ".join(bad))


from retrace.train.commands import eval_cmd, train, zoo  # noqa: E402  (lazy inside: keeps --help fast)

main.add_command(train)
main.add_command(zoo)
main.add_command(eval_cmd)


@main.command()
@click.option("--target", required=False, type=click.Path(file_okay=False), help="Qwen3 target HF directory")
@click.option("--drafter", required=False, type=click.Path(file_okay=False), help="DFlash drafter directory")
@click.option("--engine", type=click.Path(), default=None, help="ONNX Runtime engine bundle (else one is built "
              "into the cache when the exporter is installed)")
@click.option("--prompts", "prompts", multiple=True, type=click.Path(),
              help="JSONL prompt file or directory of them (repeatable); lines {'prompt' | 'prompt_ids', 'domain'}")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--batch-sizes", default="1,8", show_default=True, help="comma-separated batch sizes")
@click.option("--runs", type=int, default=3, show_default=True, help="timed runs per system (interleaved)")
@click.option("--limit", type=int, default=16, show_default=True, help="prompts used (round-robin over files)")
@runtime_flags("threads", helps={"threads": "CPU threads for every system (default: all cores)"})
@click.option("--systems", default=None, help="only these systems (comma-separated names or globs, e.g. 'hf-*')")
@click.option("--cache-dir", type=click.Path(), default=None, help="build cache (default ~/.cache/retrace/bench)")
@click.option("--no-build-engine", is_flag=True, help="without --engine, skip the ONNX Runtime backend")
@click.option("--draft-ar", type=click.Path(file_okay=False), default=None,
              help="HF Qwen3 draft model for ortgenai-draft (default: ZOO/draft-ar beside a zoo target, else "
                   "distilled into the cache from ZOO/data)")
@click.option("--peer-env", type=click.Choice(["measure", "defaults", "inherit"]), default="measure", show_default=True,
              help="threading environment per system: measure the candidates (OMP wait policy, threads) in one "
                   "worker process each and keep the fastest (cached); library defaults in workers; or inherit "
                   "this process's (everything in one process)")
@click.option("--json", "json_out", type=click.Path(), default=None, help="write the results here")
@click.option("--plot", "plot_out", type=click.Path(), default=None, help="write the plots here (PNG)")
@click.option("--profile", "profile_out", type=click.Path(), default=None,
              help="cProfile one batch-1 run of the headline retrace system into this file")
@click.option("--readme-table", is_flag=True, help="print the results as a markdown table (for the README)")
@runtime_flags("verify_policy", "tree_budget", "tree_sources", "prompt_lookup", prompt_lookup="off",
               helps={"prompt_lookup": "also run retrace-<backend>-<mode>-lookup (prompt lookup in rounds without a "
                                       "drafter call) and -lookup-first (also instead of one where it pays more); "
                                       "the other retrace systems never look up"})
@click.option("--tree-fixed", default="", help="also run retrace-<backend>-<mode>-tree<b>-fixed: trees of exactly "
                                               "b tokens a round, for each b of this comma list (e.g. 4,8,16)")
@click.option("--markdown", "markdown_out", type=click.Path(), default=None, help="write the markdown table here")
@runtime_flags("device", "dtype", "compile", "cuda_graphs", "row_invariant")
@click.option("--from-json", "from_json", type=click.Path(dir_okay=False), default=None,
              help="render table/plots/markdown from an earlier --json file instead of running")
@click.option("--weights", "weights", default="fp32", show_default=True,
              help="precisions (comma list of fp32, int8, int4, int4:BLOCK, w8a8): our bundles (retrace-export build "
                   "--weights), onnxruntime-genai's builder models and llama.cpp's GGUF (int4: Q4_K_M, int8: Q8_0) at "
                   "each (w8a8: ours only); quantized systems' names end in -int4 etc.")
@click.option("--drafter-weights", type=click.Choice(["fp32", "int8", "int4", "w8a8"]), default=None,
              help="our bundles' drafter at this precision (retrace-export build --drafter-weights; default: the "
                   "target's); the bench JSON records it, system names stay as they are")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0: greedy, outputs compared token for token; > 0: every system samples at this temperature, "
                   "--top-p and --top-k with its own sampler (Qwen3's non-thinking setting: 0.7, 0.8, 20)")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0: off")
@click.option("--seed", type=int, default=0, show_default=True, help="prompt i samples with seed + i")
@cli_errors
def bench(target, drafter, engine, prompts, max_new_tokens, batch_sizes, runs, limit, threads, systems, cache_dir,
          no_build_engine, draft_ar, peer_env, json_out, plot_out, profile_out, readme_table, verify_policy,
          tree_budget, tree_sources, prompt_lookup, tree_fixed, markdown_out, device, dtype, compile_steps,
          no_cuda_graphs, row_invariance, from_json, weights, drafter_weights, temperature, top_p, top_k, seed) -> None:
    """Benchmark ReTrace (torch and ONNX Runtime backends; ar, dflash, retrace modes) against transformers,
    transformers' DFlash and onnxruntime-genai, interleaved over runs; JSON, plots and a table."""
    from retrace.bench.cli import bench_command, command_line

    bench_command(target=target, drafter=drafter, engine=engine, prompts=prompts, max_new_tokens=max_new_tokens,
                  batch_sizes=batch_sizes, runs=runs, limit=limit, threads=threads, systems=systems,
                  cache_dir=cache_dir, build_engine=not no_build_engine, draft_ar=draft_ar, peer_env=peer_env,
                  json_out=json_out, plot_out=plot_out,
                  profile_out=profile_out, readme_table=readme_table, markdown_out=markdown_out,
                  from_json=from_json, command=command_line(click.get_current_context()),
                  verify_policy=verify_policy, tree_budget=tree_budget, tree_sources=tree_sources,
                  tree_fixed=tree_fixed, prompt_lookup=bool(LOOKUP[prompt_lookup]), weights=weights,
                  drafter_weights=drafter_weights,
                  device=device, dtype=dtype, compile_steps=compile_steps,
                  cuda_graphs=False if no_cuda_graphs else None, row_invariant=row_invariance is not False,
                  temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)


from retrace.serve.cli import serve  # noqa: E402  (imports fastapi/uvicorn only when run)

main.add_command(serve)
# `python -m retrace` (retrace/__main__.py) runs the CLI; retrace.serve.cli imports only retrace.cli_options,
# never this module, so the two import each other in one direction only (tests/test_import_graph.py)
