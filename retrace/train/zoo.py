"""`retrace zoo tiny`: a tiny, offline, deterministic target + DFlash drafter + ReTrace conditioner.

Layout of DIR::

    DIR/target/       HF Qwen3 dir with tokenizer (mask token <|mask|> in the vocab)   [target stage]
    DIR/prompts/      code.jsonl, docs.jsonl: held-out evaluation prompts                [target stage]
    DIR/data/         train_prompts.jsonl (drafter/conditioner training; validation is a split of it), train_chat.jsonl
                      (the same as one-turn conversations: what the zoo trains on, through --chat)
    DIR/drafter/      DFlash files (config.json, model.safetensors) + retrace_config.json + retrace.safetensors
                      (+ dflash_train.json, conditioner_train.json: training logs)
    DIR/manifest.json seed, versions, settings, metrics (target ppl, drafter loss, tau dflash/retrace at
                      T=0 and T=1 with paired SE, mean gate, lossless check), timings, a text sample

Cached: a second run with the same size/seed/settings/library versions returns the manifest at once.
Atomic and owned (retrace.output_dir, kind "zoo"): everything is built in a temporary directory beside DIR
and renamed into place at the end (a finished target stage already in DIR is reused, so changing only the
drafter stages does not retrain the target). DIR must be absent, empty or a zoo: any other directory is
refused even with --force. A zoo of another size or seed is replaced only with --force; a zoo of the same
size and seed whose settings or library versions changed is rebuilt (it is a cache of exactly that zoo).
SIGINT/SIGTERM leave DIR as it was.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from retrace.errors import RetraceError
from retrace.output_dir import OutputDirError, _sibling, check_output, staged_output

ZOO_VERSION = 2  # 2: fp32 eager training under portable numerics (retrace.train.numerics)
MANIFEST = "manifest.json"
KIND = "zoo"  # the owner-marker kind (retrace.output_dir)
# draft-ar: `retrace zoo draft-ar`; release.json: a shipped zoo (retrace.train.zoo_release)
_ZOO_ENTRIES = {"target", "drafter", "prompts", "data", "draft-ar", MANIFEST, "release.json"}

# Per size: drafter, conditioner and evaluation settings (sized for 2 CPU cores: see the module README
# notes in the manifest's "timings"). These are the base of every recipe (RECIPES) and the settings of the zoo
# shipped before the acceptance-aligned recipe (`--recipe legacy`); PRESETS (below) is what ships now.
_BASE: dict[str, dict] = {
    "test": {
        "dflash": dict(block_size=8, num_layers=1, steps=30, batch_size=8, blocks_per_seq=8, num_prompts=96,
                       val_prompts=16, max_new_tokens=32, gen_batch=48, eval_every=0, save_every=0,
                       eval_tau_prompts=8, eval_tau_new_tokens=24, warmup=5, lr=3e-3),
        "conditioner": dict(phases=1, steps_per_phase=8, rollout_prompts=24, rollout_batch=24, max_new_tokens=32,
                            num_prompts=96, val_prompts=16, eval_prompts=8, eval_new_tokens=24, blocks_per_seq=8,
                            batch_size=8, warmup=2),
        "eval": dict(n_prompts=16, max_new_tokens=32, temperatures=[0.0, 1.0], max_batch=16, lossless_prompts=4,
                     workers=1),
    },
    # Measured on these machines (see the trainer reports): copy-init drafters learn faster than random ones
    # (val tau_est 2.80 vs 2.19 after 600 steps); 2000 steps at lr 3e-3 reach tau_est 3.8 / runtime tau 2.8-3.1
    # and are still creeping up; one-thread processes beat two-thread ones for these shapes. Greedy responses
    # only: a 25% / 50% share of T=1 samples raised val tau at T=1 from 1.33 to 1.52 / 1.58 but cut it at T=0
    # from 2.93 to 2.51 / 2.40 (see --gen-sample-frac).
    "small": {
        "dflash": dict(block_size=16, num_layers=1, init="copy", steps=1000, batch_size=8, blocks_per_seq=16,
                       num_prompts=1536, val_prompts=64, max_new_tokens=96, gen_batch=64, gen_workers=2,
                       eval_every=250, save_every=0, eval_tau_prompts=32, eval_tau_new_tokens=64, warmup=60,
                       lr=3e-3),
        "conditioner": dict(phases=1, steps_per_phase=120, rollout_prompts=192, rollout_batch=64, max_new_tokens=96,
                            num_prompts=1536, val_prompts=64, eval_prompts=32, eval_new_tokens=64, blocks_per_seq=16,
                            batch_size=8, warmup=20, diagnose_seqs=32),
        "eval": dict(n_prompts=128, max_new_tokens=96, temperatures=[0.0, 1.0], max_batch=64, lossless_prompts=8,
                     workers=2),
    },
}


# Drafter recipes: changes of a size's base "dflash" and "conditioner" settings, chosen by `retrace zoo tiny
# --train --recipe NAME`. "shipped" (the default) is PRESETS[size]: the small zoo is built by SHIPPED_AS, the
# recipe of the shipped zoo (retrace/train/shipped/, pinned by its release record; changing it means
# re-releasing: `make zoo-release`); "legacy" is the base itself, the recipe shipped before. The measurements
# behind each: docs/training-objective.md.
DEFAULT_RECIPE = "shipped"
_ACCEPT = {"objective": "accept"}
_ACCEPT_2L = dict(_ACCEPT, num_layers=2, target_layer_ids=[2])
RECIPES: dict[str, dict[str, dict]] = {
    DEFAULT_RECIPE: {},  # PRESETS[size]
    "legacy": {},  # the base: DFlash's position decay, one layer (the zoo shipped until 2026-12-01)
    # measured: held-out T=0 pooled tau 3.18 vs 2.27 at the zoo's 1000 steps and cost
    "accept": {"dflash": _ACCEPT, "conditioner": _ACCEPT},
    # measured: T=0 pooled tau 3.76, T=1 1.39 (a draft call 1.11 decodes against 1.00 for one layer)
    "accept-2l": {"dflash": _ACCEPT_2L, "conditioner": _ACCEPT},
    # T=1: the drafter trained on the target's distribution at every slot (KL) instead of its greedy token
    "accept-2l-soft": {"dflash": dict(_ACCEPT_2L, soft_labels=True), "conditioner": _ACCEPT},
    # and slots weighted by their T=1 reach (the overlaps), a quarter of the responses sampled at T=1
    "accept-2l-overlap": {"dflash": dict(_ACCEPT_2L, objective="accept-overlap", soft_labels=True,
                                         gen_sample_frac=0.25), "conditioner": _ACCEPT},
}
# the recipe each size's shipped settings come from: the small zoo since 2026-12-02 is accept-2l-overlap (held-out
# pooled tau at T=0 3.21 vs 2.27 for legacy, at T=1 1.90 vs 1.32: the release's compared_with)
SHIPPED_AS = {"test": "legacy", "small": "accept-2l-overlap"}


def _apply(base: dict, change: dict) -> dict:
    return {stage: dict(s, **change.get(stage, {})) for stage, s in base.items()}


PRESETS: dict[str, dict] = {size: _apply(_BASE[size], RECIPES[SHIPPED_AS[size]]) for size in _BASE}


def preset(size: str, recipe: str = DEFAULT_RECIPE) -> dict:
    """The settings of a zoo of this size built by this drafter recipe (the shipped one: PRESETS[size]; another:
    the base settings with the recipe's changes)."""
    if size not in PRESETS:
        raise RetraceError(f"unknown zoo size {size!r} (choose from {', '.join(PRESETS)})")
    if recipe not in RECIPES:
        raise RetraceError(f"unknown zoo recipe {recipe!r} (choose from {', '.join(RECIPES)})")
    if recipe == DEFAULT_RECIPE:
        return PRESETS[size]
    return _apply(_BASE[size], RECIPES[recipe])


def _versions() -> dict:
    import tokenizers
    import torch
    import transformers

    from retrace import __version__ as rv

    return {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "retrace": rv}


def zoo_key(size: str, seed: int, preset: dict, numerics_mode: str | None = None) -> dict:
    """numerics_mode: "portable" or "native" (default: this process's, retrace.train.numerics.mode())."""
    from retrace.train import numerics, target_lm, zoo_target

    mode = numerics_mode or numerics.mode()
    return {"zoo_version": ZOO_VERSION, "size": size, "seed": int(seed), "preset": preset,
            "target_stage": zoo_target.stage_key(size, seed, target_lm.get_preset(size), mode),
            "versions": _versions(), "numerics": mode}


REQUIRED = ["target/config.json", "target/model.safetensors", "target/tokenizer.json", "drafter/config.json",
            "drafter/model.safetensors", "drafter/retrace_config.json", "drafter/retrace.safetensors",
            "prompts/code.jsonl", "prompts/docs.jsonl", MANIFEST]


def read_manifest(out: str | Path) -> dict | None:
    try:
        return json.loads((Path(out) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def cached_manifest(out: str | Path, size: str = "small", seed: int = 0,
                    numerics_mode: str | None = None, recipe: str = DEFAULT_RECIPE) -> dict | None:
    out = Path(out)
    man = read_manifest(out)
    if man is None or man.get("key") != zoo_key(size, seed, preset(size, recipe), numerics_mode):
        return None
    if not all((out / f).is_file() for f in REQUIRED):
        return None
    return man


def is_legacy_zoo(path: Path) -> bool:
    """A marker-less zoo from an older retrace: a zoo manifest and nothing but the zoo's own entries."""
    man = read_manifest(path)
    names = {p.name for p in path.iterdir()} - {".retrace-output.json"}
    return (isinstance(man, dict) and isinstance(man.get("key"), dict) and "zoo_version" in man["key"]
            and names <= _ZOO_ENTRIES)


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[zoo] {msg}", file=sys.stderr, flush=True)


def build_zoo(out: str | Path, size: str = "small", seed: int = 0, force: bool = False, progress: bool = True,
              threads: int | None = None, recipe: str = DEFAULT_RECIPE) -> dict:
    """Build (or reuse) the tiny zoo in `out`; returns the manifest (with "cached": True on a cache hit)."""
    out = Path(out).absolute()
    man = preflight(out, size, seed, force, progress, recipe=recipe)
    if man is not None:
        return man
    from retrace.train import numerics

    try:
        with staged_output(out, KIND, force=True, legacy=is_legacy_zoo, what="zoo") as tmp, numerics.deterministic():
            man = _build(out, tmp, size, seed, force, progress, threads, recipe)
    except BaseException:
        if target_stash(out).is_dir():
            _log(True, f"kept the finished target stage in {target_stash(out)}: the next run with the same "
                       "size and seed reuses it")
        raise
    shutil.rmtree(target_stash(out), ignore_errors=True)
    return dict(man, cached=False)


def target_stash(out: Path) -> Path:
    """Where a finished target stage (the build's longest part) waits while the later stages run, so that a
    failure after it costs only those stages on the next run; removed once the zoo is installed."""
    return out.parent / f".{out.name}.zoo-target-stage"


def _copy_target_stage(src: Path, dst: Path) -> None:
    for sub in ("target", "prompts", "data"):
        shutil.copytree(src / sub, dst / sub)


def _stash_target(tmp: Path, out: Path) -> None:
    stash, staging = target_stash(out), _sibling(out, "stash")
    try:
        _copy_target_stage(tmp, staging)
        shutil.rmtree(stash, ignore_errors=True)
        staging.rename(stash)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def preflight(out: str | Path, size: str, seed: int, force: bool, progress: bool = True,
              numerics_mode: str | None = None, recipe: str = DEFAULT_RECIPE) -> dict | None:
    """What build_zoo checks before building: the size, and that `out` may hold this zoo (errors name the
    problem). -> the manifest (with "cached": True) when `out` already holds exactly this zoo, else None."""
    preset(size, recipe)  # names an unknown size or recipe
    out = Path(out).absolute()
    if check_output(out, KIND, force=True, legacy=is_legacy_zoo, what="zoo") and not force:
        man = cached_manifest(out, size, seed, numerics_mode, recipe)
        if man is not None:
            _log(progress, f"cache hit: {out / MANIFEST}")
            return dict(man, cached=True)
        refuse_other_zoo(out, size, seed)
        _log(progress, f"{out} holds a zoo of size {size}, seed {seed} built with other settings or library "
                       "versions: rebuilding it")
    return None


def refuse_other_zoo(out: Path, size: str, seed: int) -> None:
    """`out` holds a zoo of another size or seed: replacing it needs --force."""
    old = read_manifest(out) or {}
    if (old.get("size"), old.get("seed")) != (size, int(seed)):
        raise OutputDirError(f"{out} holds a zoo of size {old.get('size')!r}, seed {old.get('seed')!r}; pass "
                             f"--force to replace it with size {size!r}, seed {seed} (or choose another --out)")


def _build(out: Path, tmp: Path, size: str, seed: int, force: bool, progress: bool, threads: int | None,
           recipe: str = DEFAULT_RECIPE) -> dict:
    import torch

    from retrace.models.drafter import load_pair
    from retrace.runtime.tokenizer import TextCodec
    from retrace.train import common as cm
    from retrace.train import numerics, zoo_target
    from retrace.train import prompts as prompts_mod  # chat-form training prompts (issue 15)
    from retrace.train import tokenizer as tok_mod
    from retrace.train.conditioner import ConditionerConfig, train_conditioner
    from retrace.train.dflash import DFlashConfig, train_dflash
    from retrace.train.evaluate import tau_worker
    from retrace.train.rollout import make_backend, run_requests

    settings = preset(size, recipe)
    key = zoo_key(size, seed, settings)
    t_all = time.perf_counter()
    cpu_all = time.process_time()
    timings: dict[str, float] = {}

    # 1. target stage (reuse a finished one from `out`, or the one a failed earlier run left in the stash)
    t0 = time.perf_counter()
    src = next((d for d in (out, target_stash(out)) if not force and zoo_target.cached_metrics(d, size, seed)), None)
    if src is not None:
        _copy_target_stage(src, tmp)
    tm = zoo_target.build_target_stage(tmp, size, seed, progress=progress, num_threads=threads)
    if src is None:
        _stash_target(tmp, out)
    timings["target_s"] = round(time.perf_counter() - t0, 2)

    with cm.torch_threads(threads or 1):  # the stages below are latency-bound: one thread per process
        # 2. DFlash drafter
        t0 = time.perf_counter()
        # chat form (issue 15): one-turn conversations through the tokenizer's minimal chat template, which
        # renders them to the very same tokens as the plain prompts (outputs and zoo key unchanged)
        tok_mod.ensure_chat_template(tmp / "target")  # a cached target stage may predate the template
        data = prompts_mod.write_chat_jsonl(tmp / "data" / "train_prompts.jsonl", tmp / "data" / "train_chat.jsonl")
        dcfg = DFlashConfig(seed=seed, device="cpu", threads=1, chat=True, **settings["dflash"])
        dm = train_dflash(tmp / "target", tmp / "drafter", data, dcfg, progress=progress)
        timings["drafter_s"] = round(time.perf_counter() - t0, 2)

        # 3. ReTrace conditioner (on-policy)
        t0 = time.perf_counter()
        ccfg = ConditionerConfig(seed=seed, device="cpu", threads=1, chat=True, **settings["conditioner"])
        cmet = train_conditioner(tmp / "target", tmp / "drafter", data, None, ccfg, progress=progress)
        timings["conditioner_s"] = round(time.perf_counter() - t0, 2)
        for junk in ("train_state", "conditioner_state", "train_data"):
            shutil.rmtree(tmp / "drafter" / junk, ignore_errors=True)

        # 4. evaluation on the held-out prompts (both domains interleaved)
        t0 = time.perf_counter()
        ev = settings["eval"]
        codec = TextCodec.find(tmp / "target")
        rows_by = [cm.read_prompts_jsonl(tmp / "prompts" / f"{d}.jsonl") for d in ("code", "docs")]
        rows = [r for pair in zip(*rows_by, strict=False) for r in pair][: ev["n_prompts"]]
        prompts = cm.encode_prompts(rows, codec)
        target, drafter = load_pair(tmp / "target", tmp / "drafter")
        evals = {}
        reps = cm.parallel_map(tau_worker, [(str(tmp / "target"), str(tmp / "drafter"), prompts, ("dflash", "retrace"),
                                             ev["max_new_tokens"], T, None, ev["max_batch"], seed)
                                            for T in ev["temperatures"]], ev.get("workers", 1))
        for T, rep in zip(ev["temperatures"], reps, strict=True):
            evals[f"T{T:g}"] = {m: {k: v for k, v in r.items() if k != "per_prompt"} for m, r in rep["modes"].items()}
            evals[f"T{T:g}"]["paired"] = rep["paired"]
            evals[f"T{T:g}"]["per_prompt"] = {m: r["per_prompt"] for m, r in rep["modes"].items()}
            if "outputs_equal" in rep:
                evals[f"T{T:g}"]["outputs_equal"] = rep["outputs_equal"]
        timings["eval_s"] = round(time.perf_counter() - t0, 2)

        # 5. lossless check (greedy retrace == the target's own greedy) and a text sample
        n = min(ev["lossless_prompts"], len(prompts))
        B = drafter.config.block_size
        max_len = max(len(p) for p in prompts[:n]) + ev["max_new_tokens"] + B + 2
        outs = {}
        for mode in ("ar", "retrace"):
            be = make_backend(target, drafter, n, max_len)
            rolls, _ = run_requests(be, prompts[:n], mode, ev["max_new_tokens"], 0.0, seed)
            outs[mode] = [r.output_ids for r in rolls]
        lossless = outs["ar"] == outs["retrace"]
        sample = {"prompt_tail": codec.decode(prompts[0])[-300:], "completion": codec.decode(outs["retrace"][0])}
        del torch

    metrics = {
        "target_ppl": tm.get("ppl"),
        "target_params": tm.get("params_total"),
        "drafter_train_loss": dm.get("train_loss"),
        "drafter_val": dm.get("val"),
        "drafter_val_runtime_tau": dm.get("val_runtime_tau"),
        "drafter_history": dm.get("history"),
        "conditioner_mean_gate": cmet.get("mean_gate"),
        "conditioner_history": cmet.get("history"),
        "tau": {T: {"dflash": g.get("dflash", {}).get("tau"), "retrace": g.get("retrace", {}).get("tau"),
                    "dflash_pooled": g.get("dflash", {}).get("tau_pooled"),
                    "retrace_pooled": g.get("retrace", {}).get("tau_pooled"), "paired": g.get("paired")}
                for T, g in evals.items()},
        "tau_kind": "per-prompt mean over held-out prompts (pooled also given)",
        "eval": evals,
        "lossless_check": {"prompts": n, "greedy_retrace_equals_target": lossless},
    }
    timings["total_s"] = round(time.perf_counter() - t_all, 2)
    timings["cpu_s"] = round(time.process_time() - cpu_all, 2)
    timings["target_train_s"] = tm.get("train_seconds")
    timings["drafter_detail"] = dm.get("seconds")
    timings["conditioner_detail"] = cmet.get("seconds")
    man = {
        "key": key, "size": size, "seed": int(seed), "versions": key["versions"], "metrics": metrics,
        "timings": timings, "sample": sample, "created_unix": int(time.time()), "numerics": numerics.describe(),
        "layout": {"target": "target/", "drafter": "drafter/", "prompts": "prompts/", "data": "data/"},
        "eval_prompts": {"files": ["prompts/code.jsonl", "prompts/docs.jsonl"], "n": len(prompts),
                         "interleaved": True},
    }
    if recipe != DEFAULT_RECIPE:
        man["recipe"] = {"name": recipe, **RECIPES[recipe]}
    if not lossless:
        raise RetraceError("zoo check failed: greedy retrace output differs from the target's own greedy output")
    (tmp / MANIFEST).write_text(json.dumps(man, indent=2, ensure_ascii=False) + "\n")
    return man


__all__ = ["build_zoo", "cached_manifest", "PRESETS", "RECIPES", "preset", "read_manifest"]
