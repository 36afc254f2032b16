"""The engine bundle format: a directory with `manifest.json` that names and hashes every other file.

    BUNDLE/
      manifest.json            format + version, retrace version, backend, dtype, model configs, limits,
                               graph I/O, build parity figures, and {path: {sha256, size}} for every file
      target/model.onnx        (+ model.onnx.data: the weights, always external)
      drafter/model.onnx       (+ model.onnx.data)
      tokenizer/               tokenizer.json etc. copied from the target directory (when present)

Readers refuse a manifest whose `format_version` they do not know, and (by default) a bundle whose files
do not match their recorded sha256. Nothing here imports torch or onnxruntime.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from retrace.errors import RetraceError

MANIFEST = "manifest.json"
FORMAT = "retrace-engine-bundle"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
_CHUNK = 8 << 20  # read size
# Files larger than this also record the sha256 of each PIECE-sized piece, so that loading can verify one
# large weights file on all cores at once (the whole-file sha256 stays, for humans and sha256sum).
PIECE = 64 << 20


class BundleError(RetraceError):
    """Not a bundle, an unknown format version, or files that do not match the manifest."""


def retrace_version() -> str:
    try:
        from importlib.metadata import version

        return version("retrace")
    except Exception:  # noqa: BLE001 - not installed as a distribution (plain checkout)
        return "unknown"


def sha256_file(path: str | Path) -> str:
    return _digest_file(path)[0]


def _digest_file(path: str | Path, chunk_size: int | None = None) -> tuple[str, list[str]]:
    """sha256 of the whole file and, when chunk_size is given, of each chunk_size piece (one read)."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    piece = hashlib.sha256() if chunk_size else None
    in_piece = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            data = view[:n]
            whole.update(data)  # hashlib releases the GIL on large updates: files hash in parallel
            while piece is not None and len(data):
                take = min(len(data), chunk_size - in_piece)
                piece.update(data[:take])
                in_piece += take
                data = data[take:]
                if in_piece == chunk_size:
                    chunks.append(piece.hexdigest())
                    piece, in_piece = hashlib.sha256(), 0
    if piece is not None and in_piece:
        chunks.append(piece.hexdigest())
    return whole.hexdigest(), chunks


def _digest_range(path: Path, start: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        buf = bytearray(min(_CHUNK, max(length, 1)))
        view = memoryview(buf)
        left = length
        while left and (n := f.readinto(view[: min(len(buf), left)])):
            h.update(view[:n])
            left -= n
    return h.hexdigest()


def _workers(n_items: int) -> int:
    return max(1, min(n_items, os.cpu_count() or 1, 8))


def bundle_files(root: str | Path) -> list[str]:
    """Every regular file under root except the manifest, as sorted POSIX relative paths."""
    root = Path(root)
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if rel != MANIFEST:
                out.append(rel)
    return sorted(out)


def hash_files(root: str | Path, rel_paths: list[str]) -> dict[str, dict]:
    """{rel: {"sha256", "size"}} (+ "chunk_size", "chunks" for files over PIECE bytes), in parallel."""
    root = Path(root)

    def one(rel: str) -> dict:
        size = (root / rel).stat().st_size
        big = size > PIECE
        whole, chunks = _digest_file(root / rel, PIECE if big else None)
        entry = {"sha256": whole, "size": size}
        if big:
            entry.update(chunk_size=PIECE, chunks=chunks)
        return entry

    with ThreadPoolExecutor(_workers(len(rel_paths))) as ex:
        entries = list(ex.map(one, rel_paths))
    return dict(zip(rel_paths, entries, strict=True))


def write_manifest(root: str | Path, manifest: dict) -> dict:
    """Hash every file under root into manifest["files"] and write manifest.json (returns the manifest)."""
    root = Path(root)
    manifest = dict(manifest)
    manifest["format"] = FORMAT
    manifest["format_version"] = FORMAT_VERSION
    manifest["files"] = hash_files(root, bundle_files(root))
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def read_manifest(root: str | Path) -> dict:
    """Parse and check manifest.json: it must be this format and a version this reader knows."""
    root = Path(root)
    path = root / MANIFEST
    if not root.is_dir():
        raise BundleError(f"{root}: engine bundle directory not found")
    if not path.is_file():
        raise BundleError(f"{root}: not an engine bundle (no {MANIFEST}; build one with retrace-export build)")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise BundleError(f"{path}: not a retrace engine bundle manifest (format {m.get('format') if isinstance(m, dict) else None!r}, "
                          f"expected {FORMAT!r})")
    v = m.get("format_version")
    if v not in SUPPORTED_VERSIONS:
        raise BundleError(f"{path}: bundle format version {v!r} is not supported by retrace {retrace_version()} "
                          f"(it reads version {', '.join(map(str, SUPPORTED_VERSIONS))}); rebuild the bundle with "
                          "this retrace-export or upgrade retrace")
    if not isinstance(m.get("files"), dict):
        raise BundleError(f"{path}: manifest has no 'files' table")
    return m


@dataclass
class FileCheck:
    path: str
    status: str  # "ok" | "missing" | "size" | "sha256" | "unlisted" | "unchecked"
    expected: str | None = None
    actual: str | None = None
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "unchecked")


def check_files(root: str | Path, manifest: dict, full: bool = True) -> list[FileCheck]:
    """Compare the files on disk with the manifest. full=False checks existence and sizes only (fast);
    full=True also re-hashes every file (in parallel). Files present but not listed are reported too."""
    root = Path(root)
    listed: dict[str, dict] = manifest["files"]
    out: dict[str, FileCheck] = {}
    to_hash = []
    for rel, meta in listed.items():
        p = root / rel
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            out[rel] = FileCheck(rel, "missing", expected="a path inside the bundle")
        elif not p.is_file():
            out[rel] = FileCheck(rel, "missing")
        elif p.stat().st_size != meta.get("size"):
            out[rel] = FileCheck(rel, "size", str(meta.get("size")), str(p.stat().st_size))
        elif full:
            to_hash.append(rel)
        else:
            out[rel] = FileCheck(rel, "unchecked")
    if to_hash:
        out.update(_verify_digests(root, {r: listed[r] for r in to_hash}))
    for rel in bundle_files(root):
        if rel not in listed:
            out[rel] = FileCheck(rel, "unlisted")
    return [out[k] for k in sorted(out)]


def _verify_digests(root: Path, entries: dict[str, dict]) -> dict[str, FileCheck]:
    """rel -> FileCheck ("ok" or "sha256"). Files with piece digests are checked piece by piece, all pieces of
    all files in parallel (every byte is still covered); the others by their whole-file sha256."""
    jobs = []  # (rel, index or None, start, length, expected)
    for rel, meta in entries.items():
        chunks, size = meta.get("chunks"), int(meta.get("size", 0))
        cs = int(meta.get("chunk_size") or 0)
        if chunks and cs > 0 and len(chunks) == (size + cs - 1) // cs:
            jobs += [(rel, i, i * cs, min(cs, size - i * cs), d) for i, d in enumerate(chunks)]
        else:
            jobs.append((rel, None, 0, size, meta.get("sha256")))

    def run(job):
        rel, i, start, length, _ = job
        return sha256_file(root / rel) if i is None else _digest_range(root / rel, start, length)

    with ThreadPoolExecutor(_workers(len(jobs))) as ex:
        got = list(ex.map(run, jobs))
    out: dict[str, FileCheck] = {}
    for (rel, i, _s, _l, exp), act in zip(jobs, got, strict=True):
        if rel in out and not out[rel].ok:
            continue  # report the first bad piece
        if exp == act:
            out[rel] = FileCheck(rel, "ok", entries[rel].get("sha256"), entries[rel].get("sha256"))
        else:
            out[rel] = FileCheck(rel, "sha256", exp, act, None if i is None else f"piece {i} of "
                                 f"{entries[rel]['chunk_size'] >> 20} MiB")
    return out


def verify(root: str | Path, manifest: dict | None = None, full: bool = True) -> dict:
    """Raise BundleError naming every file that does not match; returns the manifest."""
    manifest = read_manifest(root) if manifest is None else manifest
    bad = [c for c in check_files(root, manifest, full=full) if not c.ok and c.status != "unlisted"]
    if bad:
        what = "; ".join(_describe(c) for c in bad[:6]) + (" ..." if len(bad) > 6 else "")
        raise BundleError(f"{root}: engine bundle does not match its manifest ({what}). It was modified or "
                          "copied incompletely: rebuild it with retrace-export build (--force)")
    return manifest


def _describe(c: FileCheck) -> str:
    if c.status == "missing":
        return f"{c.path} is missing"
    if c.status == "size":
        return f"{c.path} has {c.actual} bytes, manifest says {c.expected}"
    if c.status == "sha256":
        where = f" ({c.detail})" if c.detail else ""
        return f"{c.path} sha256{where} {(c.actual or '')[:12]}... != manifest {(c.expected or '')[:12]}..."
    return f"{c.path}: {c.status}"


@dataclass
class Bundle:
    """A loaded (and by default verified) bundle: the manifest and the paths the backends need."""

    root: Path
    manifest: dict

    @classmethod
    def open(cls, root: str | Path, verify_hashes: bool = True) -> Bundle:
        """Read the manifest; verify_hashes=True re-hashes every file (parallel), False checks only that
        every listed file exists with its recorded size."""
        root = Path(root)
        m = read_manifest(root)
        verify(root, m, full=verify_hashes)
        return cls(root, m)

    @property
    def backend(self) -> str:
        return self.manifest.get("backend", "onnxruntime")

    @property
    def dtype(self) -> str:
        return self.manifest.get("dtype", "float32")

    @property
    def limits(self) -> dict:
        return dict(self.manifest.get("limits") or {})

    def graph(self, name: str) -> dict | None:
        return (self.manifest.get("graphs") or {}).get(name)

    def graph_path(self, name: str) -> Path:
        g = self.graph(name)
        if g is None:
            raise BundleError(f"{self.root}: bundle has no {name} graph")
        return self.root / g["path"]

    def model(self, name: str) -> dict | None:
        return (self.manifest.get("models") or {}).get(name)

    @property
    def tokenizer_dir(self) -> Path | None:
        t = self.manifest.get("tokenizer")
        return self.root / t["dir"] if t else None
