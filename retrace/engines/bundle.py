"""The engine bundle format: a directory with `manifest.json` that names and hashes every other file.

    BUNDLE/
      manifest.json            format + version, retrace version, backend, dtype, model configs, limits,
                               graph I/O, build parity figures, and {path: {sha256, size}} for every file
      target/model.onnx        (+ model.onnx.data: the weights, always external)
      drafter/model.onnx       (+ model.onnx.data)
      tokenizer/               tokenizer.json etc. copied from the target directory (when present)

Readers refuse a manifest whose `format_version` they do not know, and (by default) a bundle whose files
do not match their recorded sha256. The manifest itself is covered too (`manifest_problems`): every path in
it must stay inside the bundle, every graph, weights-data, tokenizer and engine file it names must have a
`files` entry, no file may sit in the bundle without one, and `manifest_sha256` (the sha256 of the
manifest's canonical JSON without that key) must match when present (bundles from before it lack it).
Nothing here imports torch or onnxruntime.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from retrace.digest import sha256_file, sha256_pieces, sha256_range
from retrace.errors import RetraceError

MANIFEST = "manifest.json"
OWNER_MARKER = ".retrace-output.json"  # retrace.output_dir.MARKER: not part of the bundle's content
FORMAT = "retrace-engine-bundle"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
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
            if rel not in (MANIFEST, OWNER_MARKER):
                out.append(rel)
    return sorted(out)


def hash_files(root: str | Path, rel_paths: list[str]) -> dict[str, dict]:
    """{rel: {"sha256", "size"}} (+ "chunk_size", "chunks" for files over PIECE bytes), in parallel."""
    root = Path(root)

    def one(rel: str) -> dict:
        size = (root / rel).stat().st_size
        big = size > PIECE
        whole, chunks = sha256_pieces(root / rel, PIECE) if big else (sha256_file(root / rel), [])
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
    manifest.pop("manifest_sha256", None)
    manifest["manifest_sha256"] = manifest_digest(manifest)
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
        raise BundleError(f"{path}: not a retrace engine bundle manifest (format "
                          f"{m.get('format') if isinstance(m, dict) else None!r}, "
                          f"expected {FORMAT!r})")
    v = m.get("format_version")
    if v not in SUPPORTED_VERSIONS:
        raise BundleError(f"{path}: bundle format version {v!r} is not supported by retrace {retrace_version()} "
                          f"(it reads version {', '.join(map(str, SUPPORTED_VERSIONS))}); rebuild the bundle with "
                          "this retrace-export or upgrade retrace")
    if not isinstance(m.get("files"), dict):
        raise BundleError(f"{path}: manifest has no 'files' table")
    return m


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no whitespace), `manifest_sha256` left out."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _inside(root: Path, rel) -> bool:
    """rel is a relative path that, symlinks resolved, stays inside root."""
    if not isinstance(rel, str) or not rel or "\0" in rel:
        return False
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts:
        return False
    try:
        (root / p).resolve().relative_to(root.resolve())
    except (ValueError, OSError, RuntimeError):
        return False
    return True


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def manifest_problems(root: str | Path, manifest: dict) -> list[str]:
    """What in the manifest itself cannot be trusted (empty: none). See the module docstring."""
    root = Path(root)
    files = manifest.get("files") or {}
    out: list[str] = []
    want = manifest.get("manifest_sha256")
    if want is not None and want != manifest_digest(manifest):
        out.append(f"{MANIFEST} was edited after the build (manifest_sha256 does not match its content)")
    for rel in files:
        if not _inside(root, rel):
            out.append(f"files entry {rel!r} points outside the bundle")

    def need(rel, what: str) -> None:
        if not _inside(root, rel):
            out.append(f"{what} {rel!r} is not a path inside the bundle")
        elif rel not in files:
            out.append(f"{what} {rel!r} has no files entry (its sha256 is not recorded)")

    graphs = manifest.get("graphs") or {}
    if not isinstance(graphs, dict):
        out.append("'graphs' is not a table")
        graphs = {}
    for name, g in graphs.items():
        if not isinstance(g, dict):
            out.append(f"graphs.{name} is not a table")
            continue
        need(g.get("path"), f"graphs.{name}.path")
        if g.get("data") is not None:
            need(g.get("data"), f"graphs.{name}.data")
        elif isinstance(g.get("path"), str):  # weights beside the graph are always external: both are listed
            data = g["path"] + ".data"
            if (root / data).exists() or os.path.lexists(root / data):
                need(data, f"graphs.{name} weights")
    tok = manifest.get("tokenizer")
    if tok:
        d = tok.get("dir") if isinstance(tok, dict) else None
        if not _inside(root, d):
            out.append(f"tokenizer.dir {d!r} is not a directory inside the bundle")
        else:
            for n in tok.get("files") or []:
                need(f"{d}/{n}", "tokenizer file")
    for eng, info in (manifest.get("engines") or {}).items():
        for key, rel in (info or {}).items() if isinstance(info, dict) else ():
            if key == "dir":
                if not _inside(root, rel):
                    out.append(f"engines.{eng}.dir {rel!r} is not a directory inside the bundle")
            elif key != "notes" and isinstance(rel, str):
                need(rel, f"engines.{eng}.{key}")
    limits = manifest.get("limits")
    if limits is not None:
        if not isinstance(limits, dict):
            out.append("'limits' is not a table")
        else:
            for k in ("max_batch", "max_seq_len"):
                if k in limits and not _positive_int(limits[k]):
                    out.append(f"limits.{k} must be a positive integer, got {limits[k]!r}")
            if limits.get("block_size") is not None and not _positive_int(limits["block_size"]):
                out.append(f"limits.block_size must be a positive integer or null, got {limits['block_size']!r}")
    target = (manifest.get("models") or {}).get("target") if isinstance(manifest.get("models"), dict) else None
    if graphs.get("target") is not None and not (isinstance(target, dict) and isinstance(target.get("config"), dict)):
        out.append("models.target.config (the target's config.json) is missing")
    return out


@dataclass
class FileCheck:
    path: str
    status: str  # "ok" | "missing" | "outside" | "size" | "sha256" | "unlisted" | "unchecked"
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
        if not _inside(root, rel):
            out[rel] = FileCheck(rel, "outside", expected="a path inside the bundle")
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
        return sha256_file(root / rel) if i is None else sha256_range(root / rel, start, length)

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
    """Raise BundleError naming every file that does not match, every file not in the manifest and every
    problem of the manifest itself (manifest_problems); returns the manifest."""
    manifest = read_manifest(root) if manifest is None else manifest
    problems = manifest_problems(root, manifest)
    bad = [c for c in check_files(root, manifest, full=full) if not c.ok]
    if problems or bad:
        items = problems + [describe_check(c) for c in bad]
        what = "; ".join(items[:6]) + (" ..." if len(items) > 6 else "")
        raise BundleError(f"{root}: engine bundle does not match its manifest ({what}). It was modified or "
                          "copied incompletely: rebuild it with retrace-export build (--force)")
    return manifest


def is_complete_bundle(root: str | Path) -> bool:
    """True when root is a bundle that verifies completely (every hash) and holds nothing but the files its
    manifest lists: the test for replacing, with --force, a bundle built before owner markers existed."""
    try:
        verify(root, full=True)
    except (RetraceError, OSError):
        return False
    return True


def describe_check(c: FileCheck) -> str:
    """One FileCheck as a short phrase for an error message ("x is missing", "x sha256 ab.. != manifest cd..")."""
    if c.status == "missing":
        return f"{c.path} is missing"
    if c.status == "outside":
        return f"{c.path} is outside the bundle"
    if c.status == "unlisted":
        return f"{c.path} is not in the manifest"
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
    def weights(self) -> str:
        """fp32, or int8 / int4 for a weight-only quantized bundle (retrace.export.quantize)."""
        return self.manifest.get("weights", "fp32")

    @property
    def limits(self) -> dict:
        return dict(self.manifest.get("limits") or {})

    def graph(self, name: str) -> dict | None:
        return (self.manifest.get("graphs") or {}).get(name)

    def graph_path(self, name: str) -> Path:
        g = self.graph(name)
        if g is None:
            raise BundleError(f"{self.root}: bundle has no {name} graph")
        rel = g.get("path")
        if not _inside(self.root, rel) or rel not in self.manifest.get("files", {}):
            raise BundleError(f"{self.root}: graphs.{name}.path {rel!r} is not a listed file inside the bundle")
        return self.root / rel

    def model(self, name: str) -> dict | None:
        return (self.manifest.get("models") or {}).get(name)

    @property
    def tokenizer_dir(self) -> Path | None:
        t = self.manifest.get("tokenizer")
        if not t:
            return None
        if not _inside(self.root, t.get("dir")):
            raise BundleError(f"{self.root}: tokenizer.dir {t.get('dir')!r} is not inside the bundle")
        return self.root / t["dir"]
