"""Write a Triton Inference Server model repository that serves a ReTrace engine bundle.

Layout (``<repo>/<name>/``)::

    config.pbtxt        python backend, decoupled, inputs/outputs, parameters (bundle, env, limits)
    1/model.py          the python-backend model (a copy of retrace/export/triton/model.py)
    1/retrace/          a copy of the retrace package (the model imports it from here)
    bundle/             the engine bundle (unless copy_bundle=False: then an absolute path is recorded)
    retrace.json        what generated this repository and with which options

The repository is written into a temporary directory beside ``out_repo`` and renamed into place, so a
reader never sees half a repository (retrace.output_dir, kind "triton-repository"); an existing
``out_repo`` is replaced only with ``force=True`` and only if it is a repository this writer made (its owner
marker, or, marker-less, nothing but model directories with config.pbtxt and retrace.json).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import retrace
from retrace.errors import RetraceError
from retrace.export.triton.validation import INPUTS, LISTS, OUTPUTS
from retrace.output_dir import MARKER, OutputDirError, check_output, staged_output

_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_TEMPLATE = Path(__file__).with_name("model.py")
KIND = "triton-repository"  # the owner-marker kind (retrace.output_dir)


class RepositoryError(RetraceError, ValueError):
    """The repository cannot be written as asked; the message says why."""


def _q(s: str) -> str:
    return json.dumps(str(s))  # protobuf text format accepts JSON-style escaped strings


def render_config(
    model_name: str,
    *,
    instances: int,
    parameters: dict[str, str],
    device: str = "cpu",
) -> str:
    """The config.pbtxt text: python backend, decoupled, no Triton-side batching (the model batches).

    max_batch_size 0 with fully defined shapes: a single value is dims [1], a list dims [-1]. That is the
    shape vLLM's backend declares and the one every client sends ([1]-shaped tensors: perf_analyzer via
    genai-perf, /generate's scalars, tritonclient); with max_batch_size > 0 (TensorRT-LLM's ensemble) a
    [1]-shaped tensor would be refused ([-1, 1] expected), and Triton-side batching adds nothing here: the
    requests of a decoupled model already join the runtime's scheduler one by one and share its rounds."""
    lines = [
        f"name: {_q(model_name)}",
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        "input [",
    ]
    ins = []
    for name, (dtype, optional) in INPUTS.items():
        opt = " optional: true" if optional else ""
        dims = "-1" if name in LISTS else "1"
        ins.append(f"  {{ name: {_q(name)} data_type: {dtype} dims: [ {dims} ]{opt} }}")
    lines.append(",\n".join(ins))
    lines += ["]", "output ["]
    lines.append(",\n".join(f"  {{ name: {_q(n)} data_type: {t} dims: [ -1 ] }}" for n, t in OUTPUTS.items()))
    kind = "KIND_GPU" if device == "cuda" else "KIND_CPU"  # GPU: one set of `count` instances per visible GPU
    lines += ["]", f"instance_group [ {{ count: {int(instances)} kind: {kind} }} ]"]
    for key, value in parameters.items():
        lines.append(f"parameters {{ key: {_q(key)} value: {{ string_value: {_q(value)} }} }}")
    return "\n".join(lines) + "\n"


def _ignore(_dir: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or n.endswith((".pyc", ".pyo"))]


def is_legacy_repository(path: Path) -> bool:
    """A marker-less repository written by an older retrace: only model dirs with config.pbtxt + retrace.json."""
    entries = [p for p in path.iterdir() if p.name != MARKER]
    return bool(entries) and all(p.is_dir() and not p.is_symlink() and (p / "config.pbtxt").is_file()
                                 and (p / "retrace.json").is_file() for p in entries)


def write_repository(
    bundle_dir: str | os.PathLike[str],
    out_repo: str | os.PathLike[str],
    model_name: str = "retrace",
    instances: int = 1,
    max_batch: int = 8,
    copy_bundle: bool = True,
    env_path: str | os.PathLike[str] | None = None,
    *,
    backend: str = "onnxruntime",
    max_tokens: int = 0,
    modes: Sequence[str] = ("retrace", "dflash", "ar"),
    vendor_package: bool = True,
    runtime_factory: str | None = None,
    runtime_options: dict[str, Any] | None = None,
    pythonpath: Sequence[str | os.PathLike[str]] = (),
    force: bool = False,
    verify_policy: str = "adaptive",
    device: str = "cpu",
) -> Path:
    """Write the model repository for ``bundle_dir`` at ``out_repo`` and return its path.

    ``env_path``: the python-backend execution environment (``EXECUTION_ENV_PATH``), e.g.
    ``ensure_triton_env().model_env``; None leaves the model in the server's own Python (which then
    needs numpy<2 and the runtime's packages). ``runtime_factory``/``runtime_options`` replace the real
    runtime (tests only); ``runtime_options`` alone are extra keyword arguments for
    ``Runtime.from_bundle`` (e.g. ``{"threads": 4, "max_seq_len": 2048}`` for onnxruntime). ``vendor_package=False``
    imports retrace from the environment or
    ``pythonpath`` instead of a copy inside the repository. ``verify_policy``: drafts verified per round
    (``adaptive`` | ``fixed``, parameter RETRACE_VERIFY_POLICY; see retrace/runtime/verify_policy.py).
    """
    bundle = Path(bundle_dir).absolute()
    out = Path(out_repo).absolute()
    if not (bundle / "manifest.json").is_file():
        raise RepositoryError(f"{bundle} is not an engine bundle (no manifest.json)")
    if not _NAME_RE.match(model_name):
        raise RepositoryError(f"model name {model_name!r} must match {_NAME_RE.pattern}")
    if instances < 1 or max_batch < 1:
        raise RepositoryError(f"instances ({instances}) and max_batch ({max_batch}) must be >= 1")
    try:
        man = json.loads((bundle / "manifest.json").read_text())
        limit, fmt = man.get("limits", {}).get("max_batch"), man.get("format")
    except (OSError, ValueError) as e:
        raise RepositoryError(f"{bundle / 'manifest.json'}: cannot read the bundle manifest ({e})") from None
    if limit is not None and max_batch > int(limit):
        raise RepositoryError(f"max_batch {max_batch} exceeds the bundle's limit {limit} (its preallocated "
                              f"caches); rebuild it with retrace-export build --max-batch {max_batch}")
    if max_tokens < 0:
        raise RepositoryError(f"max_tokens must be >= 0 (0: the bundle's limit), got {max_tokens}")
    if verify_policy not in ("adaptive", "fixed"):
        raise RepositoryError(f"verify_policy must be 'adaptive' or 'fixed', got {verify_policy!r}")
    if device not in ("cpu", "cuda"):
        raise RepositoryError(f"device must be 'cpu' or 'cuda', got {device!r}")
    from retrace.runtime.api import BUNDLE_DEVICES

    runs_on = BUNDLE_DEVICES.get(backend, (device, False))[0]
    if runtime_factory is None and runs_on != device:
        raise RepositoryError(f"the {backend} backend runs on {runs_on}: device {device!r} needs a "
                              f"{'tensorrt' if device == 'cuda' else 'onnxruntime'} bundle")
    modes = [m.strip() for m in modes if m.strip()]
    if not modes or any("," in m for m in modes):
        raise RepositoryError(f"modes must be non-empty names without commas, got {modes}")
    if env_path is not None:
        env = Path(env_path).absolute()
        if not (env / "bin" / "activate").is_file() and not str(env).endswith((".tar.gz", ".tgz")):
            raise RepositoryError(f"execution environment {env} has no bin/activate (and is not a .tar.gz)")
    if out == bundle or out in bundle.parents:
        raise RepositoryError(f"the repository {out} must not contain the bundle {bundle}")
    if bundle in out.parents:
        raise RepositoryError(f"the repository {out} must not be inside the bundle {bundle}")
    ownership = dict(kind=KIND, force=force, legacy=is_legacy_repository, what="Triton model repository",
                     exists_hint="pass force=True (--force) to replace it")
    try:
        check_output(out, **ownership)
    except OutputDirError as e:
        raise RepositoryError(str(e)) from None
    from retrace.engines.bundle import FORMAT, verify

    if copy_bundle and fmt == FORMAT:  # the copy must be what was built: refuse a bundle that does not verify
        try:  # (other formats: test stand-ins, served by runtime_factory; the real runtime refuses them)
            verify(bundle, full=True)
        except RetraceError as e:
            raise RepositoryError(str(e)) from None

    with staged_output(out, **ownership) as tmp:
        model_dir = tmp / model_name
        (model_dir / "1").mkdir(parents=True)
        shutil.copy2(_TEMPLATE, model_dir / "1" / "model.py")
        if vendor_package:
            shutil.copytree(Path(retrace.__file__).parent, model_dir / "1" / "retrace", ignore=_ignore)
        if copy_bundle:
            shutil.copytree(bundle, model_dir / "bundle")  # every file: the runtime re-hashes them
            bundle_param = "bundle"
        else:
            bundle_param = str(bundle)
        params: dict[str, str] = {
            "RETRACE_BUNDLE": bundle_param,
            "RETRACE_BACKEND": backend,
            "RETRACE_MAX_BATCH": str(int(max_batch)),
            "RETRACE_MAX_TOKENS": str(int(max_tokens)),
            "RETRACE_MODES": ",".join(modes),
            "RETRACE_VERIFY_POLICY": verify_policy,
            "RETRACE_DEVICE": device,
        }
        if env_path is not None:
            params["EXECUTION_ENV_PATH"] = str(Path(env_path).absolute())
        if pythonpath:
            params["RETRACE_PYTHONPATH"] = os.pathsep.join(str(Path(p).absolute()) for p in pythonpath)
        if runtime_factory:
            params["RETRACE_RUNTIME_FACTORY"] = runtime_factory
        if runtime_options:
            params["RETRACE_RUNTIME_OPTIONS"] = json.dumps(runtime_options)
        (model_dir / "config.pbtxt").write_text(render_config(model_name, instances=instances, parameters=params,
                                                              device=device))
        meta = {
            "generator": f"retrace {retrace.__version__}",
            "bundle_source": str(bundle),
            "copy_bundle": copy_bundle,
            "instances": instances,
            "max_batch": max_batch,
            "parameters": params,
        }
        (model_dir / "retrace.json").write_text(json.dumps(meta, indent=1) + "\n")
        os.chmod(tmp, 0o755)
    return out
