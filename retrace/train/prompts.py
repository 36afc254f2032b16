"""Prompt sets for the tiny model zoo, made offline and deterministically from a seed.

Files (one JSON object per line; ``prompt`` and ``domain`` are the contract, the other keys are
provenance):

- ``prompts/code.jsonl``: the beginning of a function or class (decorators included, indentation kept)
  from the HELD-OUT stdlib files, 64-200 tokens.
- ``prompts/docs.jsonl``: English technical prose: passages of the language-reference topics in
  ``pydoc_data/topics.py`` (excluded from training, so all held out), starting at a paragraph, 64-200
  tokens.  Falls back to held-out docstrings if ``pydoc_data`` is missing.
- ``data/train_prompts.jsonl``: windows of TRAIN-split code starting at a random line, 32-128 tokens, for
  drafter distillation (the target writes the continuations).

Every prompt ends at the end of a non-blank line WITHOUT the newline (see :func:`cut_at_tokens`).
Keys: ``{"id", "prompt", "domain", "source", "n_tokens"}``; ``n_tokens`` is the length under the zoo
tokenizer.  No prompt contains a special-token string.
"""

from __future__ import annotations

import ast
import bisect
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

from .corpus import SourceFile
from .tokenizer import SPECIAL_TOKENS

PROMPTS_VERSION = 2  # bump when the prompt files change for the same seed and tokenizer
CODE_TOKENS = (64, 200)
DOCS_TOKENS = (64, 200)
TRAIN_TOKENS = (32, 128)


def _raw(tok):
    return getattr(tok, "backend_tokenizer", tok)


def _n_tokens(tok, text: str) -> int:
    return len(_raw(tok).encode(text, add_special_tokens=False).ids)


def _clean(text: str) -> bool:
    return not any(s in text for s in SPECIAL_TOKENS)


def _line_end_before(text: str, end: int) -> int:
    """Index of the last newline before ``end`` that ends a non-blank line (whitespace-free end), or -1."""
    cut = text.rfind("\n", 0, end)
    while cut > 0 and text[cut - 1].isspace():
        cut = text.rfind("\n", 0, cut)
    return cut if cut > 0 else -1


def cut_at_tokens(tok, text: str, lo: int, hi: int, target: int) -> str | None:
    """The longest prefix of ``text`` that ends at the end of a non-blank line, newline EXCLUDED, with at most
    ``target`` tokens; None if that has fewer than ``lo`` tokens.  ``target`` is clipped to [lo, hi].

    Why the newline is left out: the byte-level pre-tokeniser merges a newline with the indentation that
    follows it ("\n" + 8 spaces is one pre-token), so a prompt ending in a bare "\n" ends in a token that
    training almost only saw before unindented code, and greedy continuations jump to a new top-level
    statement.  Ending before the newline puts the cut on a pre-token boundary: the prompt's tokens are a
    prefix of the source's tokens and the next token is the natural "\n" + indentation.
    """
    target = max(lo, min(hi, target))
    enc = _raw(tok).encode(text, add_special_tokens=False)
    end = len(text) if len(enc.ids) <= target else enc.offsets[target][0]
    if end >= len(text) and not text.endswith("\n"):
        text = text + "\n"  # the whole text fits: treat its end as a line end
        end = len(text)
    cut = _line_end_before(text, end)
    if cut < 0:
        return None
    prefix = text[:cut]
    n = _n_tokens(tok, prefix)
    while n > hi:  # re-tokenisation at the new end may differ slightly; trim whole lines
        cut = _line_end_before(prefix, len(prefix))
        if cut < 0:
            return None
        prefix = prefix[:cut]
        n = _n_tokens(tok, prefix)
    if n < lo or not prefix.strip():
        return None
    return prefix


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for i, ch in enumerate(text):
        if ch == "\n":
            starts.append(i + 1)
    return starts


# ------------------------------------------------------------------------------------------------ code


def def_starts(f: SourceFile) -> list[tuple[int, int, str]]:
    """(start_char, end_char, qualname-ish) of every function/class in a file, decorators included."""
    try:
        tree = ast.parse(f.text)
    except SyntaxError:
        return []
    starts = _line_starts(f.text)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            last = node.end_lineno or node.lineno
            a = starts[first - 1]
            b = starts[last] if last < len(starts) else len(f.text)
            out.append((a, b, node.name))
    out.sort()
    return out


def code_prompts(
    files: Sequence[SourceFile], tok, n: int = 128, seed: int = 0, lo_hi=CODE_TOKENS
) -> list[dict]:
    """``n`` prompts, each the start of a function/class in ``files`` (spread over files, seeded)."""
    lo, hi = lo_hi
    rng = random.Random(f"retrace-zoo/code/{seed}")
    per_file: list[list[tuple[SourceFile, int, int, str]]] = []
    for f in sorted(files, key=lambda f: f.relpath):
        cands = [(f, a, b, name) for a, b, name in def_starts(f)]
        rng.shuffle(cands)
        if cands:
            per_file.append(cands)
    rng.shuffle(per_file)
    out: list[dict] = []
    seen: set[str] = set()
    # round-robin over files so that a few big files do not supply every prompt
    while len(out) < n and any(per_file):
        for cands in per_file:
            if len(out) >= n:
                break
            while cands:
                f, a, b, name = cands.pop()
                text = f.text[a:b]
                prompt = cut_at_tokens(tok, text, lo, hi, rng.randint(lo, hi))
                if prompt is None or prompt in seen or not _clean(prompt):
                    continue
                seen.add(prompt)
                line = f.text.count("\n", 0, a) + 1
                out.append(
                    {
                        "id": f"code-{len(out):04d}",
                        "prompt": prompt,
                        "domain": "code",
                        "source": f"{f.relpath}:{line}:{name}",
                        "n_tokens": _n_tokens(tok, prompt),
                    }
                )
                break
    return out


# ------------------------------------------------------------------------------------------------ docs


def _paragraph_starts(text: str) -> list[int]:
    out = [0]
    i = text.find("\n\n")
    while i >= 0:
        j = i + 2
        while j < len(text) and text[j] == "\n":
            j += 1
        if j < len(text) and not text[j].isspace():  # a prose paragraph, not an indented code sample
            out.append(j)
        i = text.find("\n\n", j)
    return out


def docs_prompts(
    topics: dict[str, str],
    tok,
    n: int = 128,
    seed: int = 0,
    lo_hi=DOCS_TOKENS,
    fallback_files: Sequence[SourceFile] = (),
) -> list[dict]:
    """``n`` prose prompts from pydoc topics (or, if empty, from docstrings of ``fallback_files``)."""
    lo, hi = lo_hi
    rng = random.Random(f"retrace-zoo/docs/{seed}")
    sources: list[tuple[str, str]] = sorted(topics.items())
    if not sources:
        sources = _docstrings(fallback_files)
    pools = []
    for name, text in sources:
        starts = _paragraph_starts(text)
        rng.shuffle(starts)
        pools.append([(name, text, s) for s in starts])
    rng.shuffle(pools)
    out: list[dict] = []
    seen: set[str] = set()
    while len(out) < n and any(pools):
        for pool in pools:
            if len(out) >= n:
                break
            while pool:
                name, text, s = pool.pop()
                prompt = cut_at_tokens(tok, text[s : s + 40 * hi], lo, hi, rng.randint(lo, hi))
                if prompt is None or prompt in seen or not _clean(prompt):
                    continue
                seen.add(prompt)
                out.append(
                    {
                        "id": f"docs-{len(out):04d}",
                        "prompt": prompt,
                        "domain": "docs",
                        "source": f"{name}@{s}",
                        "n_tokens": _n_tokens(tok, prompt),
                    }
                )
                break
    return out


def _docstrings(files: Iterable[SourceFile]) -> list[tuple[str, str]]:
    out = []
    for f in files:
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc and len(doc) > 400:
                    out.append((f"{f.relpath}:{getattr(node, 'name', '<module>')}", doc + "\n"))
    return sorted(out)


# ------------------------------------------------------------------------------------------------ train


def train_prompts(
    files: Sequence[SourceFile], tok, n: int = 4096, seed: int = 0, lo_hi=TRAIN_TOKENS
) -> list[dict]:
    """``n`` distinct windows of train code, each starting at a random line (files weighted by length)."""
    lo, hi = lo_hi
    rng = random.Random(f"retrace-zoo/train/{seed}")
    files = sorted(files, key=lambda f: f.relpath)
    if not files:
        return []
    cum = []
    total = 0
    for f in files:
        total += len(f.text)
        cum.append(total)
    line_starts = {}
    out: list[dict] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n and attempts < 20 * n:
        attempts += 1
        fi = bisect.bisect_right(cum, rng.randrange(total))
        f = files[fi]
        if fi not in line_starts:
            line_starts[fi] = _line_starts(f.text)
        starts = line_starts[fi]
        li = rng.randrange(len(starts))
        a = starts[li]
        if not f.text[a : a + 200].strip():
            continue
        prompt = cut_at_tokens(tok, f.text[a : a + 12 * hi], lo, hi, rng.randint(lo, hi))
        if prompt is None or prompt in seen or not _clean(prompt):
            continue
        seen.add(prompt)
        out.append(
            {
                "id": f"train-{len(out):05d}",
                "prompt": prompt,
                "domain": "code",
                "source": f"{f.relpath}:{li + 1}",
                "n_tokens": _n_tokens(tok, prompt),
            }
        )
    return out


# ------------------------------------------------------------------------------------------------ io


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> int:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    k = 0
    with path.open("w", encoding="utf-8", newline="\n") as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
            k += 1
    return k


def read_jsonl(path: str | Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_chat_jsonl(src: str | Path, dst: str | Path) -> Path:
    """The prompts of a prompt JSONL as one-turn conversations ({"messages": [{"role": "user", ...}]}): the
    zoo trains through `--chat` (retrace.train.datasets_io) with its tokenizer's minimal chat template."""
    rows = [json.loads(line) for line in Path(src).read_text(encoding="utf-8").splitlines() if line.strip()]
    write_jsonl(dst, ({"messages": [{"role": "user", "content": r["prompt"]}]} for r in rows))
    return Path(dst)
