"""What retrace writes into an output directory: plain files with the mode any other file gets (umask),
never mkstemp's 0600 (zoo and trained drafters' model.safetensors / config.json were 0600)."""

from __future__ import annotations

import os
import stat

import torch

from retrace.models.checkpoint import atomic_save_tensors, atomic_write_text


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_atomic_writers_give_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        atomic_write_text(tmp_path / "config.json", "{}")
        atomic_save_tensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        assert _mode(plain) == 0o644
        assert _mode(tmp_path / "config.json") == 0o644 and _mode(tmp_path / "model.safetensors") == 0o644
        os.umask(0o027)
        atomic_write_text(tmp_path / "config.json", "{}")  # replacing keeps following the umask
        assert _mode(tmp_path / "config.json") == 0o640
    finally:
        os.umask(old)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
