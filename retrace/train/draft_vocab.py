"""`retrace train draft-vocab`: a draft vocabulary (retrace.models.draft_vocab) computed from responses and
written into the drafter directory (both files atomically; a drafter's weights are not touched, so this
applies post hoc to any drafter, e.g. the zoo's, whose head is the target's table).

Responses: the target's own continuations of --data prompts (greedy: what the drafter is trained on; a
sampling workload wants --temperature 1, since the tokens a target samples reach beyond its greedy ones), or a
given file: the DFlash trainer's cache (DRAFTER/train_data/responses.json, {"responses": [[ids], ...]}) or
JSONL rows {"response_ids": [...]}. The subset: the most frequent ids (plus the target's EOS ids), `size`
of them or the fewest that cover `coverage` of the counted tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

from retrace.errors import RetraceError
from retrace.models.draft_vocab import DraftVocab, count_tokens, from_counts


def read_responses(path: str | Path) -> list[list[int]]:
    p = Path(path)
    if not p.is_file():
        raise RetraceError(f"{p}: responses file not found")
    text = p.read_text()
    try:
        if p.suffix == ".jsonl":
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
            seqs = [r["response_ids"] for r in rows]
        else:
            seqs = json.loads(text)["responses"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise RetraceError(f"{p}: expected JSON {{\"responses\": [[ids], ...]}} or JSONL rows {{\"response_ids\": "
                           f"[...]}} ({type(e).__name__}: {e})") from None
    if not isinstance(seqs, list) or not all(isinstance(s, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                         for t in s) for s in seqs):
        raise RetraceError(f"{p}: every response must be a list of integer token ids")
    return seqs


def target_responses(target_dir: Path, data: Path, max_new_tokens: int, num_prompts: int | None,
                     max_prompt_len: int, batch: int, temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    from retrace.models.target import Qwen3Target
    from retrace.runtime.tokenizer import TextCodec
    from retrace.train.datasets_io import plain_prompts, read_rows
    from retrace.train.rollout import generate

    rows = read_rows(data)[:num_prompts]
    if not rows:
        raise RetraceError(f"{data}: no prompts")
    prompts = [p[-max_prompt_len:] for p in plain_prompts(rows, TextCodec.find(target_dir))]
    target = Qwen3Target.from_pretrained(target_dir, tap_layers=())
    return generate(target, prompts, max_new_tokens, batch, temperature=temperature, seed=seed)


def make_draft_vocab(target_dir: str | Path, drafter_dir: str | Path, *, data: str | Path | None = None,
                     responses: str | Path | None = None, size: int | None = None, coverage: float | None = None,
                     max_new_tokens: int = 128, num_prompts: int | None = None, max_prompt_len: int = 256,
                     batch: int = 32, temperature: float = 0.0, seed: int = 0) -> DraftVocab:
    """Compute the draft vocabulary and write it into drafter_dir (see the module docstring)."""
    from retrace.models.config import DrafterConfig, Qwen3Config

    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    tcfg = Qwen3Config.from_dir(target_dir)
    DrafterConfig.from_dir(drafter_dir).check_fits(tcfg, drafter_dir / "config.json")
    if (data is None) == (responses is None):
        raise RetraceError("give exactly one of --data (prompts: the target generates the responses) and --responses")
    if (size is None) == (coverage is None):
        raise RetraceError("give exactly one of --size and --coverage")
    if size is not None and not 1 <= size <= tcfg.vocab_size:
        raise RetraceError(f"--size {size} must be in 1..{tcfg.vocab_size} (the target vocab)")
    if coverage is not None and not 0 < coverage <= 1:
        raise RetraceError(f"--coverage {coverage} must be in (0, 1]")
    if responses is not None:
        seqs, source = read_responses(responses), {"responses": str(Path(responses).resolve())}
    else:
        if temperature < 0:
            raise RetraceError(f"--temperature {temperature} must be >= 0")
        seqs = target_responses(target_dir, Path(data), max_new_tokens, num_prompts, max_prompt_len, batch,
                                temperature, seed)
        source = {"prompts": str(Path(data).resolve()), "max_new_tokens": max_new_tokens,
                  "temperature": temperature}
    counts = count_tokens(seqs, tcfg.vocab_size)
    if not int(counts.sum()):
        raise RetraceError("the responses hold no tokens")
    vocab = from_counts(counts, size=size, coverage=coverage, always=tcfg.eos_token_ids,
                        meta={"source": source, "responses": len(seqs),
                              "asked": {"size": size} if size is not None else {"coverage": coverage}})
    vocab.save(drafter_dir)
    return vocab
