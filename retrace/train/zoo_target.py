"""First stage of the tiny offline model zoo: corpus -> tokenizer -> Qwen3 target -> prompt sets.

``build_target_stage(out_dir, size, seed)`` writes::

    out_dir/target/    HF Qwen3ForCausalLM dir: config.json, model.safetensors, generation_config.json,
                       tokenizer.json, tokenizer_config.json, zoo_manifest.json (stage keys + metrics)
    out_dir/prompts/   code.jsonl, docs.jsonl            (held-out evaluation prompts)
    out_dir/data/      train_prompts.jsonl, split.json   (drafter distillation prompts; corpus split)

and returns the metrics dict.  It is cached.  The manifest holds two keys:

- ``train_key``: size, seed, preset, target-training version, library versions, interpreter/stdlib.  It
  decides the tokenizer and the weights.
- ``prompts_key``: prompt-generation version, counts and seed.  It decides ``prompts/`` and ``data/``.

Both match and all files exist: the stored metrics come back at once (``metrics["cached"] is True``).
Only ``prompts_key`` differs: the prompt sets are regenerated from the existing tokenizer and weights (a
few seconds; ``metrics["prompts_rebuilt"] is True``).  Otherwise everything is rebuilt.  A build goes into
a temporary directory beside the outputs and is moved into place at the end (``target/`` last, so a
half-finished build never looks valid); a build replaces ``target/``, ``prompts/`` and ``data/`` wholesale.

Sizing of the ``small`` target (2 CPU cores, fp32): hidden 256, 4 layers, SwiGLU 768, 4 query
heads x head_dim 64 with 2 KV heads (GQA 2:1), untied embeddings, vocab 2048, trained at context 512 for
950 steps of 8 x 512 tokens (~1.6 epochs of the stdlib train split), torch.compile'd. How that size was
chosen (timings of fewer and more steps): docs/bench/zoo.md.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from ..digest import sha256_file
from ..staging import remove_orphaned
from . import corpus as corpus_mod
from . import numerics, target_lm
from . import prompts as prompts_mod
from . import tokenizer as tok_mod

TARGET_VERSION = 1  # bump when the tokenizer/weights change for the same preset and seed
MANIFEST_NAME = "zoo_manifest.json"

PROMPT_COUNTS = {
    "test": {"code": 32, "docs": 32, "train": 256},
    "small": {"code": 128, "docs": 128, "train": 4096},
}
SAMPLE_NEW_TOKENS = 60


def _versions() -> dict:
    import tokenizers
    import torch
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }


def train_key(size: str, seed: int, preset: target_lm.TargetPreset, numerics_mode: str | None = None) -> dict:
    """What decides the tokenizer and the weights (numerics_mode: default this process's, numerics.mode())."""
    return {
        "stage": "target",
        "target_version": TARGET_VERSION,
        "size": size,
        "seed": int(seed),
        "preset": preset.to_dict(),
        "stdlib": str(corpus_mod.stdlib_dir()),
        "versions": _versions(),
        "numerics": numerics_mode or numerics.mode(),
    }


def prompts_key(size: str, seed: int) -> dict:
    """What decides prompts/ and data/ (given the tokenizer)."""
    return {"prompts_version": prompts_mod.PROMPTS_VERSION, "seed": int(seed), "counts": PROMPT_COUNTS[size]}


def stage_key(size: str, seed: int, preset: target_lm.TargetPreset, numerics_mode: str | None = None) -> dict:
    """The whole stage's key (train key + prompts key): equal keys mean equal outputs."""
    return {"train": train_key(size, seed, preset, numerics_mode), "prompts": prompts_key(size, seed)}


def _expected_files() -> dict[str, list[str]]:
    return {
        "target": [
            "config.json",
            "model.safetensors",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            MANIFEST_NAME,
        ],
        "prompts": ["code.jsonl", "docs.jsonl"],
        "data": ["train_prompts.jsonl", "split.json"],
    }


def read_manifest(out_dir: str | Path) -> dict | None:
    p = Path(out_dir) / "target" / MANIFEST_NAME
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _manifest_keys(man: dict) -> tuple[dict | None, dict | None]:
    """(train_key, prompts_key) of a manifest; also reads version-1 manifests (one flat ``key``)."""
    if "train_key" in man:
        return man.get("train_key"), man.get("prompts_key")
    old = man.get("key") or {}
    if old.get("stage") != "target" or "stage_version" not in old:
        return None, None
    tk = {k: v for k, v in old.items() if k not in ("prompt_counts", "stage_version")}
    tk["target_version"] = old["stage_version"]
    return tk, None  # version-1 prompts end in a newline: always regenerate


def _files_complete(out_dir: Path, subs=("target", "prompts", "data")) -> bool:
    files = _expected_files()
    return all((out_dir / sub / n).is_file() for sub in subs for n in files[sub])


def cached_metrics(out_dir: str | Path, size: str = "small", seed: int = 0, **overrides) -> dict | None:
    """The stored metrics if ``out_dir`` holds a complete build with matching keys, else None."""
    out_dir = Path(out_dir)
    man = read_manifest(out_dir)
    if man is None:
        return None
    tk, pk = _manifest_keys(man)
    if tk != train_key(size, seed, target_lm.get_preset(size, **overrides)) or pk != prompts_key(size, seed):
        return None
    if not _files_complete(out_dir):
        return None
    return dict(man["metrics"], cached=True)


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[zoo target] {msg}", file=sys.stderr, flush=True)


def build_target_stage(
    out_dir: str | Path,
    size: str = "small",
    seed: int = 0,
    *,
    force: bool = False,
    progress: bool = True,
    num_threads: int | None = None,
    **overrides,
) -> dict:
    """Build (or reuse) the target stage of the tiny zoo in ``out_dir``; returns metrics.

    ``overrides`` replace fields of the size preset (:class:`retrace.train.target_lm.TargetPreset`), e.g.
    ``steps=50``; they are part of the cache key.  ``force`` rebuilds everything.
    """
    out_dir = Path(out_dir)
    preset = target_lm.get_preset(size, **overrides)
    tkey, pkey = train_key(size, seed, preset), prompts_key(size, seed)
    reuse_target = False
    if not force:
        hit = cached_metrics(out_dir, size, seed, **overrides)
        if hit is not None:
            _log(progress, f"cache hit: {out_dir / 'target'}")
            return hit
        man = read_manifest(out_dir)
        reuse_target = (
            man is not None and _manifest_keys(man)[0] == tkey and _files_complete(out_dir, ("target",))
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(out_dir)
    staging = out_dir / f".zoo-target-tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        with target_lm.torch_threads(num_threads) as nthreads:
            if reuse_target:
                _log(progress, "target weights match; regenerating prompt sets only")
                metrics = _rebuild_prompts(out_dir, staging, size, seed, tkey, pkey, progress)
            else:
                metrics = _build(staging, size, seed, preset, tkey, pkey, progress, nthreads)
        _install(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dict(metrics, cached=False)


def _remove_stale_staging(out_dir: Path) -> None:
    """Delete temporary build dirs left by builds whose process is gone (killed, crashed)."""
    found = []
    for p in out_dir.glob(".zoo-target-tmp-*"):
        try:
            found.append((p, int(p.name.split("-")[3])))
        except (IndexError, ValueError):
            continue
    remove_orphaned(found)


def _install(staging: Path, out_dir: Path) -> None:
    trash = staging / "old"
    trash.mkdir()
    # invalidate the cache marker first, then swap data and prompts, and the target dir last
    for name in ("target", "data", "prompts"):
        if (out_dir / name).exists():
            os.replace(out_dir / name, trash / name)
    for name in ("data", "prompts", "target"):
        os.replace(staging / name, out_dir / name)


def _write_manifest(tdir: Path, tkey: dict, pkey: dict, metrics: dict, preset_seq_len: int, nthreads) -> None:
    manifest = {
        "train_key": tkey,
        "prompts_key": pkey,
        "metrics": metrics,
        "mask_token_id": tok_mod.MASK_ID,
        "eos_token_id": tok_mod.EOS_ID,
        "pad_token_id": tok_mod.PAD_ID,
        "trained_context_length": preset_seq_len,
        "created_unix": int(time.time()),
        "torch_threads": nthreads,
    }
    (tdir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")


def _prompt_stage(stage: Path, split, tok, model, size: str, seed: int) -> dict:
    """Write prompts/ and data/ into ``stage``; returns prompt counts and greedy samples."""
    counts = PROMPT_COUNTS[size]
    code = prompts_mod.code_prompts(split.eval, tok, counts["code"], seed)
    docs = prompts_mod.docs_prompts(
        corpus_mod.pydoc_topics(), tok, counts["docs"], seed, fallback_files=split.eval
    )
    trainp = prompts_mod.train_prompts(split.train, tok, counts["train"], seed)
    prompts_mod.write_jsonl(stage / "prompts" / "code.jsonl", code)
    prompts_mod.write_jsonl(stage / "prompts" / "docs.jsonl", docs)
    prompts_mod.write_jsonl(stage / "data" / "train_prompts.jsonl", trainp)
    split_info = dict(
        split.summary(),
        train_paths=[f.relpath for f in split.train],
        eval_paths=[f.relpath for f in split.eval],
        salt=corpus_mod.SPLIT_SALT,
    )
    (stage / "data" / "split.json").write_text(json.dumps(split_info, indent=2) + "\n")

    samples = {}
    for name, rows in (("code", code), ("docs", docs)):
        if not rows:
            continue
        ids = tok.encode(rows[0]["prompt"], add_special_tokens=False).ids
        new = target_lm.greedy_continue(model, ids, SAMPLE_NEW_TOKENS, eos_id=tok_mod.EOS_ID)
        samples[name] = {
            "prompt_id": rows[0]["id"],
            "prompt_tail": rows[0]["prompt"][-200:],
            "completion": tok.decode(new, skip_special_tokens=False),
            **target_lm.repetition_stats(new),
        }
    return {
        "prompts": {"code": len(code), "docs": len(docs), "train": len(trainp)},
        "samples": samples,
        "sample": samples.get("code", {}).get("completion", ""),
    }


def _rebuild_prompts(
    out_dir: Path, stage: Path, size: str, seed: int, tkey: dict, pkey: dict, progress: bool
):
    from tokenizers import Tokenizer
    from transformers import Qwen3ForCausalLM

    man = read_manifest(out_dir)
    tdir = stage / "target"
    shutil.copytree(out_dir / "target", tdir)
    split = corpus_mod.load_corpus(size)
    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    model = Qwen3ForCausalLM.from_pretrained(str(tdir)).float().eval()
    metrics = dict(man["metrics"])
    metrics.pop("cached", None)
    metrics.update(_prompt_stage(stage, split, tok, model, size, seed))
    metrics["prompts_rebuilt"] = True
    metrics["target_dir"] = str(out_dir / "target")
    _write_manifest(tdir, tkey, pkey, metrics, man.get("trained_context_length"), man.get("torch_threads"))
    _log(progress, f"prompts: {metrics['prompts']}")
    return metrics


def _build(
    stage: Path, size: str, seed: int, preset, tkey: dict, pkey: dict, progress: bool, nthreads: int
) -> dict:
    t_start = time.perf_counter()
    c_start = time.process_time()

    # 1. corpus
    split = corpus_mod.load_corpus(size)
    _log(
        progress,
        f"corpus: {len(split.train)} train / {len(split.eval)} eval files, "
        f"{split.train_chars / 1e6:.2f} / {split.eval_chars / 1e6:.2f} M chars",
    )

    # 2. tokenizer
    t0 = time.perf_counter()
    tok = tok_mod.train_bpe([f.text for f in split.train], preset.vocab_size)
    vocab = tok.get_vocab_size()
    ok, bad = tok_mod.roundtrip_ok(tok, [f.text for f in split.eval])
    if not ok:
        raise RuntimeError(f"tokenizer does not round-trip held-out text: {bad!r}")
    train_ids = tok_mod.encode_batch(tok, [f.text for f in split.train])
    eval_ids = tok_mod.encode_batch(tok, [f.text for f in split.eval])
    train_stream = target_lm.pack_stream(train_ids, tok_mod.EOS_ID)
    eval_stream = target_lm.pack_stream(eval_ids, tok_mod.EOS_ID)
    tok_seconds = time.perf_counter() - t0
    _log(
        progress,
        f"tokenizer: vocab {vocab}, {train_stream.numel()} train / {eval_stream.numel()} eval tokens "
        f"({split.train_chars / train_stream.numel():.2f} chars/token), {tok_seconds:.1f}s",
    )

    # 3. target
    config = target_lm.make_config(preset, vocab, tok_mod.EOS_ID, tok_mod.PAD_ID)
    model = target_lm.build_model(config, seed)
    params = target_lm.count_params(model)
    _log(
        progress,
        f"target: {params['total'] / 1e6:.2f}M params ({params['non_embedding'] / 1e6:.2f}M non-embedding), "
        f"{preset.steps} steps x {preset.batch_size} x {preset.seq_len} tokens, {nthreads} threads",
    )
    train_stats = target_lm.train_target(model, train_stream, preset, seed=seed, progress=progress)
    reset = target_lm.reset_untrained_rows(model, [tok_mod.PAD_ID, tok_mod.MASK_ID], exclude=[tok_mod.EOS_ID])
    t0 = time.perf_counter()
    ev = target_lm.evaluate_ppl(
        model, eval_stream, preset.seq_len, preset.eval_tokens, token_bytes=target_lm.token_byte_lengths(tok)
    )
    eval_seconds = time.perf_counter() - t0
    _log(
        progress,
        f"held-out ppl {ev['ppl']:.2f} (uniform {vocab}), {ev.get('bits_per_byte', 0):.3f} bits/byte, "
        f"train {train_stats['train_seconds']:.0f}s",
    )

    tdir = stage / "target"
    target_lm.save_target(model, tdir, tok_mod.EOS_ID, tok_mod.PAD_ID)
    tok_mod.save_tokenizer(tok, tdir, model_max_length=preset.max_position_embeddings)

    # 4. prompts (+ greedy samples of held-out prompts)
    pm = _prompt_stage(stage, split, tok, model, size, seed)

    metrics = {
        "size": size,
        "seed": int(seed),
        "ppl": round(ev["ppl"], 4),
        "nll": round(ev["nll"], 5),
        "bits_per_byte": round(ev.get("bits_per_byte", float("nan")), 5),
        "uniform_ppl": vocab,
        "eval_tokens": ev["eval_tokens"],
        "vocab_size": vocab,
        "params": params,
        "params_total": params["total"],
        "train": {k: v for k, v in train_stats.items() if k != "loss_curve"},
        "loss_curve": train_stats["loss_curve"],
        "train_seconds": train_stats["train_seconds"],
        "eval_seconds": round(eval_seconds, 2),
        "tokenizer_seconds": round(tok_seconds, 2),
        "chars_per_token": round(split.train_chars / max(1, train_stream.numel() - len(split.train)), 3),
        "num_threads": nthreads,
        "corpus": split.summary(),
        "special_tokens": {"eos": tok_mod.EOS_ID, "pad": tok_mod.PAD_ID, "mask": tok_mod.MASK_ID},
        "mask_row_reset": reset,
        **pm,
        "weights_sha256": sha256_file(tdir / "model.safetensors"),
        "tokenizer_sha256": sha256_file(tdir / "tokenizer.json"),
        "total_seconds": round(time.perf_counter() - t_start, 2),
        "total_cpu_seconds": round(time.process_time() - c_start, 2),
        "target_dir": str(stage.parent / "target"),
    }
    _write_manifest(tdir, tkey, pkey, metrics, preset.seq_len, nthreads)
    return metrics
