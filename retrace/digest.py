"""sha256 of files: the one place the package hashes file contents.

- `sha256_file(path)`: one file's hex digest (what `sha256sum` prints);
- `sha256_pieces(path, piece)`: that and the digest of each `piece`-byte piece, in one read (an engine
  bundle's large files, retrace.engines.bundle.hash_files, verified piece by piece on all cores);
- `sha256_range(path, start, length)`: the digest of one such piece;
- `sha256_named_files(files, prefix)`: one digest over the name and contents of each (name, path) in order,
  after `prefix`: a content key for a set of files (a data directory, a zoo's sources);
- `dir_digest(*dirs, extra)`: that over the JSON and safetensors files directly in `dirs`, 16 hex digits
  (a model directory's key: bench build caches, the draft-ar trainer's).

Files are read in 8 MiB blocks into one reused buffer; hashlib releases the GIL on large updates, so files
hash in parallel from threads. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

_BLOCK = 8 << 20  # read size


def _update(h, path: str | Path, start: int = 0, length: int | None = None) -> None:
    """Feed `length` bytes of `path` from `start` (to its end when None) into the hash `h`."""
    with open(path, "rb", buffering=0) as f:
        if start:
            f.seek(start)
        buf = bytearray(_BLOCK if length is None else min(_BLOCK, max(length, 1)))
        view = memoryview(buf)
        left = length
        while left is None or left:
            n = f.readinto(view if left is None else view[: min(len(buf), left)])
            if not n:
                break
            h.update(view[:n])
            if left is not None:
                left -= n


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of the file's contents."""
    h = hashlib.sha256()
    _update(h, path)
    return h.hexdigest()


def sha256_range(path: str | Path, start: int, length: int) -> str:
    """The hex sha256 of `length` bytes of the file from `start`."""
    h = hashlib.sha256()
    _update(h, path, start, length)
    return h.hexdigest()


def sha256_pieces(path: str | Path, piece: int) -> tuple[str, list[str]]:
    """(the whole file's hex sha256, the hex sha256 of each `piece`-byte piece, the last one shorter), in one
    read of the file."""
    whole, part = hashlib.sha256(), hashlib.sha256()
    pieces: list[str] = []
    in_piece = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            data = view[:n]
            whole.update(data)
            while len(data):
                take = min(len(data), piece - in_piece)
                part.update(data[:take])
                in_piece += take
                data = data[take:]
                if in_piece == piece:
                    pieces.append(part.hexdigest())
                    part, in_piece = hashlib.sha256(), 0
    if in_piece:
        pieces.append(part.hexdigest())
    return whole.hexdigest(), pieces


def sha256_named_files(files: Iterable[tuple[str, str | Path]], prefix: str = "") -> str:
    """The hex sha256 of `prefix`, then of each file's name and contents, in the order given."""
    h = hashlib.sha256(prefix.encode())
    for name, path in files:
        h.update(name.encode())
        _update(h, path)
    return h.hexdigest()


def dir_digest(*dirs: str | Path, extra: str = "") -> str:
    """16 hex digits of sha256 over `extra`, then the names and contents of the JSON and weight (safetensors)
    files directly in each of the given directories (sorted by name, directory by directory)."""
    files = [(f.name, f) for d in dirs for f in sorted(Path(d).iterdir())
             if f.is_file() and f.suffix in (".json", ".safetensors")]
    return sha256_named_files(files, prefix=extra)[:16]
