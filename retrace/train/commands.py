"""Click commands `retrace train {dflash,conditioner}`, `retrace zoo tiny`, `retrace eval`.

The trainers' options are generated from their config dataclasses (retrace.train.config, .options). Only
click and those torch-free modules are imported here; the trainers (torch, transformers) load when a
command runs, so `retrace --help` stays fast.
"""

from __future__ import annotations

import json

import click

from retrace.cli_errors import cli_errors
from retrace.cli_options import runtime_flags
from retrace.train.config import ConditionerConfig, DFlashConfig, DraftArConfig
from retrace.train.options import click_options, from_options
from retrace.train.zoo import DEFAULT_RECIPE as ZOO_RECIPE
from retrace.train.zoo import RECIPES as ZOO_RECIPES


def _run_options(fn):
    """The options of a training run that are not settings of its config: inputs, resume, output format."""
    opts = [
        click.option("--target", "target_dir", required=True, type=click.Path(file_okay=False),
                     help="Qwen3 target HF dir (frozen)"),
        click.option("--data", required=True, type=click.Path(), help="training prompts: JSONL ({'prompt': ...} or "
                     "{'prompt_ids': [...]}; {'messages': [...]} with --chat), Parquet, or a `datasets` "
                     "save_to_disk dir"),
        click.option("--resume", is_flag=True, help="continue from OUT/train_state (optimizer, schedule, step)"),
        click.option("--quiet", is_flag=True, help="no progress bars"),
        click.option("--json", "as_json", is_flag=True, help="print the final metrics as JSON"),
    ]
    for o in reversed(opts):
        fn = o(fn)
    return fn


@click.group()
def train() -> None:
    """Train a DFlash drafter (distillation) or a ReTrace conditioner (on-policy)."""


@train.command("dflash")
@_run_options
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="drafter output dir (z-lab format)")
@click_options(DFlashConfig)
@click.option("--global-batch", type=int, default=None,
              help="sequences per optimizer step over all processes: batch-size x grad-accum x world size")
@click.option("--force", is_flag=True, help="train a new drafter into an OUT that already holds one (replaces it, "
              "its conditioner and its checkpoint; only in a directory retrace wrote)")
@cli_errors
def dflash_cmd(target_dir, data, resume, quiet, as_json, out_dir, global_batch, force, **settings) -> None:
    """Distil a DFlash drafter from a frozen target on the target's own responses."""
    from retrace.train.dflash import train_dflash
    from retrace.train.distributed import end_worker, from_env, grad_accum_for

    dist = from_env()
    grad_accum = grad_accum_for(settings["batch_size"], settings["grad_accum"], global_batch, dist.world)
    cfg = from_options(DFlashConfig, settings, grad_accum=grad_accum)
    m = train_dflash(target_dir, out_dir, data, cfg, resume=resume, progress=not quiet, force=force)
    if dist.is_main:  # only rank 0 reports
        if m.get("stopped") and not as_json:
            click.echo(f"stopped at step {m['steps']} of {cfg.steps}; continue with --resume")
        elif as_json:
            click.echo(json.dumps(m))
        else:
            click.echo(f"wrote {out_dir}: {m['steps']} steps, train loss {m['train_loss']}, val {m['val']}, "
                       f"runtime tau (val, greedy) {m['val_runtime_tau']}")
    end_worker(dist)


@train.command("draft-vocab")
@click.option("--target", "target_dir", required=True, type=click.Path(file_okay=False), help="Qwen3 target HF dir")
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(file_okay=False),
              help="drafter dir the map is written into (draft_vocab.safetensors + draft_vocab.json)")
@click.option("--data", default=None, type=click.Path(), help="prompts (as for train dflash): the target's greedy "
              "responses to them are counted")
@click.option("--responses", default=None, type=click.Path(dir_okay=False),
              help='responses instead: JSON {"responses": [[ids], ...]} (DRAFTER/train_data/responses.json) or '
              'JSONL {"response_ids": [...]}')
@click.option("--size", type=int, default=None, help="the N most frequent ids")
@click.option("--coverage", type=float, default=None, help="the fewest ids covering this fraction of the tokens")
@click.option("--num-prompts", type=int, default=None, help="use only the first N prompts")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--max-prompt-len", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="the target's responses to --data: greedy (0) or sampled (a sampling workload: its tokens reach "
              "beyond the greedy ones)")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=None, help="CPU threads")
@click.option("--json", "as_json", is_flag=True, help="print the map's metadata as JSON")
@cli_errors
def draft_vocab_cmd(target_dir, drafter_dir, data, responses, size, coverage, num_prompts, max_new_tokens,
                    max_prompt_len, temperature, seed, threads, as_json) -> None:
    """The drafter's LM head over the target ids its responses use most (EAGLE-3 style d2t/t2d map)."""
    from retrace.train.common import torch_threads
    from retrace.train.draft_vocab import make_draft_vocab

    with torch_threads(threads):
        vocab = make_draft_vocab(target_dir, drafter_dir, data=data, responses=responses, size=size,
                                 coverage=coverage, max_new_tokens=max_new_tokens, num_prompts=num_prompts,
                                 max_prompt_len=max_prompt_len, temperature=temperature, seed=seed)
    meta = {**vocab.meta, "draft_vocab_size": vocab.size, "target_vocab_size": vocab.target_vocab_size}
    click.echo(json.dumps(meta, indent=2) if as_json else
               f"draft vocabulary: {vocab.size} of {vocab.target_vocab_size} ids, coverage {vocab.coverage:.4f} "
               f"of {meta['counted_tokens']} response tokens -> {drafter_dir}")


@train.command("conditioner")
@_run_options
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(file_okay=False),
              help="trained DFlash drafter dir")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False),
              help="where to write (default: beside the drafter, in its dir)")
@click_options(ConditionerConfig)
@click.option("--force", is_flag=True, help="train a new conditioner where one already is (replaces it and its "
              "checkpoint)")
@cli_errors
def conditioner_cmd(target_dir, data, resume, quiet, as_json, drafter_dir, out_dir, force, **settings) -> None:
    """Train the ReTrace conditioner on-policy on a frozen drafter and target."""
    from retrace.train.conditioner import train_conditioner
    from retrace.train.distributed import end_worker, from_env

    cfg = from_options(ConditionerConfig, settings)
    m = train_conditioner(target_dir, drafter_dir, data, out_dir, cfg, resume=resume, progress=not quiet,
                          force=force)
    dist = from_env()
    if dist.is_main and as_json:  # only rank 0 reports
        click.echo(json.dumps(m))
    elif dist.is_main:
        f = m["final"] or {}
        click.echo(f"wrote conditioner to {out_dir or drafter_dir}: {m['steps']} steps, mean gate {m['mean_gate']}, "
                   f"val tau dflash {m['val_dflash_runtime_tau'].get('tau_mean')} vs retrace "
                   f"{(f.get('val_runtime') or {}).get('tau_mean')}")
    end_worker(dist)


@click.group()
def zoo() -> None:
    """Offline model zoo."""


@zoo.command("tiny")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False))
@click.option("--size", type=click.Choice(["test", "small"]), default="small", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="rebuild even if the manifest matches, or replace a zoo of another "
              "size/seed (never a directory that is not a zoo)")
@click.option("--threads", type=int, default=None)
@click.option("--numerics", type=click.Choice(["portable", "native"]), default="portable", show_default=True,
              help="portable: the same zoo bit for bit on any AVX2 x86-64 CPU (MKL and ATen pinned to their AVX2 "
                   "paths; the command re-runs itself with MKL_CBWR/ATEN_CPU_CAPABILITY set); native: this CPU's "
                   "fastest kernels (results differ between CPU models)")
@click.option("--train", "train_", is_flag=True,
              help="train the pair from scratch (25-50 CPU-minutes for small) instead of installing the trained "
                   "zoo that ships with retrace (small, seed 0: hash-checked, seconds)")
@click.option("--recipe", type=click.Choice(list(ZOO_RECIPES)), default=ZOO_RECIPE, show_default=True,
              help="the training recipe of the drafter and conditioner (retrace.train.zoo.RECIPES; another than the "
                   "shipped one needs --train)")
@click.option("--quiet", is_flag=True)
@cli_errors
def zoo_tiny(out_dir, size, seed, force, threads, numerics, train_, recipe, quiet) -> None:
    """The tiny target + DFlash drafter + ReTrace conditioner: the shipped pair, or trained offline,
    deterministically (cached)."""
    from retrace.train import numerics as numerics_mod
    from retrace.train import zoo_release
    from retrace.train.zoo import build_zoo, preflight

    if recipe != ZOO_RECIPE and not train_:
        raise click.UsageError(f"--recipe {recipe}: only the shipped recipe's zoo is installed; add --train")
    if not train_ and numerics == "portable" and zoo_release.shipped(size, seed) is not None:
        man = zoo_release.install(out_dir, size, seed, force=force, progress=not quiet)
    elif numerics == "portable" and numerics_mod.mode() != "portable":  # MKL/ATen read it at start: a child
        man = preflight(out_dir, size, seed, force, not quiet, numerics_mode="portable",  # errors, cache hits
                        recipe=recipe)
        if man is None:
            args = ["zoo", "tiny", "--out", out_dir, "--size", size, "--seed", str(seed), "--numerics", "portable"]
            args += (["--force"] if force else []) + (["--threads", str(threads)] if threads else [])
            args += (["--train"] if train_ else []) + ["--recipe", recipe]
            code, out = numerics_mod.run_portable(args + (["--quiet"] if quiet else []))
            click.echo(out, nl=False)
            if code:
                raise SystemExit(code)
            return
    else:
        man = build_zoo(out_dir, size=size, seed=seed, force=force, progress=not quiet, threads=threads,
                        recipe=recipe)
    m = man["metrics"]
    how = "cache hit" if man.get("cached") else "installed the shipped zoo" if man.get("release") else "built"
    click.echo(f"{how}: {out_dir} (size {size}, seed {seed})")
    click.echo(f"  target ppl {m['target_ppl']}, drafter train loss {m['drafter_train_loss']}, mean gate "
               f"{m['conditioner_mean_gate']}, total {man['timings']['total_s']}s"
               + (" (to train it, when it was built)" if man.get("release") else ""))
    for T, t in m["tau"].items():
        p = t.get("paired") or {}
        click.echo(f"  {T}: tau dflash {t['dflash']}, retrace {t['retrace']}, diff {p.get('mean_diff')} "
                   f"+- {p.get('se')} (n={p.get('n')})")


@zoo.command("inflate")
@click.option("--from", "zoo_dir", required=True, type=click.Path(file_okay=False), help="a zoo (retrace zoo tiny)")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False))
@click.option("--shape", type=click.Choice(["qwen3-0.6b", "qwen3-1.7b"]), default=None,
              help="a published Qwen3 shape (explicit sizes below override its fields)")
@click.option("--hidden-size", type=int, default=None)
@click.option("--layers", type=int, default=None)
@click.option("--heads", type=int, default=None)
@click.option("--kv-heads", type=int, default=None)
@click.option("--head-dim", type=int, default=None)
@click.option("--intermediate-size", type=int, default=None)
@click.option("--vocab-size", type=int, default=None)
@click.option("--seed", type=int, default=0, show_default=True, help="seed of the (discarded) new weights")
@click.option("--check-prompts", type=int, default=8, show_default=True, help="zoo prompts the checks run on")
@click.option("--check-new-tokens", type=int, default=48, show_default=True)
@click.option("--sample-tokens", type=int, default=10_000, show_default=True,
              help="tokens sampled at T=1 to check that no padded id comes out (0: skip)")
@click.option("--force", is_flag=True, help="rebuild even if the manifest matches")
@click.option("--threads", type=int, default=None)
@click.option("--quiet", is_flag=True)
@cli_errors
def zoo_inflate(zoo_dir, out_dir, shape, hidden_size, layers, heads, kv_heads, head_dim, intermediate_size,
                vocab_size, seed, check_prompts, check_new_tokens, sample_tokens, force, threads, quiet) -> None:
    """Expand a zoo pair function-preservingly to a real Qwen3 shape (same outputs, real compute)."""
    import dataclasses

    from retrace.errors import RetraceError
    from retrace.train.common import torch_threads
    from retrace.train.inflate import SHAPES, Shape
    from retrace.train.inflate_zoo import build_inflated

    given = dict(hidden_size=hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
                 vocab_size=vocab_size)
    given = {k: v for k, v in given.items() if v is not None}
    if shape is not None:
        target = dataclasses.replace(SHAPES[shape], **given)
    else:
        missing = [f"--{k}" for k in ("hidden-size", "layers", "heads", "kv-heads", "head-dim", "intermediate-size",
                                       "vocab-size") if given.get(_SHAPE_OPT[k]) is None]
        if missing:
            raise RetraceError(f"give --shape or all of the sizes (missing {', '.join(missing)})")
        target = Shape(**given)
    with torch_threads(threads):
        man = build_inflated(zoo_dir, out_dir, target, seed=seed, check_prompts=check_prompts,
                             check_new_tokens=check_new_tokens, sample_tokens=sample_tokens, force=force,
                             progress=not quiet)
    ex, p = man["exactness"], man["params"]
    click.echo(f"{'cache hit' if man.get('cached') else 'built'}: {out_dir} ({target.hidden_size} wide, "
               f"{target.num_hidden_layers} layers, vocab {target.vocab_size})")
    click.echo(f"  target non-embedding params {p['target_non_embedding'] / 1e6:.1f}M (total "
               f"{p['target_total'] / 1e6:.1f}M), "
               f"drafter layers {p['drafter_layers'] / 1e6:.1f}M, conditioner {p['conditioner'] / 1e6:.1f}M")
    click.echo(f"  greedy ar/dflash/retrace identical: {ex['greedy']['all_identical']}; real-id logits rel diff "
               f"{ex['logits']['rel_diff']:.2e}; padded ids sampled: "
               f"{(ex['sampled'] or {}).get('padded_ids')} of {(ex['sampled'] or {}).get('tokens')}")


_SHAPE_OPT = {"hidden-size": "hidden_size", "layers": "num_hidden_layers", "heads": "num_attention_heads",
              "kv-heads": "num_key_value_heads", "head-dim": "head_dim", "intermediate-size": "intermediate_size",
              "vocab-size": "vocab_size"}


@zoo.command("draft-ar")
@click.option("--from", "zoo_dir", required=True, type=click.Path(file_okay=False),
              help="a zoo directory (ZOO/target, ZOO/data/train_prompts.jsonl)")
@click.option("--out", "out_dir", default=None, type=click.Path(file_okay=False), help="default ZOO/draft-ar")
@click_options(DraftArConfig)
@click.option("--quiet", is_flag=True)
@cli_errors
def zoo_draft_ar(zoo_dir, out_dir, quiet, **settings) -> None:
    """Distil a small autoregressive Qwen3 draft model (same tokenizer) from a zoo target on its own greedy
    responses: the draft model of onnxruntime-genai's speculative peer `ortgenai-draft` (cached)."""
    from pathlib import Path

    from retrace.train.draft_ar import train_draft_ar

    z = Path(zoo_dir)
    out = Path(out_dir) if out_dir else z / "draft-ar"
    cfg = from_options(DraftArConfig, settings)
    meta = train_draft_ar(z / "target", out, z / "data" / "train_prompts.jsonl", cfg, progress=not quiet)
    click.echo(f"{out}: {cfg.layers}-layer draft, {meta['params'] / 1e6:.2f}M params; greedy agreement with the "
               f"target {meta['greedy_agreement_init']:.3f} at init -> {meta['greedy_agreement']:.3f} after "
               f"{meta['train']['steps']} steps ({meta['train']['train_s']} s)")


@click.command("eval")
@click.option("--target", "target_dir", required=True, type=click.Path(file_okay=False))
@click.option("--drafter", "drafter_dir", required=True, type=click.Path(file_okay=False))
@click.option("--prompts", "prompts_files", required=True, multiple=True, type=click.Path(dir_okay=False),
              help="JSONL prompts (repeatable)")
@click.option("--max-new-tokens", type=int, default=96, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--modes", default="dflash,retrace", show_default=True)
@click.option("--limit", type=int, default=None, help="first N prompts only")
@click.option("--seed", type=int, default=0, show_default=True)
@runtime_flags("max_batch", "block_size", "threads", "verify_policy", "tree_budget", "tree_sources", "device", "dtype",
               max_batch=32, device="cpu", dtype="float32", verify_policy="fixed",
               helps={"verify_policy": "fixed: every round verifies the whole block (tau measures the drafter); "
                                       "adaptive: as served"})
@click.option("--json", "as_json", is_flag=True)
@cli_errors
def eval_cmd(target_dir, drafter_dir, prompts_files, max_new_tokens, temperature, block_size, modes, limit, max_batch,
             seed, threads, device, dtype, verify_policy, tree_budget, tree_sources, as_json) -> None:
    """Acceptance length tau of dflash vs retrace on the same prompts (per prompt, pooled, paired SE)."""
    from retrace.errors import RetraceError
    from retrace.train.evaluate import evaluate, format_report

    mlist = tuple(m.strip() for m in modes.split(",") if m.strip())
    bad = [m for m in mlist if m not in ("dflash", "retrace")]
    if bad or not mlist:
        raise RetraceError(f"--modes takes dflash and/or retrace, got {modes!r}")
    rep = evaluate(target_dir, drafter_dir, list(prompts_files), max_new_tokens, temperature, block_size, mlist,
                   max_batch, seed, limit, threads, device, verify_policy, tree_budget, tree_sources, dtype)
    click.echo(json.dumps(rep) if as_json else format_report(rep))


__all__ = ["train", "zoo", "eval_cmd"]
