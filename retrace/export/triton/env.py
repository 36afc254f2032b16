"""Build (once) and cache what a CPU-only Triton Inference Server needs, from PyPI alone.

Two pieces live under one cache directory:

``server-pytriton-<ver>-py<XY>/``
    ``nvidia-pytriton`` installed with ``pip install --no-deps --target``: we only need its bundled
    ``tritonserver`` binary, its shared libraries and the python backend, not its Python package (which
    pins ``numpy<2`` and would downgrade the caller's environment). The python backend stub built for
    this interpreter's version is copied into ``tritonserver/backends/python/``.
``model-env-<hash>/``
    A virtual environment for the python-backend model (``EXECUTION_ENV_PATH``), built in place at its
    final path (a venv is not relocatable). The python backend stub garbles tensors with numpy 2, so this
    env pins ``numpy<2``; it also holds torch, onnxruntime and the tokenizer stack the runtime needs.
    The ``retrace`` package itself is NOT installed here: generated repositories carry their own copy
    (see :mod:`retrace.export.triton.repository`).

A marker file is written last in each piece; a second call that finds both markers returns at once. An
exclusive ``flock`` on ``<cache>/.lock`` keeps parallel callers (pytest-xdist, two shells) from racing.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from retrace.errors import RetraceError

PYTRITON_VERSION = "0.7.0"
MARKER = ".retrace-complete"

# The model environment. Same pins as the project (pyproject.toml) except numpy, which must stay < 2 for
# the python backend stub of tritonserver 2.51. torch==2.13.0 resolves to the CPU wheel where one lies in
# pip's find-links; elsewhere pass extra pip args (e.g. the PyTorch CPU index) through RETRACE_TRITON_PIP_ARGS.
MODEL_ENV_REQUIREMENTS: tuple[str, ...] = (
    "numpy>=1.26,<2",
    "torch==2.13.0",
    "onnxruntime>=1.23",
    "onnx>=1.19",  # the ONNX Runtime backend reads / rewrites the bundle's graphs (shared LM head)
    "safetensors>=0.6",
    "tokenizers>=0.22",
    "transformers>=5.20,<5.24",
    "click>=8.1",
    "rich>=13",
    "tqdm>=4.66",
)


class TritonEnvError(RetraceError, RuntimeError):
    """The Triton server or its model environment could not be set up; the message says why."""


@dataclasses.dataclass(frozen=True)
class TritonEnv:
    """Paths of a ready Triton installation and model environment."""

    cache_dir: Path
    server_root: Path  # .../pytriton/tritonserver
    model_env: Path  # venv used as EXECUTION_ENV_PATH
    python_libdir: Path  # directory holding libpythonX.Y.so.1.0 (the stub links it)
    python_version: str  # "3.11"

    @property
    def tritonserver(self) -> Path:
        return self.server_root / "bin" / "tritonserver"

    @property
    def backend_dir(self) -> Path:
        return self.server_root / "backends"

    def server_environ(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for the tritonserver process: libpython's dir first on LD_LIBRARY_PATH."""
        env = dict(os.environ if base is None else base)
        old = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = str(self.python_libdir) + (os.pathsep + old if old else "")
        return env

    def as_dict(self) -> dict[str, str]:
        return {
            "cache_dir": str(self.cache_dir),
            "tritonserver": str(self.tritonserver),
            "backend_dir": str(self.backend_dir),
            "model_env": str(self.model_env),
            "python_libdir": str(self.python_libdir),
            "python_version": self.python_version,
        }


def default_cache_dir() -> Path:
    """``$RETRACE_TRITON_CACHE`` or ``$XDG_CACHE_HOME/retrace/triton`` (``~/.cache/retrace/triton``)."""
    if os.environ.get("RETRACE_TRITON_CACHE"):
        return Path(os.environ["RETRACE_TRITON_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "retrace" / "triton"


def _base_python(python: str | os.PathLike[str] | None) -> Path:
    if python is not None:
        return Path(python)
    if os.environ.get("RETRACE_TRITON_PYTHON"):
        return Path(os.environ["RETRACE_TRITON_PYTHON"])
    # From inside a venv, build the model env from the interpreter the venv was made from.
    return Path(getattr(sys, "_base_executable", None) or sys.executable)


def _python_facts(python: Path) -> dict[str, str]:
    code = (
        "import json, sys, sysconfig;"
        "print(json.dumps({'version': '%d.%d' % sys.version_info[:2], 'full': sys.version.split()[0],"
        "'libdir': sysconfig.get_config_var('LIBDIR') or '', 'soname': sysconfig.get_config_var('INSTSONAME') or '',"
        "'shared': str(sysconfig.get_config_var('Py_ENABLE_SHARED')), 'base': getattr(sys, '_base_executable', "
        "sys.executable)}))"
    )
    try:
        out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise TritonEnvError(f"cannot run Python interpreter {python}: {e}") from e
    return json.loads(out.stdout)


def _run(cmd: Sequence[str], what: str, timeout: float, log: Callable[[str], None]) -> None:
    log(f"[triton-env] {what}: {' '.join(cmd)}")
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise TritonEnvError(f"{what} timed out after {timeout:.0f} s: {' '.join(cmd)}") from e
    if res.returncode != 0:
        tail = (res.stdout + res.stderr)[-4000:]
        raise TritonEnvError(f"{what} failed (exit {res.returncode}): {' '.join(cmd)}\n{tail}")


def _extra_pip_args() -> list[str]:
    raw = os.environ.get("RETRACE_TRITON_PIP_ARGS", "").strip()
    return raw.split() if raw else []


def _env_key(facts: dict[str, str], requirements: Sequence[str], python: Path) -> str:
    blob = json.dumps({"py": facts["full"], "base": facts["base"], "reqs": list(requirements), "python": str(python)})
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _install_server(dest: Path, pyver: str, pip_python: Path, log: Callable[[str], None]) -> None:
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [str(pip_python), "-m", "pip", "install", "--no-deps", "--no-compile", "--target", str(tmp),
           f"nvidia-pytriton=={PYTRITON_VERSION}", *_extra_pip_args()]
    _run(cmd, "install nvidia-pytriton (tritonserver + python backend)", 1800, log)
    root = tmp / "pytriton" / "tritonserver"
    stub = root / "python_backend_stubs" / pyver / "triton_python_backend_stub"
    if not (root / "bin" / "tritonserver").is_file():
        raise TritonEnvError(f"nvidia-pytriton {PYTRITON_VERSION} has no tritonserver binary at {root}/bin")
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise TritonEnvError(f"nvidia-pytriton has no python backend stub for Python {pyver} (has {have})")
    shutil.copy2(stub, root / "backends" / "python" / "triton_python_backend_stub")
    (tmp / MARKER).write_text(json.dumps({"pytriton": PYTRITON_VERSION, "python": pyver}))
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)  # --target output is relocatable (RPATHs are relative), so build-then-rename is fine


def _build_model_env(dest: Path, python: Path, requirements: Sequence[str], log: Callable[[str], None]) -> None:
    # Built at its final path: a venv's scripts and pyvenv.cfg hold absolute paths.
    shutil.rmtree(dest, ignore_errors=True)
    _run([str(python), "-m", "venv", str(dest)], "create model venv", 600, log)
    pip = [str(dest / "bin" / "python"), "-m", "pip", "install", "--no-input", "--progress-bar", "off"]
    _run([*pip, *requirements, *_extra_pip_args()], "install model env packages", 3600, log)
    modules = [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().replace("-", "_") for r in requirements]
    checked = [m for m in ("torch", "onnxruntime", "transformers", "tokenizers", "safetensors") if m in modules]
    probe = (f"import {', '.join(['numpy', *checked])};"
             "assert int(numpy.__version__.split('.')[0]) < 2, 'numpy ' + numpy.__version__ + ' (need < 2)';"
             "print('numpy', numpy.__version__)")
    _run([str(dest / "bin" / "python"), "-c", probe], "check model env imports", 600, log)
    frozen = subprocess.run([str(dest / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True)
    (dest / "requirements.lock.txt").write_text(frozen.stdout)
    (dest / MARKER).write_text(json.dumps({"requirements": list(requirements)}))


def ensure_triton_env(
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    python: str | os.PathLike[str] | None = None,
    requirements: Sequence[str] = MODEL_ENV_REQUIREMENTS,
    log: Callable[[str], None] | None = None,
) -> TritonEnv:
    """Return a ready :class:`TritonEnv`, creating the server install and model env on first use.

    ``python`` is the interpreter the model env is built from (default: ``$RETRACE_TRITON_PYTHON`` or the
    base interpreter of the running one); it must be a shared-libpython build whose version has a python-backend stub
    (3.8-3.13).
    """
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache = cache.absolute()
    py = _base_python(python)
    pointer = cache / f"ready-{hashlib.sha256((str(py) + '|' + '|'.join(requirements)).encode()).hexdigest()[:12]}.json"
    # Fast path: a previous call recorded a complete environment for this interpreter and pin set.
    if pointer.is_file():
        try:
            d = json.loads(pointer.read_text())
            env = TritonEnv(Path(d["cache_dir"]), Path(d["server_root"]), Path(d["model_env"]),
                            Path(d["python_libdir"]), d["python_version"])
            if (env.server_root.parent.parent / MARKER).is_file() and (env.model_env / MARKER).is_file():
                return env
        except (OSError, ValueError, KeyError):
            pass

    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        facts = _python_facts(py)
        if facts["shared"] != "1" or not facts["libdir"]:
            raise TritonEnvError(
                f"{py} (Python {facts['full']}) is not built with a shared libpython; the Triton python "
                f"backend stub needs libpython{facts['version']}.so. Use a shared build (pyenv: "
                "PYTHON_CONFIGURE_OPTS=--enable-shared, Debian: python3.X, or pass python=...)."
            )
        libdir = Path(facts["libdir"])
        if not (libdir / facts["soname"]).exists():
            raise TritonEnvError(f"{libdir / facts['soname']} not found (libpython of {py})")
        pyver = facts["version"]
        t0 = time.monotonic()
        server_dir = cache / f"server-pytriton-{PYTRITON_VERSION}-py{pyver}"
        if not (server_dir / MARKER).is_file():
            _install_server(server_dir, pyver, py if _has_pip(py) else Path(sys.executable), log)
            log(f"[triton-env] tritonserver ready in {time.monotonic() - t0:.1f} s: {server_dir}")
        t1 = time.monotonic()
        model_env = cache / f"model-env-py{pyver}-{_env_key(facts, requirements, py)}"
        if not (model_env / MARKER).is_file():
            _build_model_env(model_env, py, requirements, log)
            log(f"[triton-env] model env ready in {time.monotonic() - t1:.1f} s: {model_env}")
        env = TritonEnv(cache, server_dir / "pytriton" / "tritonserver", model_env, libdir, pyver)
        d = env.as_dict() | {"server_root": str(env.server_root)}
        tmp = pointer.with_suffix(".tmp")
        tmp.write_text(json.dumps(d, indent=1))
        tmp.replace(pointer)
        return env


def _has_pip(python: Path) -> bool:
    return subprocess.run([str(python), "-m", "pip", "--version"], capture_output=True).returncode == 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m retrace.export.triton.env",
        description="Create (once) the cached tritonserver install and the numpy<2 model environment.",
    )
    ap.add_argument("--cache-dir", default=None, help=f"default: $RETRACE_TRITON_CACHE or {default_cache_dir()}")
    ap.add_argument("--python", default=None, help="interpreter to build the model env from")
    ap.add_argument("--shell", action="store_true", help="print shell variable assignments instead of JSON")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        env = ensure_triton_env(args.cache_dir, python=args.python)
    except TritonEnvError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.shell:
        for k, v in env.as_dict().items():
            print(f"TRITON_{k.upper()}={shlex.quote(str(v))}")
        print(f"TRITON_LD_LIBRARY_PATH={shlex.quote(str(env.python_libdir))}")
    else:
        print(json.dumps(env.as_dict() | {"seconds": round(time.monotonic() - t0, 2)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
