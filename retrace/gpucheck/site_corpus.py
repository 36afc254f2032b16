"""A training corpus from the Python sources installed on the machine (its site-packages), split by file.

Files are listed under every site-packages / purelib / platlib directory, filtered with the zoo corpus's
rules (no tests, no generated tables), deduplicated by content, split train / held-out by a salted hash
of the relative path (`retrace.train.corpus.is_heldout`), and read in a fixed hash order until the
character caps are reached (so tokenizer training and encoding stay bounded on a large environment).
"""

from __future__ import annotations

import hashlib
import os
import site
import sysconfig
from pathlib import Path

from retrace.train.corpus import MIN_FILE_CHARS, CorpusSplit, SourceFile, _excluded, _path_hash, is_heldout

SALT = "retrace-gpucheck-split-v1"
MAX_FILE_CHARS = 200_000  # generated tables and vendored blobs teach little


def roots() -> list[Path]:
    found: list[Path] = []
    cands = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    cands += [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")]
    for c in cands:
        if c and Path(c).is_dir():
            p = Path(c).resolve()
            if p not in found and not any(p.is_relative_to(f) for f in found):
                found.append(p)
    return found


def _walk(root: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.endswith((".dist-info", ".egg-info")))
        for fn in filenames:
            if fn.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, fn), root))
    return out


def load(max_train_chars: int, max_eval_chars: int, eval_fraction: float = 0.03,
         roots_: list[Path] | None = None) -> CorpusSplit:
    rs = roots_ if roots_ is not None else roots()
    listed = [(r, rel) for r in rs for rel in _walk(r) if not _excluded(Path(rel))]
    listed.sort(key=lambda x: (_path_hash(Path(x[1]).as_posix(), SALT + "/order"), x[1]))
    train: list[SourceFile] = []
    eval_: list[SourceFile] = []
    seen: set[bytes] = set()
    tc = ec = 0
    for root, rel in listed:
        rel = Path(rel).as_posix()
        held = is_heldout(rel, eval_fraction, SALT)
        if (held and ec >= max_eval_chars) or (not held and tc >= max_train_chars):
            if tc >= max_train_chars and ec >= max_eval_chars:
                break
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if not MIN_FILE_CHARS <= len(text) <= MAX_FILE_CHARS or "\x00" in text:
            continue
        h = hashlib.sha256(text.encode()).digest()
        if h in seen:
            continue
        seen.add(h)
        (eval_ if held else train).append(SourceFile(rel, text))
        if held:
            ec += len(text)
        else:
            tc += len(text)
    if not train or not eval_:
        raise RuntimeError(f"site-packages corpus too small: {len(train)} train / {len(eval_)} held-out files "
                           f"under {[str(r) for r in rs]}")
    split = CorpusSplit(sorted(train, key=lambda f: f.relpath), sorted(eval_, key=lambda f: f.relpath),
                        ";".join(map(str, rs)), "site-packages", eval_fraction)
    return split
