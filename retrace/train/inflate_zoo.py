"""`retrace zoo inflate`: the trained zoo pair, function-preservingly expanded to a real Qwen3 shape.

Layout of DIR (like the zoo's)::

    DIR/target/        HF Qwen3 dir (inflated weights, the zoo's tokenizer and generation config)
    DIR/drafter/       DFlash files + ReTrace conditioner files, inflated
    DIR/prompts/       the zoo's held-out prompts (copied)
    DIR/manifest.json  source, shapes, parameter counts, the inflation plan and the exactness figures

Cached (same source files, shape, seed, settings and versions: the manifest comes back at once) and atomic
(built in a temporary sibling directory, checked, then renamed into place).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from retrace.digest import sha256_named_files
from retrace.errors import RetraceError
from retrace.output_dir import staged_output

INFLATE_VERSION = 1
KIND = "inflated-zoo"  # owner marker kind (retrace.output_dir)
MANIFEST = "manifest.json"
REQUIRED = ["target/config.json", "target/model.safetensors", "drafter/config.json", "drafter/model.safetensors",
            "drafter/retrace_config.json", "drafter/retrace.safetensors", MANIFEST]
SHAPE_KEYS = {"hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers",
              "num_attention_heads": "num_attention_heads", "num_key_value_heads": "num_key_value_heads",
              "head_dim": "head_dim", "intermediate_size": "intermediate_size", "vocab_size": "vocab_size"}


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[inflate] {msg}", file=sys.stderr, flush=True)


def _source_files(zoo: Path) -> list[Path]:
    files = [zoo / "target" / "config.json", *sorted((zoo / "target").glob("*.safetensors")),
             zoo / "drafter" / "config.json", *sorted((zoo / "drafter").glob("*.safetensors")),
             zoo / "drafter" / "retrace_config.json", *sorted((zoo / "prompts").glob("*.jsonl"))]
    missing = [str(p) for p in files if not p.is_file()]
    if missing or not (zoo / "prompts").is_dir():
        raise RetraceError(f"{zoo}: not a zoo directory (missing {missing or [str(zoo / 'prompts')]}); "
                           "build one with `retrace zoo tiny`")
    return files


def inflate_key(zoo: Path, shape: dict, seed: int, checks: dict) -> dict:
    from retrace.train.zoo import _versions

    source = sha256_named_files((p.name, p) for p in _source_files(zoo))
    return {"inflate_version": INFLATE_VERSION, "source_sha256": source, "shape": shape,
            "seed": int(seed), "checks": checks, "versions": _versions()}


def cached_manifest(out: Path, key: dict) -> dict | None:
    try:
        man = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if man.get("key") != key or not all((out / f).is_file() for f in REQUIRED):
        return None
    return man


def _shape_of(cfg: dict):
    from retrace.train.inflate import Shape

    heads = int(cfg["num_attention_heads"])
    return Shape(int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), heads,
                 int(cfg.get("num_key_value_heads") or heads), int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
                 int(cfg["intermediate_size"]), int(cfg["vocab_size"]))


def _prompts(zoo: Path, n: int) -> list[list[int]]:
    from retrace.runtime.tokenizer import TextCodec
    from retrace.train import common as cm

    files = sorted((zoo / "prompts").glob("*.jsonl"))
    by_file = [cm.read_prompts_jsonl(f) for f in files]
    rows = [r for group in zip(*by_file, strict=False) for r in group][:n]  # domains interleaved, like the zoo
    return cm.encode_prompts(rows, TextCodec.find(zoo / "target"))


def build_inflated(zoo: str | Path, out: str | Path, shape, seed: int = 0, check_prompts: int = 8,
                   check_new_tokens: int = 48, sample_tokens: int = 10_000, force: bool = False,
                   progress: bool = True) -> dict:
    """Inflate the zoo pair in `zoo` to `shape` (an inflate.Shape) into `out`; returns the manifest."""
    zoo, out = Path(zoo).absolute(), Path(out).absolute()
    checks = {"prompts": check_prompts, "new_tokens": check_new_tokens, "sample_tokens": sample_tokens}
    key = inflate_key(zoo, shape.to_dict(), seed, checks)
    if not force:
        man = cached_manifest(out, key)
        if man is not None:
            _log(progress, f"cache hit: {out / MANIFEST}")
            return dict(man, cached=True)
    with staged_output(out, KIND, force=True, what="inflated zoo") as tmp:
        man = _build(zoo, tmp, shape, seed, checks, key, progress)
    return dict(man, cached=False)


def _write_pair(zoo: Path, tmp: Path, shape, seed: int, prompts: list[list[int]], progress: bool) -> dict:
    """Write tmp/target and tmp/drafter; returns the plan summary, parameter counts and timings."""
    import torch

    from retrace.models.checkpoint import atomic_save_tensors, read_dir_tensors, read_tensors
    from retrace.models.conditioner import CONFIG_NAME, WEIGHTS_NAME
    from retrace.models.config import DrafterConfig, read_json
    from retrace.models.drafter import _drafter_files
    from retrace.models.target import Qwen3Target
    from retrace.train import inflate as inf
    from retrace.train.inflate_check import final_rho_min

    tcfg, dcfg = read_json(zoo / "target" / "config.json"), read_json(zoo / "drafter" / "config.json")
    ccfg = read_json(zoo / "drafter" / CONFIG_NAME)
    small = _shape_of(tcfg)
    if tcfg.get("tie_word_embeddings"):
        raise RetraceError(f"{zoo / 'target' / 'config.json'}: tied embeddings are not supported by inflate "
                           "(the LM head's padded rows and the embedding's constant channel must differ)")
    dshape = _shape_of(dcfg)
    bad = [k for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")
           if getattr(dshape, k) != getattr(small, k)]
    if bad or float(dcfg["rms_norm_eps"]) != float(tcfg["rms_norm_eps"]):
        raise RetraceError(f"{zoo / 'drafter' / 'config.json'}: inflate needs the drafter's {bad or 'rms_norm_eps'} "
                           "equal to the target's")
    if dshape.intermediate_size > shape.intermediate_size:
        raise RetraceError(f"drafter intermediate_size {dshape.intermediate_size} > the new shape's "
                           f"{shape.intermediate_size}")
    plan = inf.make_plan(small, shape, float(tcfg["rms_norm_eps"]))
    t0 = time.perf_counter()

    # pad logits: -1000 at the smallest final-norm factor seen on the check prompts, or as far as a weight that
    # float16 holds reaches (inflate.PAD_SCALE_MAX: -77 at the Qwen3-0.6B shape, e^-77 of the mass per id)
    small_t = Qwen3Target.from_pretrained(zoo / "target")
    rho = final_rho_min(small_t, prompts)
    pad_scale = inf.pad_scale_for(plan, rho)
    del small_t

    tsd = read_dir_tensors(zoo / "target")
    big_t = inf.target(tsd, plan, pad_scale, seed)
    (tmp / "target").mkdir()
    atomic_save_tensors(big_t, tmp / "target" / "model.safetensors", metadata={"format": "pt"})
    counts = {"target_total": inf.count(big_t),
              "target_non_embedding": inf.count(big_t, ("model.embed_tokens.", "lm_head.")),
              "small_target_total": inf.count(tsd),
              "small_target_non_embedding": inf.count(tsd, ("model.embed_tokens.", "lm_head."))}
    del big_t
    new_t = dict(tcfg, **{k: getattr(shape, v) for k, v in SHAPE_KEYS.items()}, rms_norm_eps=plan.new_eps)
    if "max_window_layers" in new_t:
        new_t["max_window_layers"] = shape.num_hidden_layers
    if "layer_types" in new_t:
        new_t["layer_types"] = ["full_attention"] * shape.num_hidden_layers
    (tmp / "target" / "config.json").write_text(json.dumps(new_t, indent=2) + "\n")
    for f in sorted((zoo / "target").iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "zoo_manifest.json"):
            shutil.copy2(f, tmp / "target" / f.name)

    dsd = read_dir_tensors(zoo / "drafter", _drafter_files(zoo / "drafter"))
    dflash = dict(dcfg.get("dflash_config") or {})
    taps = list(DrafterConfig.from_dir(zoo / "drafter").target_layer_ids)
    inter = shape.intermediate_size
    big_d = inf.drafter(dsd, plan, len(taps), inter, seed + 1)
    (tmp / "drafter").mkdir()
    atomic_save_tensors(big_d, tmp / "drafter" / "model.safetensors", metadata={"format": "pt"})
    new_taps = [plan.layer_pos[i] for i in taps]
    dflash["target_layer_ids"] = new_taps
    new_d = dict(dcfg, **{k: getattr(shape, v) for k, v in SHAPE_KEYS.items()
                          if k not in ("num_hidden_layers", "intermediate_size")}, intermediate_size=inter,
                 rms_norm_eps=plan.new_eps,
                 dflash_config=dflash, num_target_layers=shape.num_hidden_layers)
    new_d.pop("target_layer_ids", None)
    if "layer_types" in new_d:
        new_d["layer_types"] = ["full_attention"] * int(dcfg["num_hidden_layers"])
    (tmp / "drafter" / "config.json").write_text(json.dumps(new_d, indent=2) + "\n")

    csd = read_tensors(zoo / "drafter" / WEIGHTS_NAME)
    big_c = inf.conditioner(csd, plan, int(ccfg.get("num_features", 3)), seed + 2)
    atomic_save_tensors(big_c, tmp / "drafter" / WEIGHTS_NAME, metadata={"format": "retrace-conditioner"})
    new_c = dict(ccfg, hidden_size=shape.hidden_size,
                 rms_norm_eps=inf.conditioner_eps(float(ccfg.get("rms_norm_eps", 1e-6)), plan))
    (tmp / "drafter" / CONFIG_NAME).write_text(json.dumps(new_c, indent=2) + "\n")
    counts.update(drafter_layers=inf.count(big_d), conditioner=inf.count(big_c), small_drafter_layers=inf.count(dsd),
                  small_conditioner=inf.count(csd))
    shutil.copytree(zoo / "prompts", tmp / "prompts")
    del torch
    return {"plan": dict(plan.summary(), pad_scale=pad_scale, pad_gap=inf.pad_gap(plan, rho, pad_scale),
                         final_rho_min_small=rho,
                         target_layer_ids={"small": taps, "inflated": new_taps}),
            "params": counts, "write_s": round(time.perf_counter() - t0, 2)}


def _build(zoo: Path, tmp: Path, shape, seed: int, checks: dict, key: dict, progress: bool) -> dict:
    from retrace.models.drafter import load_pair
    from retrace.train.inflate_check import greedy_identity, logit_parity, sampled_padding

    prompts = _prompts(zoo, checks["prompts"])
    if not prompts:
        raise RetraceError(f"{zoo / 'prompts'}: no prompts to check the inflated pair on")
    _log(progress, f"writing the {shape.hidden_size}-wide, {shape.num_hidden_layers}-layer pair")
    info = _write_pair(zoo, tmp, shape, seed, prompts, progress)
    timings = {"write_s": info.pop("write_s")}

    t0 = time.perf_counter()
    small = load_pair(zoo / "target", zoo / "drafter")
    big = load_pair(tmp / "target", tmp / "drafter")
    _log(progress, "checking logits")
    parity = logit_parity(small[0], big[0], prompts)
    _log(progress, "checking greedy ar / dflash / retrace")
    greedy = greedy_identity(small, big, prompts, checks["new_tokens"])
    timings["check_greedy_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    sampled = None
    if checks["sample_tokens"] > 0:
        _log(progress, f"sampling {checks['sample_tokens']} tokens at T=1")
        sampled = sampled_padding(big, prompts, small[0].config.vocab_size, checks["sample_tokens"],
                                  checks["new_tokens"])
    timings["check_sampling_s"] = round(time.perf_counter() - t0, 2)
    small_shape = _shape_of(json.loads((zoo / "target" / "config.json").read_text()))
    man = {
        "key": key, "source": str(zoo), "shape": shape.to_dict(), "small_shape": small_shape.to_dict(),
        "params": info["params"], "plan": info["plan"],
        "exactness": {"logits": parity, "greedy": greedy, "sampled": sampled},
        "timings": timings, "created_unix": int(time.time()),
        "layout": {"target": "target/", "drafter": "drafter/", "prompts": "prompts/"},
    }
    problems = []
    if not greedy["all_identical"]:
        problems.append("greedy outputs or acceptance differ from the small pair's")
    if parity["rel_diff"] > 1e-4:
        problems.append(f"real-id logits differ by {parity['rel_diff']:.2e} x max|logit| (> 1e-4)")
    calls = [v["rel_diff"] for m in greedy["modes"].values() for v in m["logits"].values()]
    if calls and max(calls) > 1e-4:
        problems.append(f"target/draft call logits differ by {max(calls):.2e} x max|logit| (> 1e-4)")
    if sampled is not None and sampled["padded_ids"]:
        problems.append(f"{sampled['padded_ids']} padded ids were sampled")
    if problems:
        raise RetraceError("inflate check failed: " + "; ".join(problems) + f" ({json.dumps(man['exactness'])})")
    (tmp / MANIFEST).write_text(json.dumps(man, indent=2) + "\n")
    return man


__all__ = ["build_inflated", "cached_manifest", "inflate_key"]
