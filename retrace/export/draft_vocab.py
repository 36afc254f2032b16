"""The drafter's draft vocabulary in an engine bundle: its two files copied to BUNDLE/draft_vocab/ (hashed
with the rest), listed in the manifest as models.drafter.draft_vocab with its size and coverage. The
drafter graph keeps the target's full head; the ONNX Runtime backend slices the subset's rows from the
target's table when it loads the bundle (retrace.runtime.onnxruntime_backend), so no copy of them is stored."""

from __future__ import annotations

import shutil
from pathlib import Path

from retrace.models.draft_vocab import META, TENSORS, DraftVocab

FOLDER = "draft_vocab"


def copy_draft_vocab(drafter_dir: Path, staging: Path, vocab_size: int) -> dict | None:
    """Copy a validated draft vocabulary into the staged bundle -> its manifest entry (None without one)."""
    vocab = DraftVocab.load(drafter_dir, vocab_size)
    if vocab is None:
        return None
    (staging / FOLDER).mkdir(parents=True, exist_ok=True)
    for name in (TENSORS, META):
        shutil.copy2(drafter_dir / name, staging / FOLDER / name)
    return {"dir": FOLDER, "draft_vocab_size": vocab.size, "coverage": vocab.coverage,
            "source": vocab.meta.get("source")}
