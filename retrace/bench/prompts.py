"""Benchmark prompts: JSONL files (``{"prompt", "domain"}`` or ``{"prompt_ids", "domain"}``) -> token ids.

Every system is fed the same token ids (encoded once with the target's ``tokenizer.json``), so no peer's
own tokenizer or chat template can change what is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from retrace.errors import RetraceError
from retrace.runtime.prompts import read_prompts_jsonl


@dataclass
class BenchPrompt:
    ids: list[int]
    domain: str
    source: str  # "file:line"
    truncated: int = 0  # tokens dropped from the front to fit the context window


def _files(paths: list[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(p.glob("*.jsonl"))
            if not found:
                raise RetraceError(f"{p}: no *.jsonl prompt files in this directory")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise RetraceError(f"{p}: prompts file not found")
    return out


def _read(path: Path, codec) -> list[BenchPrompt]:
    rows: list[BenchPrompt] = []
    for n, obj in enumerate(read_prompts_jsonl(path), 1):
        domain = str(obj.get("domain") or path.stem)
        if "prompt_ids" in obj:
            ids = list(obj["prompt_ids"])
        else:
            if codec is None:
                raise RetraceError(f"{path}: prompt {n} is text but the target has no tokenizer.json "
                                   "(give 'prompt_ids' instead)")
            ids = codec.encode(obj["prompt"])
        if not ids:
            raise RetraceError(f"{path}: prompt {n} is empty")
        rows.append(BenchPrompt(ids, domain, f"{path.name}:{n}"))
    return rows


def load_prompts(paths: list[str | Path], codec, limit: int | None = None, vocab_size: int | None = None,
                 max_prompt_tokens: int | None = None) -> list[BenchPrompt]:
    """Read prompt files (or directories of *.jsonl), interleaved round-robin across files so that
    `limit` keeps the domains balanced; prompts longer than `max_prompt_tokens` keep their last tokens."""
    per_file = [_read(f, codec) for f in _files(paths)]
    merged: list[BenchPrompt] = []
    i = 0
    while any(i < len(rows) for rows in per_file):
        merged.extend(rows[i] for rows in per_file if i < len(rows))
        i += 1
    if limit is not None:
        if limit <= 0:
            raise RetraceError(f"--limit must be positive, got {limit}")
        merged = merged[:limit]
    if not merged:
        raise RetraceError("no prompts")
    for p in merged:
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in p.ids):
            raise RetraceError(f"{p.source}: prompt token ids must be in [0, {vocab_size})")
        if max_prompt_tokens is not None and len(p.ids) > max_prompt_tokens:
            p.truncated = len(p.ids) - max_prompt_tokens
            p.ids = p.ids[-max_prompt_tokens:]
    return merged
