"""llama.cpp as a benchmark peer, through llama-cpp-python (PyPI; installing it compiles llama.cpp).

- `llamacpp-ar-<type>`: plain decoding of the target as GGUF `<type>` (q4_k_m for --weights int4,
  q8_0 for int8: what CPU users run; retrace.bench.precision).
- `llamacpp-ngram-<type>`: its Python API's prompt-lookup speculative decoding
  (`llama_cpp.llama_speculative.LlamaPromptLookupDecoding`), `num_pred_tokens` in {2, 4, 8, 10} chosen
  by a short measurement like onnxruntime-genai's n-gram width (retrace.bench.ortgenai_peers).
llama.cpp's draft-model and DFlash modes are not in llama-cpp-python's API (it takes only a draft callable):
they are peers through `llama-server` (retrace.bench.llamacpp_server). Batch 1 only: the high-level API
decodes one sequence. The GGUF: retrace.bench.llamacpp_build (llama.cpp's own converter, then quantized),
cached per target content. Missing pieces skip the systems with a row that says how to install them.
"""

from __future__ import annotations

import time
from pathlib import Path

from retrace.bench.decoding import GREEDY, Decoding
from retrace.bench.llamacpp_build import build_gguf, llama_cpp_module
from retrace.bench.systems import RunOut, System
from retrace.errors import RetraceError

LLAMACPP_MODES = ("ar", "ngram")
NGRAM_WIDTHS = (2, 4, 8, 10)


def load_llama(gguf: Path, threads: int, n_ctx: int):
    """One llama.cpp model and context for every system of a GGUF (built with logits_all, whose scores buffer
    holds every position's logits: the n-gram mode's verify reads them)."""
    return llama_cpp_module().Llama(str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads,
                                    n_threads_batch=threads, verbose=False, logits_all=True)


class LlamaCppSystem(System):
    """Decoding with llama-cpp-python; `ngram` > 0: prompt-lookup drafts of that many tokens. Systems of one GGUF
    share its `llm` (they run one at a time): each sets its draft model and logits before a run."""

    def __init__(self, llm, name: str, ngram: int = 0, decoding: Decoding = GREEDY):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.llm, self.name, self.ngram, self.decoding = llm, name, ngram, decoding
        self.draft = LlamaPromptLookupDecoding(num_pred_tokens=ngram) if ngram else None

    def supports(self, batch_size: int) -> str | None:
        return "llama-cpp-python decodes one sequence at a time" if batch_size > 1 else None

    def run(self, prompts, n, batch_size, progress=None) -> RunOut:
        # what Llama(draft_model=...) sets: a draft needs every position's logits, plain decoding the last one's
        self.llm.draft_model, self.llm._logits_all = self.draft, self.draft is not None
        outputs = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            self.llm.reset()
            self.llm.set_seed(self.decoding.seed + i)
            out = []
            for tok in self.llm.generate(p, reset=True, **self.decoding.llama_cpp_kwargs()):
                out.append(int(tok))
                if len(out) == n:
                    break
            outputs.append(out)
            if progress is not None:
                progress(n)
        return RunOut(outputs, time.perf_counter() - t0)


def add_llamacpp_systems(built, cfg, cache: Path, threads: int, tune_prompts, log, n_ctx: int = 4096) -> None:
    """llama.cpp's systems at each quantized precision of cfg.weights; n_ctx: the longest sequence the bench
    decodes (drafts past it included)."""
    from retrace.bench.config import wanted
    from retrace.bench.ortgenai_peers import TUNE_TOKENS, measure_best
    from retrace.bench.precision import llamacpp_type

    n_ctx, seen, dec = n_ctx + max(NGRAM_WIDTHS), set(), Decoding.of(cfg)
    for weights in cfg.weights:
        gtype = llamacpp_type(weights)
        if gtype is None or gtype in seen:
            continue
        seen.add(gtype)
        names = [f"llamacpp-{m}-{gtype.lower()}" for m in LLAMACPP_MODES]
        names = [nm for nm in names if wanted(nm, cfg.systems)]
        if not names:
            continue
        try:
            llama_cpp_module()  # these systems run in the library (the GGUF could be built without it)
            gguf = build_gguf(cfg.target, cache, gtype, log)
            built.builds[f"llamacpp_{gtype.lower()}"] = {"gguf": str(gguf)}
            llm = load_llama(gguf, threads, n_ctx)
            if names[0].startswith("llamacpp-ar"):
                built.systems.append(LlamaCppSystem(llm, names[0], decoding=dec))
            if names[-1].startswith("llamacpp-ngram"):
                tune = list(tune_prompts or [])[:2]
                opts = [{"ngram": k} for k in NGRAM_WIDTHS]
                make = lambda o, m=llm, nm=names[-1]: LlamaCppSystem(m, nm, o["ngram"], dec)  # noqa: E731
                if tune:
                    best, opt, table = measure_best(make, opts, tune, min(TUNE_TOKENS, cfg.max_new_tokens))
                    best.settings = {"num_pred_tokens": opt["ngram"], "candidates": table,
                                     "chosen_by": f"fastest of {len(opts)} widths"}
                else:
                    best = make({"ngram": 10})
                    best.settings = {"num_pred_tokens": 10, "chosen_by": "llama-cpp-python's default"}
                built.systems.append(best)
        except (RetraceError, OSError, RuntimeError, ValueError) as e:
            built.skip(names, str(e).splitlines()[0])
