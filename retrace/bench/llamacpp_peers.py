"""llama.cpp as a benchmark peer, through llama-cpp-python (PyPI; installing it compiles llama.cpp).

- `llamacpp-ar-<type>`: plain greedy decoding of the target as GGUF `<type>` (q4_k_m for --weights int4,
  q8_0 for int8: what CPU users run; retrace.bench.precision).
- `llamacpp-ngram-<type>`: its Python API's prompt-lookup speculative decoding
  (`llama_cpp.llama_speculative.LlamaPromptLookupDecoding`), `num_pred_tokens` in {2, 4, 8, 10} chosen
  by a short measurement like onnxruntime-genai's n-gram width (retrace.bench.ortgenai_peers).
Not here: llama.cpp's draft-model and DFlash speculative modes live in its `llama-speculative` tool, which
llama-cpp-python neither builds nor exposes (its Python API takes only a draft callable), so they are not
peers of this bench. Batch 1 only: the high-level API decodes one sequence.

The GGUF: the target's HF directory converted by llama.cpp's own `convert_hf_to_gguf.py` (with its
`gguf-py`; run through retrace.bench.llamacpp_convert, which names the tokenizer's pre-tokenizer where
llama.cpp does not know its hash) to f16, then `llama_model_quantize` (the library's quantizer, what
`llama-quantize` runs) to the type, cached per target content. The converter comes from a llama.cpp source
tree: $LLAMA_CPP_SRC, else the `vendor/llama.cpp` of llama-cpp-python's source distribution that `make
llama-src` unpacks into .cache/llama-cpp-src (`pip download --no-deps --no-binary :all:
llama-cpp-python==<installed version>`). Missing pieces skip the systems with a row that says how to
install them.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

from retrace.bench.systems import RunOut, System
from retrace.errors import RetraceError

LLAMACPP_MODES = ("ar", "ngram")
NGRAM_WIDTHS = (2, 4, 8, 10)
FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
INSTALL = ("pip install llama-cpp-python (compiles llama.cpp, 10-20 min on 2 cores; on CPUs whose AMX build crashes "
           "on quantized matmuls (llama.cpp issue 20824) add CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON "
           "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON')")


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError as e:
        raise RetraceError(f"llama-cpp-python is not installed ({e}): {INSTALL}") from None
    return llama_cpp


# where `make llama-src` unpacks the installed llama-cpp-python's source distribution
DEFAULT_SRC = Path(__file__).parents[2] / ".cache" / "llama-cpp-src" / "vendor" / "llama.cpp"


def _converter() -> Path:
    src = os.environ.get("LLAMA_CPP_SRC")
    script = (Path(src) if src else DEFAULT_SRC) / "convert_hf_to_gguf.py"
    if not script.is_file() or not (script.parent / "gguf-py").is_dir():
        raise RetraceError("no llama.cpp converter: run `make llama-src` or set LLAMA_CPP_SRC to a llama.cpp "
                           "source tree with convert_hf_to_gguf.py and gguf-py (the vendor/llama.cpp of `pip "
                           "download --no-deps --no-binary :all: llama-cpp-python`, unpacked)")
    return script


def build_gguf(model_dir: str | Path, cache: Path, gguf_type: str, log, target_dir: str | Path | None = None) -> Path:
    """model_dir as GGUF `gguf_type` in the cache (f16 conversion, then quantized), once. target_dir: the
    target of a DFlash drafter (the converter takes its tokenizer, embedding and head from there)."""
    from retrace.digest import dir_digest

    quantize, version = _quantizer()
    extra = version + (f"+target-{dir_digest(target_dir)}" if target_dir is not None else "")
    root = cache / f"gguf-{dir_digest(model_dir, extra=extra)}"
    out = root / f"model-{gguf_type.lower()}.gguf"
    if out.is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    f16 = root / "model-f16.gguf"
    if not f16.is_file():
        script = _converter()
        log(f"converting {model_dir} to GGUF (llama.cpp's convert_hf_to_gguf.py)")
        tmp = f16.with_suffix(".tmp")
        env = {**os.environ, "LLAMA_CPP_SRC": str(script.parent),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])}
        args = [str(model_dir), "--outfile", str(tmp), "--outtype", "f16"]
        if target_dir is not None:
            args += ["--target-model-dir", str(target_dir)]
        res = subprocess.run([sys.executable, "-m", "retrace.bench.llamacpp_convert", *args],  # its hooks
                             capture_output=True, text=True, env=env)
        (root / "convert.log").write_text(res.stdout + res.stderr)
        if res.returncode:
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise RetraceError(f"convert_hf_to_gguf.py failed ({last}); log: {root / 'convert.log'}")
        tmp.rename(f16)
    log(f"quantizing the GGUF to {gguf_type}")
    tmp = out.with_suffix(".tmp")
    quantize(f16, tmp, gguf_type)
    tmp.rename(out)
    return out


def _quantizer():
    """(quantize(f16, out, type), a version for the cache key): llama-cpp-python's llama_model_quantize (what
    `llama-quantize` runs), else the `llama-quantize` that `make llama-tools` builds."""
    try:
        llama_cpp = _llama_cpp()
    except RetraceError as missing:
        from retrace.bench.llamacpp_server import tool
        from retrace.digest import sha256_file

        try:
            binary = tool("llama-quantize")
        except RetraceError:
            raise missing from None

        def run_binary(f16: Path, out: Path, gguf_type: str) -> None:
            res = subprocess.run([str(binary), str(f16), str(out), gguf_type], capture_output=True, text=True)
            if res.returncode:
                last = (res.stderr.strip().splitlines() or ["no output"])[-1]
                raise RetraceError(f"llama-quantize to {gguf_type} failed: {last}")

        return run_binary, f"llama-quantize-{sha256_file(_converter())[:12]}"

    def run_library(f16: Path, out: Path, gguf_type: str) -> None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, FTYPES[gguf_type])
        params.nthread = 0
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise RetraceError(f"llama_model_quantize to {gguf_type} failed")

    return run_library, llama_cpp.__version__


def load_llama(gguf: Path, threads: int, n_ctx: int):
    """One llama.cpp model and context for every system of a GGUF (built with logits_all, whose scores buffer
    holds every position's logits: the n-gram mode's verify reads them)."""
    return _llama_cpp().Llama(str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
                              verbose=False, logits_all=True)


class LlamaCppSystem(System):
    """Greedy decoding with llama-cpp-python; `ngram` > 0: prompt-lookup drafts of that many tokens. Systems of
    one GGUF share its `llm` (they run one at a time): each sets its draft model and logits before a run."""

    def __init__(self, llm, name: str, ngram: int = 0):
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.llm, self.name, self.ngram = llm, name, ngram
        self.draft = LlamaPromptLookupDecoding(num_pred_tokens=ngram) if ngram else None

    def supports(self, batch_size: int) -> str | None:
        return "llama-cpp-python decodes one sequence at a time" if batch_size > 1 else None

    def run(self, prompts, n, batch_size, progress=None) -> RunOut:
        # what Llama(draft_model=...) sets: a draft needs every position's logits, plain decoding the last one's
        self.llm.draft_model, self.llm._logits_all = self.draft, self.draft is not None
        outputs = []
        t0 = time.perf_counter()
        for p in prompts:
            self.llm.reset()
            out = []
            for tok in self.llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                         reset=True):
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

    n_ctx, seen = n_ctx + max(NGRAM_WIDTHS), set()
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
            _llama_cpp()  # these systems run in the library (the GGUF could be built without it)
            gguf = build_gguf(cfg.target, cache, gtype, log)
            built.builds[f"llamacpp_{gtype.lower()}"] = {"gguf": str(gguf)}
            llm = load_llama(gguf, threads, n_ctx)
            if names[0].startswith("llamacpp-ar"):
                built.systems.append(LlamaCppSystem(llm, names[0]))
            if names[-1].startswith("llamacpp-ngram"):
                tune = list(tune_prompts or [])[:2]
                opts = [{"ngram": k} for k in NGRAM_WIDTHS]
                make = lambda o, m=llm, nm=names[-1]: LlamaCppSystem(m, nm, o["ngram"])  # noqa: E731
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
