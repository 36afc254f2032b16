"""Builds that every pytest-xdist worker of a test run shares: the first worker to ask builds under a file
lock into the run's shared temporary directory, the others wait and read what it recorded. An export of the
session pair costs ~25-35 s on a 2-core CI machine: once per run instead of once per worker.

conftest.py's session fixture points `ROOT` at the run's directory (pytest's base temporary directory, the
parent of the workers' own under xdist); outside pytest (a script importing the fixtures) each process
builds into a directory of its own.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

ROOT: Path | None = None


def process_root() -> Path:
    """A temporary directory of this process's own, removed at exit."""
    root = Path(tempfile.mkdtemp(prefix="retrace-tests-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


def shared_build(name: str, build: Callable[[Path], dict]) -> tuple[Path, dict]:
    """build(an empty directory) -> a JSON-able record of what it made there; run once per test run.
    -> (the directory, the record). A build that raised leaves no record: the next caller builds again."""
    root = ROOT or process_root()
    out, record = root / name, root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if not record.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a failed build left
            out.mkdir(parents=True)
            record.write_text(json.dumps(build(out)))
    return out, json.loads(record.read_text())
