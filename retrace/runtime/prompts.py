"""Prompt files: JSONL, one {"prompt": str, ...} or {"prompt_ids": [int, ...], ...} object per line."""

from __future__ import annotations

import json
from pathlib import Path

from retrace.cli_checks import is_text
from retrace.errors import RetraceError
from retrace.request_validation import MAX_PROMPT_CHARS

# a line longer than this cannot hold a prompt within MAX_PROMPT_CHARS (a JSON escape is at most 12 characters)
MAX_LINE_CHARS = 12 * MAX_PROMPT_CHARS + 4096


def read_prompts_jsonl(path: str | Path, max_chars: int = MAX_PROMPT_CHARS) -> list[dict]:
    """The objects of a prompt file; blank lines skipped; every error names the file and line. A prompt
    longer than max_chars characters is refused by its length, before anything parses or tokenizes it."""
    p = Path(path)
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "is not a regular file" if p.exists() else "not found"
        raise RetraceError(f"{p}: {what}; a prompts file is JSONL, one prompt object per line")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RetraceError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(line) > MAX_LINE_CHARS:
            raise RetraceError(f"{p}:{n}: a line of {len(line)} characters; a prompt may have at most {max_chars}")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RetraceError(f"{p}:{n}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not (isinstance(obj.get("prompt"), str) or "prompt_ids" in obj):
            raise RetraceError(f"{p}:{n}: each line needs a 'prompt' string or 'prompt_ids' list")
        if isinstance(obj.get("prompt"), str) and len(obj["prompt"]) > max_chars:
            raise RetraceError(f"{p}:{n}: the prompt has {len(obj['prompt'])} characters, at most {max_chars} "
                               "are allowed")
        if isinstance(obj.get("prompt"), str) and not is_text(obj["prompt"]):
            raise RetraceError(f"{p}:{n}: the prompt is not valid Unicode text (a lone surrogate such as \\ud800)")
        if "prompt_ids" in obj:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RetraceError(f"{p}:{n}: prompt_ids must be a list of integers")
        rows.append(obj)
    if not rows:
        raise RetraceError(f"{p}: no prompts")
    return rows
