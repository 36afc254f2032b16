"""Builders shared by the runtime tests (tests/test_runtime_*.py).

- `write_word_tokenizer`: a tiny `tokenizers` word-level tokenizer.json (one word per token id), so
  targets get text, stop strings and `--prompt` without any download.
- `hf_greedy`: the reference, transformers' own `Qwen3ForCausalLM.generate(do_sample=False)` on the target.
- `OracleDrafter`: a Backend wrapper whose drafts are right (the target's true greedy token) up to a
  random rejection slot each round, wrong there, and mixed after it, so that every acceptance length
  0..B-1 occurs; the real drafter still runs (its K/V cache, hidden states and, in retrace mode, the
  conditioner on the real suffix memory are all exercised).
- `PoisonedRows`: a Backend wrapper that makes the target's logits NaN for the requests whose prompt starts
  with a marker token (a row whose distribution cannot be sampled, whatever its parameters); every other
  row is the real backend's.
- `single_thread`: tiny models on a shared 2-core machine run far faster (and steadier) on one thread.
"""

from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path

import torch
from helpers import load_hf_target, patch_json

WORD = "t{}x"  # token i <-> the word "t<i>x": stop strings can start and end inside words


def write_word_tokenizer(directory: str | Path, vocab: int) -> Path:
    """tokenizer.json with a WordLevel model over the words t0x .. t{vocab-1}x (whitespace-separated)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {WORD.format(i): i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=WORD.format(0)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(directory) / "tokenizer.json"
    tok.save(str(path))
    return path


def words(ids) -> str:
    return " ".join(WORD.format(int(i)) for i in ids)


def copy_with_eos(target_dir: Path, out_dir: Path, eos: int) -> Path:
    """A copy of a target directory whose config (and generation config) declare `eos` as EOS."""
    shutil.copytree(target_dir, out_dir)
    patch_json(out_dir / "config.json", eos_token_id=eos)
    gen = out_dir / "generation_config.json"
    if gen.is_file():
        patch_json(gen, eos_token_id=eos)
    return out_dir


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """transformers' greedy continuation of one prompt (new tokens only; stops right after `eos`)."""
    ids = torch.tensor([prompt])
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, min_new_tokens=0,
        do_sample=False, eos_token_id=eos, pad_token_id=0 if eos is None else eos,
        temperature=None, top_p=None, top_k=None,
    )
    return out[0, len(prompt):].tolist()


@contextlib.contextmanager
def single_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class PoisonedRows:
    """Wraps a Backend: the target's logits are NaN in the slot of a request whose prompt starts with `marker`
    from its (after+1)-th target call on (0: its prefill; 2: its second verify), until that slot is
    released; everything else is the real backend's. `poisoned_calls` counts the NaN rows it returned."""

    def __init__(self, inner, marker: int, after: int = 0):
        self.inner, self.marker, self.after = inner, marker, after
        self.calls: dict[int, int] = {}  # marked slot -> target calls so far
        self.poisoned_calls = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def target(self, slots, input_ids, positions, logits_index, **tree):
        logits, taps = self.inner.target(slots, input_ids, positions, logits_index, **tree)
        rows = []
        for n, s in enumerate(slots.tolist()):
            if int(positions[n, 0]) == 0 and int(input_ids[n, 0]) == self.marker:
                self.calls[s] = 0
            if s in self.calls:
                self.calls[s] += 1
                if self.calls[s] > self.after:
                    rows.append(n)
        if rows:
            self.poisoned_calls += len(rows)
            logits = logits.clone()
            logits[rows] = float("nan")
        return logits, taps

    def release(self, slot: int) -> None:
        self.calls.pop(slot, None)
        self.inner.release(slot)


class OracleDrafter:
    """Wraps a Backend: draft() returns logits that favour the target's true greedy continuation at some
    slots and garbage at others. `sequences` maps prompt tuple -> prompt + greedy continuation (long
    enough to cover every block position that can be drafted)."""

    def __init__(self, inner, sequences: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.inner = inner
        self.name = f"oracle({inner.name})"
        self.target_config = inner.target_config
        self.drafter_config = inner.drafter_config
        self.max_batch = inner.max_batch
        self.max_seq_len = inner.max_seq_len
        self.has_conditioner = inner.has_conditioner
        self.sequences = sequences
        self.rng = random.Random(seed)
        self.slot_seq: dict[int, list[int]] = {}
        self.suffix_valid_slots = 0  # memory slots fed to the conditioner (retrace mode)
        self.rejection_slots: list[int] = []
        self._cycle: list[int] = []

    def target(self, slots, input_ids, positions, logits_index, **tree):
        if bool((positions[:, 0] == 0).all()):  # prefill: learn which prompt lives in which slot
            for n, s in enumerate(slots.tolist()):
                prompt = tuple(input_ids[n, : int(logits_index[n, 0]) + 1].tolist())
                self.slot_seq[s] = self.sequences[prompt]
        return self.inner.target(slots, input_ids, positions, logits_index, **tree)

    def commit_path(self, slots, src_index, dst_pos):
        self.inner.commit_path(slots, src_index, dst_pos)

    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        if suffix is not None:
            self.suffix_valid_slots += int(suffix.valid.sum())
        hidden, logits = self.inner.draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)
        logits = logits.clone()
        N, B = block_ids.shape
        V = logits.shape[-1]
        for n, s in enumerate(slots.tolist()):
            seq = self.slot_seq[s]
            if not self._cycle:  # first wrong slot, every value 1..B once per B draws (B = all right)
                self._cycle = list(range(1, B + 1))
                self.rng.shuffle(self._cycle)
            reject = self._cycle.pop()
            self.rejection_slots.append(reject)
            for k in range(1, B):
                pos = int(block_positions[n, k])
                true = seq[pos] if pos < len(seq) else None
                # before the rejection: right; at it: wrong; after it: right, wrong or the real drafter's
                kind = "right" if k < reject else "wrong" if k == reject else self.rng.choice(
                    ["right", "wrong", "real"])
                if kind == "right" and true is not None:
                    tok = true
                elif kind == "real":
                    continue  # the real (conditioned) drafter's logits
                else:
                    tok = self.rng.randrange(V - 1)  # never the mask id (V - 1)
                    if tok == true:
                        tok = (tok + 1) % (V - 1)
                logits[n, k - 1] = -10.0
                logits[n, k - 1, tok] = 10.0
        return hidden, logits

    def release(self, slot: int) -> None:
        self.slot_seq.pop(slot, None)
        self.inner.release(slot)


def write_pair(root: Path, *, vocab=128, hidden=64, layers=4, heads=4, kv_heads=2, intermediate=96,
               block_size=16, draft_layers=1, conditioner="random", tokenizer=True, seed=0) -> tuple[Path, Path]:
    """A random target (+ word tokenizer) and a random drafter with a random (non-zero) conditioner."""
    from helpers import write_drafter, write_target

    target = write_target(root / "target", vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                          kv_heads=kv_heads, intermediate=intermediate, seed=seed)
    if tokenizer:
        write_word_tokenizer(target, vocab)
    drafter = write_drafter(root / "drafter", target, layers=draft_layers, block_size=block_size,
                            conditioner=conditioner, seed=seed + 1)
    return target, drafter


__all__ = ["OracleDrafter", "copy_with_eos", "hf_greedy", "load_hf_target", "single_thread", "words",
           "write_pair", "write_word_tokenizer", "WORD"]


class LinearCost:
    """A fixed cost model for deterministic verify-policy decisions: a verify of T tokens per row costs
    rows * (1 + slope * (T - 1)), a draft rows * draft."""

    def __init__(self, slope: float, draft: float):
        self.slope, self.draft_cost = slope, draft

    def verify(self, rows: int, tokens: int) -> float:
        return rows * (1 + self.slope * (tokens - 1))

    def draft(self, rows: int, slots: int = 0) -> float:  # the same at every draft width
        return rows * self.draft_cost

    def to_dict(self) -> dict:
        return {"slope": self.slope, "draft": self.draft_cost}


def steep_cost_policy(block_size: int, ragged: bool = False, slope: float = 0.15, draft: float = 0.02):
    """An adaptive verify policy whose decisions depend only on the drafter's confidences and the rounds'
    outcomes (no wall-clock time): verifying gets expensive fast, so K varies between 0 and B-1."""
    from retrace.runtime.verify_policy import AdaptivePolicy

    return AdaptivePolicy(block_size, LinearCost(slope, draft), ragged=ragged, learn_cost=False)


def call_both(ref, new, slots, ids, pos, li, tree=None):
    """One target call on two backends (same caches so far): the same logits (relative 1e-5), taps, argmax."""
    a = ref.target(slots, ids, pos, li, tree)
    b = new.target(slots, ids, pos, li, tree)
    rel = ((a[0] - b[0]).abs().max() / a[0].abs().max()).item()
    assert rel < 1e-5 and torch.allclose(a[1], b[1], atol=1e-4), (slots, rel)
    assert torch.equal(a[0].argmax(-1), b[0].argmax(-1))
