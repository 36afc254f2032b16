"""Cached builds the benchmark needs: onnxruntime-genai's model of the target, transformers' assistant
conversion of the drafter, and (when the exporter is installed) an ONNX Runtime engine bundle.

Everything is keyed by a content hash of the input directories, so a changed checkpoint rebuilds and an
unchanged one is reused across benchmark runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from retrace.digest import dir_digest
from retrace.errors import MissingDependencyError, RetraceError

TOKENIZER_FILES = ("tokenizer.json",)  # the builder writes tokenizer_config.json itself


def default_cache_dir() -> Path:
    base = os.environ.get("RETRACE_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "retrace" / "bench"


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


def _require_genai() -> str:
    version = genai_version()
    if version is None:
        raise MissingDependencyError("onnxruntime-genai is not installed (pip install 'onnxruntime-genai>=0.18')")
    return version


def _check_tokenizer(hf_dir: Path) -> None:
    missing = [f for f in TOKENIZER_FILES if not (hf_dir / f).is_file()]
    if missing:
        raise RetraceError(f"{hf_dir}: no {', '.join(missing)}; onnxruntime-genai needs the tokenizer files "
                           "(without them it invents an empty tokenizer and treats id 0 as EOS)")


def genai_export(hf_dir: str | Path, root: Path, what: str = "onnxruntime-genai model build",
                 post=None, precision: str = "fp32") -> tuple[Path, dict]:
    """`python -m onnxruntime_genai.models.builder -i hf_dir -o root/base -p fp32 -e cpu`, once (root/base);
    post(out_dir), if given, edits the output before it is moved into place. precision "int4" / "int8"
    (or "int4:B" for quantization block B) builds its MatMulNBits model (`-p int4 -e cpu --extra_options
    block_size=B`; accuracy_level is the builder's CPU default, 4)."""
    hf_dir = Path(hf_dir)
    base = root / "base"
    info = {"cache": str(root), "built": False, "build_s": 0.0}
    if not (base / "genai_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=root))
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp / "out"),
               "-p", precision.split(":")[0], "-e", "cpu", "-c", str(tmp / "hf-cache")]
        if ":" in precision:
            cmd += ["--extra_options", f"block_size={precision.split(':')[1]}"]
        info["build_s"] = _run_module(cmd[2:], what, root / "build.log")
        info["built"] = True
        info["command"] = " ".join(cmd)
        if post is not None:
            post(tmp / "out")
        if base.exists():
            shutil.rmtree(base)
        (tmp / "out").rename(base)
        shutil.rmtree(tmp, ignore_errors=True)
    return base, info


def _link_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        if f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)


def _run_config(cfg: dict, threads: int) -> dict:
    """Threads and no EOS in a genai_config.json (every system generates exactly max_new_tokens)."""
    model = cfg["model"]
    for block in ("decoder", "draft"):
        if block in model:
            so = model[block].setdefault("session_options", {})
            so["intra_op_num_threads"] = int(threads)
            so["inter_op_num_threads"] = 1
    model["eos_token_id"] = []  # never stop early: the same token count as every other system
    return cfg


def genai_run_copy(model_dir: Path, into: Path, threads: int) -> Path:
    """`into` (an empty folder): model_dir's files hard-linked (copied across file systems), its
    genai_config.json rewritten to run at `threads` intra-op threads with EOS disabled (_run_config)."""
    _link_files(model_dir, into)
    (into / "genai_config.json").unlink()
    cfg = _run_config(json.loads((model_dir / "genai_config.json").read_text()), threads)
    (into / "genai_config.json").write_text(json.dumps(cfg, indent=4) + "\n")
    return into


def build_genai_model(target_dir: str | Path, cache_dir: str | Path, threads: int,
                      precision: str = "fp32") -> tuple[Path, dict]:
    """onnxruntime-genai model of the target (fp32, cpu), built once per target content and genai version,
    plus a per-thread-count copy whose genai_config.json sets intra_op_num_threads and disables EOS
    (`eos_token_id: []`) so that every system generates exactly max_new_tokens."""
    version = _require_genai()
    target_dir = Path(target_dir)
    _check_tokenizer(target_dir)
    extra = version if precision == "fp32" else f"{version}/{precision}"  # fp32: the cache key it always had
    root = Path(cache_dir) / f"genai-{dir_digest(target_dir, extra=extra)}"
    base, info = genai_export(target_dir, root, precision=precision)
    run_dir = root / f"threads{threads}"
    if not (run_dir / "genai_config.json").is_file():
        tmp = genai_run_copy(base, Path(tempfile.mkdtemp(prefix="cfg-", dir=root)), threads)
        if run_dir.exists():
            shutil.rmtree(run_dir)
        tmp.rename(run_dir)
    cfg = json.loads((run_dir / "genai_config.json").read_text())
    info["pad_token_id"] = cfg["model"].get("pad_token_id")
    info["model_dir"] = str(run_dir)
    return run_dir, info


def never_produce_padded(onnx_path: Path, real_vocab: int) -> None:
    """Add -1e9 to the logits of ids >= real_vocab in an exported decoder (output `logits`), in place: the zero
    LM-head rows of a vocabulary padded by retrace.train.draft_ar.pad_vocab then can never win an argmax
    nor carry probability mass."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from retrace.export.quantize import relocate_external

    model = onnx.load(str(onnx_path))
    g = model.graph
    out = next((o for o in g.output if o.name == "logits"), None)
    if out is None:
        raise RetraceError(f"{onnx_path}: no 'logits' output to mask the padded vocabulary on")
    vocab = out.type.tensor_type.shape.dim[-1].dim_value
    if not vocab or vocab <= real_vocab:
        return
    for node in g.node:
        node.output[:] = ["logits_unmasked" if o == "logits" else o for o in node.output]
    bias = np.zeros(vocab, dtype=np.float32)
    bias[real_vocab:] = -1e9
    g.initializer.append(numpy_helper.from_array(bias, "retrace_padded_vocab_bias"))
    g.node.append(helper.make_node("Add", ["logits_unmasked", "retrace_padded_vocab_bias"], ["logits"],
                                   name="retrace_padded_vocab_mask"))
    data = onnx_path.name + ".data"
    tmp = onnx_path.with_name(onnx_path.name + ".tmp")
    onnx.save(model, str(tmp), save_as_external_data=True, location=data + ".tmp")
    (onnx_path.parent / (data + ".tmp")).rename(onnx_path.parent / data)
    relocate_external(tmp, data)  # the graph names its external file: the final name
    tmp.replace(onnx_path)


def build_genai_draft_model(target_dir: str | Path, draft_dir: str | Path, cache_dir: str | Path,
                            threads: int, precision: str = "fp32") -> tuple[Path, dict]:
    """The target's onnxruntime-genai model with an autoregressive draft model wired in as `model.draft`
    (its decoder section, filename `draft/model.onnx`, the target's session options). A draft trained at a
    smaller vocabulary than the target's is padded (retrace.train.draft_ar.pad_vocab + never_produce_padded)."""
    from retrace.train.draft_ar import pad_vocab

    version = _require_genai()
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    run_target, info = build_genai_model(target_dir, cache_dir, threads, precision)
    tv = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    dv = json.loads((draft_dir / "config.json").read_text())["vocab_size"]
    if dv > tv:
        raise RetraceError(f"draft {draft_dir} has a larger vocabulary ({dv}) than the target ({tv})")
    extra = f"{version}/{tv}" + ("" if precision == "fp32" else "/" + precision)
    root = Path(cache_dir) / f"genai-draft-{dir_digest(draft_dir, extra=extra)}"
    src = draft_dir
    if dv < tv and not (root / "base" / "genai_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        src = pad_vocab(draft_dir, root / "padded-hf", tv)
        _check_tokenizer(src)
    elif dv < tv:
        src = root / "padded-hf"
    _check_tokenizer(src)
    base, dinfo = genai_export(src, root, "onnxruntime-genai draft model build",
                               post=(lambda out: never_produce_padded(out / "model.onnx", dv)) if dv < tv else None,
                               precision=precision)
    info = {**info, "draft": {**dinfo, "hf_dir": str(draft_dir), "vocab_padded_from": dv if dv < tv else None}}
    run_dir = root / f"with-target-{Path(run_target).parent.name}-threads{threads}"
    if not (run_dir / "genai_config.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix="cfg-", dir=root))
        _link_files(Path(run_target), tmp)
        (tmp / "draft").mkdir()
        _link_files(base, tmp / "draft")
        cfg = json.loads((Path(run_target) / "genai_config.json").read_text())
        dec = json.loads((base / "genai_config.json").read_text())["model"]["decoder"]
        dec["filename"] = "draft/" + dec["filename"]
        dec["session_options"] = dict(cfg["model"]["decoder"].get("session_options", {}))
        cfg["model"]["draft"] = dec
        (tmp / "genai_config.json").unlink()
        (tmp / "genai_config.json").write_text(json.dumps(_run_config(cfg, threads), indent=4) + "\n")
        if run_dir.exists():
            shutil.rmtree(run_dir)
        tmp.rename(run_dir)
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
    for mod, what in (("onnxruntime", "onnxruntime"),
                      ("retrace.runtime.onnxruntime_backend", "the ONNX Runtime backend"),
                      ("retrace.export.cli", "the exporter (retrace-export)")):
        try:
            if importlib.util.find_spec(mod) is None:
                return f"{what} is not installed"
        except ImportError:
            return f"{what} is not installed"
    return None


def build_ort_bundle(target_dir: str | Path, drafter_dir: str | Path, cache_dir: str | Path, max_batch: int,
                     max_seq_len: int, weights: str = "fp32", drafter_weights: str | None = None) -> tuple[Path, dict]:
    """`retrace-export build --target --drafter --out` into the cache (once per checkpoint content and sizes;
    the pair's ONNX exports once for all of them: cache_dir/exports, retrace/export/export_cache.py);
    weights "int4" / "int8" (or "int4:B": quantization block B): `--weights` (`--weight-block-size B`);
    drafter_weights: `--drafter-weights` (None: the drafter at the target's precision)."""
    why = exporter_available()
    if why:
        raise MissingDependencyError(why)
    extra = (f"{max_batch}/{max_seq_len}" + ("" if weights == "fp32" else f"/{weights}")
             + ("" if drafter_weights is None else f"/drafter-{drafter_weights}"))
    root = Path(cache_dir) / f"bundle-{dir_digest(target_dir, drafter_dir, extra=extra)}"
    out = root / "bundle"
    info = {"cache": str(root), "built": False, "build_s": 0.0}
    done = root / "built.ok"
    if not (done.is_file() and out.is_dir()):
        root.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "retrace.export.cli", "build", "--target", str(target_dir), "--drafter",
               str(drafter_dir), "--out", str(out), "--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len),
               "--force", "--quiet", "--export-cache", str(Path(cache_dir) / "exports")]  # one export per pair
        if weights != "fp32":
            w, _, block = weights.partition(":")
            cmd += ["--weights", w, *(["--weight-block-size", block] if block else [])]
        if drafter_weights is not None:
            cmd += ["--drafter-weights", drafter_weights]
        info["build_s"] = _run(cmd, "retrace-export build", root / "build.log")
        info["built"] = True
        info["command"] = " ".join(cmd)
        done.write_text(info["command"] + "\n")
    info["bundle"] = str(out)
    return out, info
