"""Training data on disk: prompt JSONL, chat JSONL, Parquet, or a directory saved by `datasets`.

`read_rows(path)` -> list of dicts, from
- ``*.jsonl`` / ``*.json``: prompt JSONL goes through the one prompt reader (retrace.runtime.prompts);
  chat rows (a ``messages`` list) through ``datasets.load_dataset("json", ...)``;
- ``*.parquet``: ``datasets.load_dataset("parquet", ...)``;
- a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (its "train" split):
  ``datasets.load_from_disk``; a directory of ``*.parquet`` or ``*.jsonl`` files: all of them, in name order.

`chat_prompts(rows, target_dir)` renders each row's ``messages`` through the target tokenizer's chat
template with the generation prompt (``apply_chat_template(..., add_generation_prompt=True)``). The
assistant turns after the last user turn are dropped: the target regenerates them (as SpecForge does), so
the drafter learns the target's own distribution, not the dataset's. Earlier turns stay as context.
"""

from __future__ import annotations

import json
from pathlib import Path

from retrace.digest import sha256_named_files
from retrace.errors import RetraceError
from retrace.runtime.tokenizer import TextCodec
from retrace.train.common import split_validation

ROLES = ("system", "user", "assistant", "tool")


def _datasets():
    try:
        import datasets
    except ImportError:
        raise RetraceError("reading Parquet or `datasets` directories needs the `datasets` package: "
                           "pip install 'retrace[data]'") from None
    datasets.disable_progress_bars()
    return datasets


def _load(kind: str, files: list[str]) -> list[dict]:
    ds = _datasets()
    if kind == "parquet":  # datasets fails on a valid file of 0 rows ("cannot read"): say what it is
        files = [f for f in files if _parquet_rows(f) != 0]
        if not files:
            return []
    try:
        d = ds.load_dataset(kind, data_files=files, split="train", keep_in_memory=True)
    except Exception as e:  # noqa: BLE001 - datasets / pyarrow raise many exception types for bad files
        raise RetraceError(f"{files[0]}: cannot read as {kind} ({type(e).__name__}: {str(e)[:200]})") from None
    return d.to_list()


def _parquet_rows(path: str) -> int | None:
    """The row count in a Parquet file's footer (None when it is not readable as Parquet)."""
    try:
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - not Parquet: load_dataset then names the problem
        return None


def _is_saved_dataset(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()


def read_rows(path: str | Path) -> list[dict]:
    """The rows of a training data file or directory (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        raise RetraceError(f"{p}: training data not found")
    if p.is_dir():
        if _is_saved_dataset(p):
            ds = _datasets()
            try:
                d = ds.load_from_disk(str(p), keep_in_memory=True)
            except Exception as e:  # noqa: BLE001
                raise RetraceError(f"{p}: cannot load the saved dataset ({type(e).__name__}: {str(e)[:200]})") from None
            if isinstance(d, ds.DatasetDict):
                if "train" not in d:
                    raise RetraceError(f"{p}: the saved DatasetDict has no 'train' split (splits: {sorted(d)})")
                d = d["train"]
            rows = d.to_list()
        else:
            pq = sorted(str(f) for f in p.glob("*.parquet"))
            js = sorted(str(f) for f in p.glob("*.jsonl"))
            if not pq and not js:
                raise RetraceError(f"{p}: not a saved `datasets` directory and holds no *.parquet or *.jsonl files")
            rows = (_load("parquet", pq) if pq else []) + (_load("json", js) if js else [])
    elif p.suffix == ".parquet":
        rows = _load("parquet", [str(p)])
    else:
        rows = _read_json_lines(p)
    if not rows:
        raise RetraceError(f"{p}: no rows")
    return rows


def _read_json_lines(p: Path) -> list[dict]:
    from retrace.runtime.prompts import read_prompts_jsonl

    with p.open("rb") as f:
        first = f.readline()
    try:
        head = json.loads(first) if first.strip() else {}
    except ValueError:
        head = {}
    if isinstance(head, dict) and "messages" in head and "prompt" not in head and "prompt_ids" not in head:
        return _load("json", [str(p)])
    return read_prompts_jsonl(p)


def data_sha(path: str | Path) -> str:
    """Content hash of a data file, or of every file of a data directory (names and bytes)."""
    p = Path(path)
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    return sha256_named_files((str(f.relative_to(p) if p.is_dir() else f.name), f) for f in files)[:16]


def _conversation(row: dict, where: str) -> list[dict]:
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RetraceError(f"{where}: --chat needs a non-empty 'messages' list of {{'role', 'content'}} objects")
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise RetraceError(f"{where}: each message needs a role ({', '.join(ROLES)}) and a string content")
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=None)
    if last_user is None:
        raise RetraceError(f"{where}: the conversation has no user turn")
    return [{"role": m["role"], "content": m["content"]} for m in msgs[: last_user + 1]]


def chat_tokenizer(target_dir: str | Path):
    """The target's tokenizer with its chat template, or a RetraceError saying it has none."""
    d = Path(target_dir)
    if not (d / "tokenizer.json").is_file():
        raise RetraceError(f"{d}: --chat needs the target's tokenizer (tokenizer.json + tokenizer_config.json)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001
        raise RetraceError(f"{d}: cannot load the tokenizer ({type(e).__name__}: {str(e)[:200]})") from None
    if not getattr(tok, "chat_template", None):
        raise RetraceError(f"{d}: the tokenizer has no chat template (chat_template in tokenizer_config.json "
                           "or chat_template.jinja); --chat renders conversations with it")
    return tok


def chat_prompts(rows: list[dict], target_dir: str | Path, where: str = "--data") -> list[list[int]]:
    """Token ids of each conversation up to its last user turn, with the generation prompt."""
    if "messages" not in rows[0]:
        raise RetraceError(f"{where}: --chat needs a 'messages' column (columns: {sorted(rows[0])})")
    tok = chat_tokenizer(target_dir)
    out = []
    for n, r in enumerate(rows):
        conv = _conversation(r, f"{where}: row {n}")
        ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


def plain_prompts(rows: list[dict], codec, where: str = "--data") -> list[list[int]]:
    """Token ids of {'prompt': str} / {'prompt_ids': [...]} rows (Parquet / datasets rows checked here)."""
    if not any(k in rows[0] for k in ("prompt", "prompt_ids")):
        hint = "; pass --chat for a 'messages' column" if "messages" in rows[0] else ""
        raise RetraceError(f"{where}: needs a 'prompt' or 'prompt_ids' column (columns: {sorted(rows[0])}){hint}")
    out = []
    for n, r in enumerate(rows):
        if r.get("prompt_ids") is not None:
            ids = r["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RetraceError(f"{where}: row {n}: prompt_ids must be a list of integers")
            out.append([int(t) for t in ids])
        elif isinstance(r.get("prompt"), str):
            if codec is None:
                raise RetraceError("prompts are text but the target directory has no tokenizer.json")
            out.append(codec.encode(r["prompt"]))
        else:
            raise RetraceError(f"{where}: row {n} has neither a 'prompt' string nor 'prompt_ids'")
    return out


def prepare_prompts(target_dir, data: str | Path, max_prompt_len: int, num: int | None, val: int,
                    seed: int, chat: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """Read (JSONL, Parquet, a `datasets` directory; chat rows through the target's chat template with
    --chat), encode, left-truncate to max_prompt_len, take the first `num`, split (train, validation)."""
    rows = read_rows(data)
    if chat:
        ids = chat_prompts(rows, target_dir, str(data))
    else:
        ids = plain_prompts(rows, TextCodec.find(target_dir), str(data))
    kept = [p[-max_prompt_len:] for p in ids if p]
    if not kept:
        raise RetraceError(f"{data}: all {len(ids)} prompts are empty (no tokens); training needs non-empty prompts")
    ids = kept
    if num is not None:
        ids = ids[:num]
    tr, va = split_validation(len(ids), val, seed)
    return [ids[i] for i in tr], [ids[i] for i in va]


__all__ = ["read_rows", "prepare_prompts", "data_sha", "chat_prompts", "chat_tokenizer", "plain_prompts"]
