"""Giving back the model files' pages a process read while it loaded (Linux; elsewhere a no-op).

ONNX Runtime maps a bundle's weight files and, on the CPU, prepacks its MatMulNBits weights into buffers of
its own at load: the packed tables' file pages it read to do so stay in the process's resident set, though
nothing reads them again (0.6B-shape int4 bundle: the 78 MB LM head's among 92 MB of the target file's
resident pages, 0.09 GB of a 0.79 GB peak for one generate). `release(root)` tells the kernel, after load, that
the process does not need the pages of its read-only mappings of files under `root` (MADV_DONTNEED): they
leave the resident set, the file's data stays in the page cache, and a page read again (an embedding row, a
weight some kernel reads in place) comes back from there on first touch, the same bytes. Only mappings without
write permission are given back: a private mapping's written (copied) page would lose its contents.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

MADV_DONTNEED = 4  # linux/mman.h


def read_only_mappings(root: Path) -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of files under `root` that have no write permission."""
    prefix = str(Path(root).resolve()) + "/"
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and "w" not in parts[1] and parts[5].rstrip("\n").startswith(prefix):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                spans.append((start, end))
    return spans


def release(root: str | Path) -> int:
    """MADV_DONTNEED the read-only mappings of files under `root` -> how many were given back (0 off Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for start, end in read_only_mappings(Path(root)):
        done += libc.madvise(start, end - start, MADV_DONTNEED) == 0
    return done
