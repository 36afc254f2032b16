"""A content-addressed cache of exported ONNX graphs: an export of the same module (weights, structure,
settings) by the same code and exporter versions is copied from the cache instead of traced again.

torch's dynamo exporter costs ~10-12 s per graph whatever the model's size (its decompositions and
onnxscript's optimizer), minutes at the Qwen3-0.6B shape; a bundle built twice from one pair (fp32, then
`--weights int4`; another `--max-batch`) exports the same two graphs each time. The build's parity check
still runs on a cached graph against the torch model, so a wrong hit cannot pass unnoticed.

Opt-in: `retrace-export build --export-cache DIR`, or the environment variable RETRACE_EXPORT_CACHE=DIR
(the test suite points it at its run's shared directory). Nothing is evicted; the directory is yours.

    key    sha256 over: the wrapper module's weights and buffers (names, dtypes, shapes, bytes), every
           plain attribute and config of its submodules, the example inputs, the export settings (I/O
           names, dynamic shapes, attention form, plugin function), the exporter's package versions and
           the source of retrace's models, export and plugins packages
    entry  DIR/<key>/ holding the export's files (model.onnx, model.onnx.data), written to a temporary
           sibling first and renamed into place, so a reader sees a whole entry or none (two processes
           exporting the same graph at once both export; one rename wins)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from retrace.digest import sha256_named_files

ENV = "RETRACE_EXPORT_CACHE"
_SOURCES = ("models", "export", "plugins")  # retrace subpackages whose code shapes an exported graph
_PLAIN = (bool, int, float, str, tuple, list, dict, type(None))


def cache_dir(explicit: str | Path | None = None) -> Path | None:
    """The cache directory: `explicit`, else $RETRACE_EXPORT_CACHE, else None (no caching)."""
    where = explicit if explicit is not None else os.environ.get(ENV) or None
    return None if where is None else Path(where)


def graph_key(module: nn.Module, args: tuple, settings: dict) -> str:
    """The cache key of exporting `module` on example `args` with `settings` (JSON-able)."""
    h = hashlib.sha256()
    described = {"settings": settings, "modules": _attributes(module), "versions": _versions(),
                 "source": _source_digest()}
    h.update(json.dumps(described, sort_keys=True, default=repr).encode())
    for name, t in module.state_dict().items():
        _tensor(h, name, t)
    for i, a in enumerate(args):
        _tensor(h, f"arg{i}", a)
    return h.hexdigest()


def restore(root: Path, key: str, out_dir: Path) -> bool:
    """Copy a cached export into out_dir; False when there is none."""
    entry = root / key
    if not (entry / "model.onnx").is_file():
        return False
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in entry.iterdir():
        shutil.copyfile(f, out_dir / f.name)  # a copy: later build stages may rewrite the bundle's files
    return True


def store(root: Path, key: str, out_dir: Path, files: list[Path]) -> None:
    """Keep `files` (an export's, in out_dir) as the entry for `key`; an entry already there stays."""
    root.mkdir(parents=True, exist_ok=True)
    entry = root / key
    if entry.exists():
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=root))
    try:
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        os.rename(tmp, entry)
    except OSError:  # another process renamed its entry first (or the disk is full): no entry of ours
        shutil.rmtree(tmp, ignore_errors=True)


def _tensor(h, name: str, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().data)


def _attributes(module: nn.Module) -> dict:
    """Every submodule's plain attributes and dataclass configs (tap layers, flags, sizes), by path."""
    out = {}
    for path, m in module.named_modules():
        attrs = {k: repr(v) for k, v in vars(m).items()
                 if not k.startswith("_") and (isinstance(v, _PLAIN) or dataclasses.is_dataclass(v))}
        out[path or "."] = {"class": f"{type(m).__module__}.{type(m).__qualname__}", **attrs}
    return out


@functools.cache
def _versions() -> dict:
    import importlib.metadata as md

    names = ("torch", "onnx", "onnxscript", "onnx-ir", "retrace")
    found = {}
    for n in names:
        try:
            found[n] = md.version(n)
        except md.PackageNotFoundError:
            found[n] = None
    return found


@functools.cache
def _source_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    files = [(f.relative_to(root).as_posix(), f) for sub in _SOURCES for f in sorted((root / sub).rglob("*.py"))]
    return sha256_named_files(files)
