"""Giving back a bundle's file pages after load (retrace/runtime/file_pages.py): read-only mappings leave the
resident set and read back the same bytes; a writable mapping is left alone."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from retrace.runtime import file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps, madvise")


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
