"""Giving back the file pages a process touched while it loaded and will not read again (Linux; elsewhere a
no-op): the model files' and the shared libraries' code.

ONNX Runtime maps a bundle's weight files and, on the CPU, prepacks its MatMulNBits weights into buffers of
its own at load: the packed tables' file pages it read to do so stay in the process's resident set, though
nothing reads them again (0.6B-shape int4 bundle: the 78 MB LM head's among 92 MB of the target file's
resident pages, 0.09 GB of a 0.79 GB peak for one generate). `release(root)` tells the kernel, after load, that
the process does not need the pages of its read-only mappings of files under `root` (MADV_DONTNEED): they
leave the resident set, the file's data stays in the page cache, and a page read again (an embedding row, a
weight some kernel reads in place) comes back from there on first touch, the same bytes. Only mappings without
write permission are given back: a private mapping's written (copied) page would lose its contents.

The libraries (`release_libraries()`): `import torch` alone leaves ~70 MB of libtorch_cpu's code resident
(its static initializers register every operator, page after page), of which a decode loop runs a few MB.
Their code mappings (read-only, every resident page a clean page of the file: smaps shows no Anonymous or
Private_Dirty) are given back the same way; a read-only segment a loader relocated (RELRO: written copies) is
left alone. What a later call runs comes back from the page cache on first touch (a minor fault per page, once),
as it would after the kernel reclaimed it under memory pressure. 0.6B-shape int4 bundle, one-request generate:
peak 0.72 -> 0.64 GB (docs/quantization.md, "Peak RSS").
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


def clean_library_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of shared libraries (files named *.so or *.so.N) that have no
    write permission and whose resident pages are all clean pages of the file (no Anonymous, no
    Private_Dirty in /proc/self/smaps)."""
    spans, head, dirty = [], None, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:  # a mapping's first line
                if head is not None and not dirty:
                    spans.append(head)
                head, dirty = None, 0
                name = parts[5].rstrip("\n") if len(parts) == 6 else ""
                if "w" not in parts[1] and name.startswith("/") and _is_library(name):
                    head = tuple(int(x, 16) for x in parts[0].split("-"))
            elif head is not None and parts[0] in ("Anonymous:", "Private_Dirty:"):
                dirty += int(parts[1])
    if head is not None and not dirty:
        spans.append(head)
    return spans


def _is_library(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".so") or ".so." in name


def release(root: str | Path) -> int:
    """MADV_DONTNEED the read-only mappings of files under `root` -> how many were given back (0 off Linux)."""
    return _dont_need(read_only_mappings(Path(root))) if sys.platform.startswith("linux") else 0


def release_libraries() -> int:
    """MADV_DONTNEED the shared libraries' clean read-only mappings -> how many were given back (0 off Linux)."""
    return _dont_need(clean_library_mappings()) if sys.platform.startswith("linux") else 0


def after_load(root: str | Path) -> int:
    """What loading from `root` touched and a run does not need: its files' pages and the libraries' code."""
    return release(root) + release_libraries()


def _dont_need(spans: list[tuple[int, int]]) -> int:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return sum(libc.madvise(start, end - start, MADV_DONTNEED) == 0 for start, end in spans)
