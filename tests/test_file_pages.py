"""Giving back file pages after load (retrace/runtime/file_pages.py): a bundle's read-only mappings leave the
resident set and read back the same bytes; a writable mapping is left alone; the shared libraries' clean code
pages are given back and the code still runs, their relocated (written) read-only segments are left alone."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from retrace.runtime import file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps, madvise")


def _mappings() -> list[dict]:
    """This process's mappings: start, perms, name, rss and anonymous bytes (/proc/self/smaps)."""
    out = []
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                out.append({"start": int(parts[0].split("-")[0], 16), "perms": parts[1],
                            "name": parts[5] if len(parts) == 6 else "", "rss": 0, "anon": 0})
            elif parts[0] in ("Rss:", "Anonymous:"):
                out[-1]["rss" if parts[0] == "Rss:" else "anon"] += int(parts[1]) * 1024
    return out


def _resident(path) -> int:
    """Bytes of `path`'s pages resident in this process (/proc/self/smaps)."""
    total, mine = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                mine = len(parts) == 6 and parts[5] == str(path)
            elif mine and parts[0] == "Rss:":
                total += int(parts[1]) * 1024
    return total


def test_read_only_pages_are_given_back_and_read_back_the_same(tmp_path):
    data = np.arange(4 * 2**20, dtype=np.float32)  # 16 MiB
    (tmp_path / "weights.bin").write_bytes(data.tobytes())
    path = (tmp_path / "weights.bin").resolve()
    mapped = np.memmap(path, dtype=np.float32, mode="r")
    assert float(mapped.sum(dtype=np.float64)) == float(data.sum(dtype=np.float64))  # every page touched
    assert _resident(path) > 12 * 2**20
    assert file_pages.read_only_mappings(tmp_path) and file_pages.release(tmp_path) >= 1
    assert _resident(path) < 2**20
    assert np.array_equal(mapped[-1024:], data[-1024:]) and np.array_equal(mapped[:1024], data[:1024])


def test_a_writable_mapping_keeps_its_written_pages(tmp_path):
    (tmp_path / "scratch.bin").write_bytes(bytes(2**20))
    written = np.memmap(tmp_path / "scratch.bin", dtype=np.uint8, mode="c")  # private, copy on write
    written[:4096] = 7
    assert not file_pages.read_only_mappings(tmp_path)
    file_pages.release(tmp_path)
    assert int(written[:4096].min()) == 7


def test_files_elsewhere_are_not_touched(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w.bin").write_bytes(bytes(2**20))
    mapped = np.memmap(tmp_path / "a" / "w.bin", dtype=np.uint8, mode="r")
    assert int(mapped.sum()) == 0
    assert file_pages.read_only_mappings(tmp_path / "b") == []
    assert _resident((tmp_path / "a" / "w.bin").resolve()) > 0


def _torch_code() -> int:
    return sum(m["rss"] for m in _mappings() if m["name"].endswith("/libtorch_cpu.so") and "x" in m["perms"])


def test_library_code_pages_are_given_back_and_the_code_still_runs():
    import torch

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(96, 80, generator=g), torch.randn(80, 64, generator=g)
    before = (a @ b).softmax(-1)
    resident = _torch_code()
    assert resident > 8 * 2**20  # import's static initializers touched many MB of torch's code
    assert file_pages.release_libraries() >= 1
    assert _torch_code() < resident / 2
    assert torch.equal((a @ b).softmax(-1), before)
    assert _torch_code() > 0  # what ran came back


def test_relocated_read_only_segments_are_left_alone():
    import torch  # noqa: F401  (its libraries mapped: a relocated read-only segment among them)

    spans = {start for start, _ in file_pages.clean_library_mappings()}
    libs = [m for m in _mappings() if file_pages._is_library(m["name"]) and "w" not in m["perms"]]
    relocated = [m for m in libs if m["anon"]]
    assert relocated and spans
    assert not any(m["start"] in spans for m in relocated)
    assert all(m["start"] in spans for m in libs if not m["anon"] and m["rss"])
