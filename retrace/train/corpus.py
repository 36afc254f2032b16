"""Offline training corpus for the tiny model zoo: the Python standard library's own sources.

Everything here is read from the running interpreter's stdlib directory
(``sysconfig.get_paths()["stdlib"]``); nothing is downloaded.  The result is deterministic for a given
interpreter installation: files are listed in sorted order, the train/eval split is a salted hash of the
relative path (so it does not depend on the file list or on the seed), and the per-size caps select
files in a fixed hash order.

Excluded: test suites (any ``test``/``tests`` directory), ``site-packages``, ``idlelib``, ``lib2to3``,
``turtledemo``, ``ensurepip``, ``config-*``, the generated ``_sysconfigdata*`` modules, the codec tables in
``encodings``, the big data tables (``html/entities.py``, ``pydoc_data``: its prose is used as a held-out
*docs* prompt domain instead, see :func:`pydoc_topics`), and files that are not UTF-8.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

SPLIT_SALT = "retrace-zoo-split-v1"
DEFAULT_EVAL_FRACTION = 0.05

EXCLUDED_DIR_NAMES = frozenset(
    {
        "test",
        "tests",
        "site-packages",
        "dist-packages",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "encodings",
        "pydoc_data",
        "__pycache__",
        "__phello__",
        "lib-dynload",
    }
)
EXCLUDED_FILES = frozenset({"html/entities.py", "__hello__.py", "antigravity.py", "this.py"})
EXCLUDED_PREFIXES = ("_sysconfigdata", "config-")
MIN_FILE_CHARS = 200


@dataclass(frozen=True)
class CorpusCaps:
    """Per-size caps, in characters (None = no cap)."""

    max_train_chars: int | None
    max_eval_chars: int | None


SIZE_CAPS: dict[str, CorpusCaps] = {
    # ~0.45 MB of train code: enough for a 512-token BPE and a few hundred training steps in seconds.
    "test": CorpusCaps(max_train_chars=450_000, max_eval_chars=120_000),
    # the whole stdlib (~11 MB of .py); the training loop decides how much of it it reads.
    "small": CorpusCaps(max_train_chars=None, max_eval_chars=None),
}


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix path relative to the stdlib root
    text: str


@dataclass
class CorpusSplit:
    train: list[SourceFile]
    eval: list[SourceFile]
    root: str
    size: str
    eval_fraction: float
    fingerprint: str = field(default="")  # sha256 over (split, relpath, text) of the selected files

    @property
    def train_chars(self) -> int:
        return sum(len(f.text) for f in self.train)

    @property
    def eval_chars(self) -> int:
        return sum(len(f.text) for f in self.eval)

    def summary(self) -> dict:
        return {
            "root": self.root,
            "size": self.size,
            "eval_fraction": self.eval_fraction,
            "train_files": len(self.train),
            "eval_files": len(self.eval),
            "train_chars": self.train_chars,
            "eval_chars": self.eval_chars,
            "fingerprint": self.fingerprint,
        }


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _path_hash(relpath: str, salt: str = SPLIT_SALT) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}\0{relpath}".encode()).digest()[:8], "big")


def is_heldout(relpath: str, eval_fraction: float = DEFAULT_EVAL_FRACTION, salt: str = SPLIT_SALT) -> bool:
    """True if ``relpath`` belongs to the held-out eval split (a salted hash, stable across runs)."""
    return _path_hash(relpath, salt) < int(eval_fraction * 2**64)


def _excluded(rel: Path) -> bool:
    parts = rel.parts
    if any(p in EXCLUDED_DIR_NAMES for p in parts[:-1]):
        return True
    if any(p.startswith(EXCLUDED_PREFIXES) for p in parts):
        return True
    if rel.as_posix() in EXCLUDED_FILES:
        return True
    name = parts[-1]
    return name.startswith("test_") and name.endswith(".py")


def iter_stdlib_sources(root: str | Path | None = None) -> list[SourceFile]:
    """All usable stdlib ``.py`` sources below ``root`` (default: this interpreter's), sorted by path."""
    root = Path(root).resolve() if root is not None else stdlib_dir()
    out: list[SourceFile] = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if _excluded(rel) or not path.is_file():
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if len(text) < MIN_FILE_CHARS or "\x00" in text:
            continue
        out.append(SourceFile(rel.as_posix(), text))
    return out


def _cap(files: list[SourceFile], max_chars: int | None, salt: str) -> list[SourceFile]:
    if max_chars is None:
        return files
    chosen: list[SourceFile] = []
    total = 0
    for f in sorted(files, key=lambda f: (_path_hash(f.relpath, salt + "/cap"), f.relpath)):
        if total >= max_chars:
            break
        if len(f.text) > max_chars // 4:  # keep capped sets diverse: skip single huge files
            continue
        chosen.append(f)
        total += len(f.text)
    return sorted(chosen, key=lambda f: f.relpath)


def _fingerprint(train: list[SourceFile], eval_: list[SourceFile]) -> str:
    h = hashlib.sha256()
    for tag, files in (("train", train), ("eval", eval_)):
        for f in files:
            h.update(f"{tag}\0{f.relpath}\0".encode())
            h.update(hashlib.sha256(f.text.encode()).digest())
    return h.hexdigest()


def load_corpus(
    size: str = "small",
    root: str | Path | None = None,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    salt: str = SPLIT_SALT,
) -> CorpusSplit:
    """The stdlib corpus split into train and held-out eval files, capped for ``size``."""
    if size not in SIZE_CAPS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(SIZE_CAPS)}")
    caps = SIZE_CAPS[size]
    root_path = Path(root).resolve() if root is not None else stdlib_dir()
    files = iter_stdlib_sources(root_path)
    if not files:
        raise RuntimeError(f"no usable .py sources under {root_path}")
    train = [f for f in files if not is_heldout(f.relpath, eval_fraction, salt)]
    eval_ = [f for f in files if is_heldout(f.relpath, eval_fraction, salt)]
    if not eval_ or not train:
        raise RuntimeError(f"degenerate split: {len(train)} train / {len(eval_)} eval files")
    train = _cap(train, caps.max_train_chars, salt)
    eval_ = _cap(eval_, caps.max_eval_chars, salt)
    split = CorpusSplit(train, eval_, str(root_path), size, eval_fraction)
    split.fingerprint = _fingerprint(train, eval_)
    return split


def pydoc_topics(root: str | Path | None = None) -> dict[str, str]:
    """The prose of ``pydoc_data/topics.py`` (the language reference topics), or {} if it is absent.

    ``pydoc_data`` is excluded from the training corpus, so all of it is held out.
    """
    root_path = Path(root).resolve() if root is not None else stdlib_dir()
    path = root_path / "pydoc_data" / "topics.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "topics" for t in node.targets
        ):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return {}
            if isinstance(value, dict):
                return {str(k): str(v) for k, v in sorted(value.items())}
    return {}
