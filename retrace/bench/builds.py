"""Cached builds the benchmark needs: onnxruntime-genai's model of the target, transformers' assistant
conversion of the drafter, and (when the exporter is installed) an ONNX Runtime engine bundle.

Everything is keyed by a content hash of the input directories, so a changed checkpoint rebuilds and an
unchanged one is reused across benchmark runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from retrace.errors import MissingDependencyError, RetraceError

TOKENIZER_FILES = ("tokenizer.json",)  # the builder writes tokenizer_config.json itself


def default_cache_dir() -> Path:
    base = os.environ.get("RETRACE_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "retrace" / "bench"


def dir_digest(*dirs: str | Path, extra: str = "") -> str:
    """sha256 over the names and contents of the JSON and weight files of the given directories."""
    h = hashlib.sha256(extra.encode())
    for d in dirs:
        d = Path(d)
        for f in sorted(d.iterdir()):
            if f.is_file() and f.suffix in (".json", ".safetensors"):
                h.update(f.name.encode())
                with f.open("rb") as fh:
                    for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                        h.update(block)
    return h.hexdigest()[:16]


def _run(cmd: list[str], what: str, log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        last = lines[-1] if lines else "no output"
        raise RetraceError(f"{what} failed (exit {proc.returncode}): {last} (log: {log}; command: {' '.join(cmd)})")
    return time.perf_counter() - t0


def _run_module(argv: list[str], what: str, log: Path) -> float:
    """`python -m <module> args...` in this process (torch and transformers are imported already, which
    saves most of a fresh interpreter's start-up), its output going to `log`."""
    import contextlib
    import runpy
    import traceback
    import warnings

    module, args = argv[0], argv[1:]
    t0 = time.perf_counter()
    saved = sys.argv
    with log.open("w") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh), \
            warnings.catch_warnings():
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            if e.code not in (0, None):
                fh.write(f"exit {e.code}\n")
                raise RetraceError(f"{what} failed (exit {e.code}); log: {log}") from None
        except Exception as e:  # noqa: BLE001 - the builder raises anything; report it as a build failure
            traceback.print_exc(file=fh)
            raise RetraceError(f"{what} failed: {type(e).__name__}: {e} (log: {log})") from None
        finally:
            sys.argv = saved
    return time.perf_counter() - t0


def genai_version() -> str | None:
    try:
        import onnxruntime_genai as og
    except ImportError:
        return None
    return getattr(og, "__version__", "unknown")


def build_genai_model(target_dir: str | Path, cache_dir: str | Path, threads: int) -> tuple[Path, dict]:
    """onnxruntime-genai model of the target (fp32, cpu), built once per target content and genai version,
    plus a per-thread-count copy whose genai_config.json sets intra_op_num_threads and disables EOS
    (`eos_token_id: []`) so that every system generates exactly max_new_tokens."""
    version = genai_version()
    if version is None:
        raise MissingDependencyError("onnxruntime-genai is not installed (pip install 'onnxruntime-genai>=0.18')")
    target_dir = Path(target_dir)
    missing = [f for f in TOKENIZER_FILES if not (target_dir / f).is_file()]
    if missing:
        raise RetraceError(f"{target_dir}: no {', '.join(missing)}; onnxruntime-genai needs the tokenizer files "
                           "(without them it invents an empty tokenizer and treats id 0 as EOS)")
    root = Path(cache_dir) / f"genai-{dir_digest(target_dir, extra=version)}"
    base = root / "base"
    info = {"cache": str(root), "built": False, "build_s": 0.0}
    if not (base / "genai_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=root))
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(target_dir), "-o", str(tmp / "out"),
               "-p", "fp32", "-e", "cpu", "-c", str(tmp / "hf-cache")]
        info["build_s"] = _run_module(cmd[2:], "onnxruntime-genai model build", root / "build.log")
        info["built"] = True
        info["command"] = " ".join(cmd)
        if base.exists():
            shutil.rmtree(base)
        (tmp / "out").rename(base)
        shutil.rmtree(tmp, ignore_errors=True)
    run_dir = root / f"threads{threads}"
    if not (run_dir / "genai_config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix="cfg-", dir=root))
        for f in base.iterdir():
            if f.is_file():
                try:
                    os.link(f, tmp / f.name)
                except OSError:
                    shutil.copy2(f, tmp / f.name)
        cfg_path = tmp / "genai_config.json"
        (tmp / "genai_config.json").unlink()
        cfg = json.loads((base / "genai_config.json").read_text())
        model = cfg["model"]
        model["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = int(threads)
        model["decoder"]["session_options"]["inter_op_num_threads"] = 1
        model["eos_token_id"] = []  # never stop early: the same token count as every other system
        cfg_path.write_text(json.dumps(cfg, indent=4) + "\n")
        if run_dir.exists():
            shutil.rmtree(run_dir)
        tmp.rename(run_dir)
    cfg = json.loads((run_dir / "genai_config.json").read_text())
    info["pad_token_id"] = cfg["model"].get("pad_token_id")
    info["model_dir"] = str(run_dir)
    return run_dir, info


def build_hf_assistant(drafter_dir: str | Path, target_dir: str | Path, cache_dir: str | Path) -> Path:
    """The drafter in transformers' `muse_glimmer_assistant` format (retrace.models.convert)."""
    from retrace.models.convert import zlab_to_hf_assistant

    out = Path(cache_dir) / f"hf-assistant-{dir_digest(drafter_dir, target_dir)}"
    if not (out / "config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix="hfasst-", dir=Path(cache_dir)))
        zlab_to_hf_assistant(drafter_dir, target_dir, tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out


def exporter_available() -> str | None:
    """None if an ONNX Runtime bundle can be built and run here, else the reason it cannot."""
    for mod, what in (("onnxruntime", "onnxruntime"), ("retrace.runtime.onnxruntime_backend", "the ONNX Runtime backend"),
                      ("retrace.export.cli", "the exporter (retrace-export)")):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{what} is not installed"
        except ImportError:
            return f"{what} is not installed"
    return None


def build_ort_bundle(target_dir: str | Path, drafter_dir: str | Path, cache_dir: str | Path, max_batch: int,
                     max_seq_len: int) -> tuple[Path, dict]:
    """`retrace-export build --target --drafter --out` into the cache (once per checkpoint content and sizes)."""
    why = exporter_available()
    if why:
        raise MissingDependencyError(why)
    root = Path(cache_dir) / f"bundle-{dir_digest(target_dir, drafter_dir, extra=f'{max_batch}/{max_seq_len}')}"
    out = root / "bundle"
    info = {"cache": str(root), "built": False, "build_s": 0.0}
    done = root / "built.ok"
    if not (done.is_file() and out.is_dir()):
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "retrace.export.cli", "build", "--target", str(target_dir), "--drafter",
               str(drafter_dir), "--out", str(out), "--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len),
               "--force", "--quiet"]
        info["build_s"] = _run(cmd, "retrace-export build", root / "build.log")
        info["built"] = True
        info["command"] = " ".join(cmd)
        done.write_text(info["command"] + "\n")
    info["bundle"] = str(out)
    return out, info
