"""llama.cpp's files for the bench's llama.cpp peers (retrace.bench.llamacpp_peers, retrace.bench.llamacpp_server):
its converter (`convert_hf_to_gguf.py` from a llama.cpp source tree), its built tools (`llama-server`,
`llama-quantize`), llama-cpp-python where installed, and the GGUFs made from HF directories with them, cached.

- The converter: $LLAMA_CPP_SRC, else the `vendor/llama.cpp` of llama-cpp-python's source distribution that `make
  llama-src` unpacks into .cache/llama-cpp-src (`pip download --no-deps --no-binary :all: llama-cpp-python`).
- The tools: $LLAMA_CPP_BIN, else what `make llama-tools` builds from that source into .cache/llama-cpp-build/bin.
- A GGUF: the HF directory converted to f16 by the converter (run through retrace.bench.llamacpp_convert, which
  names the tokenizer's pre-tokenizer where llama.cpp does not know its hash; a DFlash drafter with its target's
  directory), then quantized to the type by llama-cpp-python's `llama_model_quantize` or, without it, the
  `llama-quantize` tool (the same quantizer), cached per content.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

from retrace.errors import RetraceError

ROOT = Path(__file__).parents[2]
FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}
INSTALL = ("pip install llama-cpp-python (compiles llama.cpp, 10-20 min on 2 cores; on CPUs whose AMX build crashes "
           "on quantized matmuls (llama.cpp issue 20824) add CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON "
           "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON')")
BUILD_DIR = ROOT / ".cache" / "llama-cpp-build"
INSTALL_TOOLS = "`make llama-tools` (builds llama-server and llama-quantize from llama.cpp's source, ~6 min on 2 cores)"


def llama_cpp_module():
    try:
        import llama_cpp
    except ImportError as e:
        raise RetraceError(f"llama-cpp-python is not installed ({e}): {INSTALL}") from None
    return llama_cpp


def tool(name: str) -> Path:
    """A llama.cpp binary: $LLAMA_CPP_BIN/name, else the one `make llama-tools` built."""
    root = Path(os.environ["LLAMA_CPP_BIN"]) if os.environ.get("LLAMA_CPP_BIN") else BUILD_DIR / "bin"
    path = root / name
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise RetraceError(f"no llama.cpp {name} in {root}: {INSTALL_TOOLS}, or set LLAMA_CPP_BIN to a build's bin/")
    return path


# where `make llama-src` unpacks the installed llama-cpp-python's source distribution
DEFAULT_SRC = ROOT / ".cache" / "llama-cpp-src" / "vendor" / "llama.cpp"


def converter() -> Path:
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
        script = converter()
        log(f"converting {model_dir} to GGUF (llama.cpp's convert_hf_to_gguf.py)")
        tmp = f16.with_suffix(".tmp")
        env = {**os.environ, "LLAMA_CPP_SRC": str(script.parent),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
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
        llama_cpp = llama_cpp_module()
    except RetraceError as missing:
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

        return run_binary, f"llama-quantize-{sha256_file(converter())[:12]}"

    def run_library(f16: Path, out: Path, gguf_type: str) -> None:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, FTYPES[gguf_type])
        params.nthread = 0
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(out).encode(), ctypes.byref(params)) != 0:
            raise RetraceError(f"llama_model_quantize to {gguf_type} failed")

    return run_library, llama_cpp.__version__
