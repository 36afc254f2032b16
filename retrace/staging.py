"""Temporary build directories left behind by killed builds: each name carries the builder's PID."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path


def remove_orphaned(dirs: Iterable[tuple[Path, int]]) -> None:
    """Delete each (directory, owner PID) whose owner process is gone. Our own directories, and those of
    processes we may not signal (another user's, still alive), are kept."""
    for path, pid in dirs:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass
