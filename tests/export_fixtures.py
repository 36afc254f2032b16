"""A tiny model pair and its engine bundle, built ONCE per test session (shared by tests/test_export_*.py
and tests/test_engine_*.py: exporting costs ~5-10 s per graph, so every test reuses this build).

Built once per test run, shared by pytest-xdist's workers (tests/run_shared.py).

`pair_and_bundle()` -> Built(target, drafter, bundle, build_output, prompts): a random 2-layer Qwen3 target with
a word-level tokenizer and EOS-free generation, a random 1-layer drafter (block 8) with a random non-zero
ReTrace conditioner, and `retrace-export build` run through click's CliRunner on them (so the CLI
itself is exercised). Tests must not modify `bundle`; copy it (`copy_bundle`) to tamper with it.
"""

from __future__ import annotations

import functools
import shutil
from dataclasses import dataclass
from pathlib import Path

from run_shared import shared_build

VOCAB = 96
BLOCK = 8
MAX_SEQ = 160
MAX_BATCH = 4


@dataclass(frozen=True)
class Built:
    root: Path
    target: Path
    drafter: Path
    bundle: Path
    build_output: str


def cli_build(target: Path, drafter: Path | None, out: Path, max_batch: int, max_seq_len: int, *extra: str) -> str:
    """`retrace-export build` through click's CliRunner (the CLI itself is exercised); raises with the CLI's
    output unless it succeeds, and returns that output."""
    from click.testing import CliRunner

    from retrace.export.cli import main

    args = ["build", "--target", str(target), *(["--drafter", str(drafter)] if drafter is not None else []),
            "--out", str(out), "--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len), *extra]
    res = CliRunner().invoke(main, args)
    if res.exit_code != 0:
        raise RuntimeError(f"retrace-export build failed ({res.exit_code}):\n{res.output}\n{res.exception!r}")
    return res.output


@functools.cache
def pair_and_bundle() -> Built:
    root, record = shared_build("export-pair-and-bundle", _build_pair_and_bundle)
    return Built(root, root / "target", root / "drafter", root / "bundle", record["output"])


def _build_pair_and_bundle(root: Path) -> dict:
    from runtime_fixtures import write_pair

    target, drafter = write_pair(root, vocab=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96,
                                 block_size=BLOCK, conditioner="random", seed=3)
    assert (target, drafter) == (root / "target", root / "drafter")
    return {"output": cli_build(target, drafter, root / "bundle", MAX_BATCH, MAX_SEQ)}


def copy_bundle(dst: Path) -> Path:
    """A private copy of the session bundle (to tamper with or replace)."""
    shutil.copytree(pair_and_bundle().bundle, dst)
    return dst
