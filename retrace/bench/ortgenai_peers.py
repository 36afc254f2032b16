"""onnxruntime-genai as a benchmark peer: plain AR and its own CPU speculative decoding.

- `ortgenai-ar`: autoregressive.
- `ortgenai-ngram`: n-gram (prompt) lookup with a fixed draft width; `ngram_size` in 2-4 and
  `max_draft_tokens` in {2, 4, 8} chosen by a short measurement (the fastest on the first tuning prompts).
- `ortgenai-ngram-adaptive`: the chosen `ngram_size`, `max_draft_tokens` 8 and `min_adaptive_k` 1 (the
  library adapts the width between 1 and 8 from the acceptance it sees).
- `ortgenai-draft`: a small autoregressive Qwen3 draft model (retrace.train.draft_ar) wired as `model.draft`
  in genai_config.json; `max_draft_tokens` in {2, 4, 8} chosen by measurement.
- `ortgenai-draft-adaptive`: the draft with `max_draft_tokens` 8 and `min_adaptive_k` 1.

The draft model: --draft-ar DIR, else DIR/draft-ar beside a zoo's target (`retrace zoo draft-ar`), else one
distilled into the bench cache from the zoo's DIR/data/train_prompts.jsonl; without any, the draft systems
are skipped with that reason. Speculative decoding in onnxruntime-genai 0.18 runs batch 1 only.
"""

from __future__ import annotations

from pathlib import Path

from retrace.errors import RetraceError

NGRAM_SIZES = (2, 3, 4)
DRAFT_WIDTHS = (2, 4, 8)
ADAPTIVE = {"max_draft_tokens": 8, "min_adaptive_k": 1}
TUNE_TOKENS = 24


def measure_best(make, options, prompts: list[list[int]], n: int, passes: int = 2):
    """Build a system per option with make(option), run each once to warm up, then `passes` times in
    alternation; returns (fastest system, its option, [{**option, tokens_per_s}] for every option). The other
    systems are closed (a llama-server each, retrace.bench.llamacpp_server), and all of them on an error."""
    systems = [make(o) for o in options]
    try:
        for s in systems:
            s.run(prompts, n, 1)
        best = [float("inf")] * len(systems)
        for _ in range(passes):
            for i, s in enumerate(systems):
                best[i] = min(best[i], s.run(prompts, n, 1).wall_s)
    except BaseException:
        for s in systems:
            s.close()
        raise
    i = min(range(len(systems)), key=lambda j: best[j])
    for j, s in enumerate(systems):
        if j != i:
            s.close()
    tokens = n * len(prompts)
    table = [{**o, "tokens_per_s": tokens / t} for o, t in zip(options, best, strict=True)]
    return systems[i], options[i], table


def find_draft_ar(cfg, cache: Path, log) -> Path:
    """The AR draft model's HF dir (see the module docstring); RetraceError when there is none."""
    if cfg.draft_ar:
        d = Path(cfg.draft_ar)
        if not (d / "config.json").is_file():
            raise RetraceError(f"--draft-ar {d}: not an HF Qwen3 directory (no config.json)")
        return d
    zoo = Path(cfg.target).resolve().parent
    if (zoo / "draft-ar" / "config.json").is_file():
        return zoo / "draft-ar"
    data = zoo / "data" / "train_prompts.jsonl"
    if not data.is_file():
        raise RetraceError("no AR draft model: give --draft-ar DIR or build one with `retrace zoo draft-ar --from ZOO`")
    from retrace.digest import dir_digest
    from retrace.train.draft_ar import DraftArConfig, train_draft_ar

    out = cache / f"draft-ar-{dir_digest(cfg.target)}"
    log(f"distilling an AR draft model for ortgenai-draft into {out} (cached)")
    train_draft_ar(cfg.target, out, data, DraftArConfig(), progress=False)
    return out


def add_ortgenai_systems(built, cfg, cache: Path, threads: int, tune_prompts, log, precision: str = "fp32") -> None:
    """The ortgenai-* systems on its builder's model at `precision` (retrace.bench.precision: int4 / int8
    names end in -int4 etc.; the draft model is built at the same precision)."""
    from retrace.bench.builds import build_genai_draft_model, build_genai_model
    from retrace.bench.config import wanted
    from retrace.bench.decoding import Decoding
    from retrace.bench.precision import suffix
    from retrace.bench.systems import OrtGenaiSystem

    sfx = suffix(precision)
    dec = Decoding.of(cfg)  # the settings are chosen at the run's decoding
    names = [n for n in ("ortgenai-ar", "ortgenai-ngram", "ortgenai-ngram-adaptive") if wanted(n + sfx, cfg.systems)]
    tune = [p for p in (tune_prompts or [])[:2]]
    n = min(TUNE_TOKENS, cfg.max_new_tokens)
    if names:
        try:
            log(f"building the onnxruntime-genai model ({precision}, cached)")
            mdir, info = build_genai_model(cfg.target, cache, threads, precision)
            built.builds["ortgenai" + sfx.replace("-", "_")] = info
            ar = OrtGenaiSystem(mdir, info.get("pad_token_id"), "ortgenai-ar" + sfx, decoding=dec)
            if "ortgenai-ar" in names:
                built.systems.append(ar)
            ngram = [n_ for n_ in names if n_ != "ortgenai-ar"]
            if ngram:
                if not tune:
                    raise RetraceError("no tuning prompts to choose the n-gram settings with")
                log("choosing onnxruntime-genai's n-gram settings (short measurement)")
                opts = [{"ngram_size": g, "max_draft_tokens": k, "min_adaptive_k": 0}
                        for g in NGRAM_SIZES for k in DRAFT_WIDTHS]
                best, opt, table = measure_best(
                    lambda o: OrtGenaiSystem(mdir, ar.pad_id, "ortgenai-ngram" + sfx, o, model=ar.model, decoding=dec),
                    opts, tune, n)
                how = {"chosen_by": f"fastest of {len(opts)} settings on {len(tune)} prompts x {n} tokens",
                       "candidates": table}
                if "ortgenai-ngram" in ngram:
                    best.settings = {"speculative": opt, **how}
                    built.systems.append(best)
                if "ortgenai-ngram-adaptive" in ngram:
                    o = {"ngram_size": opt["ngram_size"], **ADAPTIVE}
                    s = OrtGenaiSystem(mdir, ar.pad_id, "ortgenai-ngram-adaptive" + sfx, o, model=ar.model,
                                       decoding=dec)
                    s.settings = {"speculative": o, "chosen_by": "ngram_size of ortgenai-ngram; adaptive width"}
                    built.systems.append(s)
        except (RetraceError, ImportError, RuntimeError) as e:
            built.skip([n_ + sfx for n_ in names], str(e).splitlines()[0])

    dnames = [n_ for n_ in ("ortgenai-draft", "ortgenai-draft-adaptive") if wanted(n_ + sfx, cfg.systems)]
    if dnames:
        try:
            if not tune:
                raise RetraceError("no tuning prompts to choose the draft width with")
            draft = find_draft_ar(cfg, cache, log)
            log(f"building the onnxruntime-genai model with the AR draft ({precision}, cached)")
            mdir, info = build_genai_draft_model(cfg.target, draft, cache, threads, precision)
            built.builds["ortgenai_draft" + sfx.replace("-", "_")] = info
            import onnxruntime_genai as og

            model = og.Model(str(mdir))
            pad = info.get("pad_token_id")
            if "ortgenai-draft" in dnames:
                opts = [{"max_draft_tokens": k, "min_adaptive_k": 0} for k in DRAFT_WIDTHS]
                best, opt, table = measure_best(
                    lambda o: OrtGenaiSystem(mdir, pad, "ortgenai-draft" + sfx, o, model=model, decoding=dec),
                    opts, tune, n)
                best.settings = {"speculative": opt, "draft_model": str(draft),
                                 "chosen_by": f"fastest of {len(opts)} widths on {len(tune)} prompts x {n} tokens",
                                 "candidates": table}
                built.systems.append(best)
            if "ortgenai-draft-adaptive" in dnames:
                s = OrtGenaiSystem(mdir, pad, "ortgenai-draft-adaptive" + sfx, dict(ADAPTIVE), model=model,
                                   decoding=dec)
                s.settings = {"speculative": dict(ADAPTIVE), "draft_model": str(draft), "chosen_by": "adaptive width"}
                built.systems.append(s)
        except (RetraceError, ImportError, RuntimeError, OSError) as e:
            built.skip([n_ + sfx for n_ in dnames], str(e).splitlines()[0])
