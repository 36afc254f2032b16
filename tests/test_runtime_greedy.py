"""Greedy (T=0) losslessness of the runtime: `dflash` and `retrace` equal `ar` equal transformers.

The reference is transformers' `Qwen3ForCausalLM.generate(do_sample=False)` on the target alone, one
prompt at a time. Checked for batch sizes 1, 3 and 8 with ragged prompts, block sizes 4, 8 and 16, a
random (untrained) drafter with a random non-zero conditioner, 64 new tokens; EOS and stop strings; and
with an oracle drafter that IS accepted (every acceptance length 0..B-1 occurs), which exercises the
accept / commit / ragged-acceptance / cache-crop paths that a random drafter almost never reaches.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from runtime_fixtures import (
    OracleDrafter,
    copy_with_eos,
    hf_greedy,
    load_hf_target,
    steep_cost_policy,
    words,
    write_pair,
)

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.torch_backend import TorchBackend

MAX_NEW = 64
VOCAB = 128
PROMPT_LENS = [6, 1, 13, 3, 21, 8, 2, 10]  # batch n uses the first n (batch 1: a 6-token prompt)
REF_LEN = MAX_NEW + 16 + 2  # greedy reference long enough for every position a block can reach


@dataclass
class World:
    target: Path
    drafter: Path
    prompts: list[list[int]]
    greedy: list[list[int]]  # HF greedy continuation of each prompt (new tokens only, REF_LEN of them)
    hf: object

    def sequences(self) -> dict[tuple[int, ...], list[int]]:
        return {tuple(p): p + g for p, g in zip(self.prompts, self.greedy, strict=True)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread) -> World:
    root = tmp_path_factory.mktemp("greedy")
    target, drafter = write_pair(root, vocab=VOCAB, block_size=16, conditioner="random", seed=1)
    hf = load_hf_target(target)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in PROMPT_LENS]
    greedy = [hf_greedy(hf, p, REF_LEN) for p in prompts]
    return World(target, drafter, prompts, greedy, hf)


def runtime(w: World, block: int | None = None, oracle: bool = False, target: Path | None = None,
            max_batch: int = 8, policy="adaptive") -> Runtime:
    be = TorchBackend.from_dirs(target or w.target, w.drafter, max_batch=max_batch, max_seq_len=128)
    if oracle:
        be = OracleDrafter(be, w.sequences(), seed=block or 0)
    return Runtime(be, TextCodec.find(target or w.target), block_size=block, verify_policy=policy)


def check_exact(results, expected: list[list[int]], label: str) -> None:
    for i, (r, want) in enumerate(zip(results, expected, strict=True)):
        got = r.token_ids
        if got != want:
            n = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            pytest.fail(f"{label}, prompt {i}: first difference at new token {n}: got {got[n:n + 8]}, "
                        f"want {want[n:n + 8]} (lengths {len(got)} vs {len(want)})")


# -- random drafter, random conditioner --------------------------------------------------------------------
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_ar_equals_transformers(world, batch):
    rt = runtime(world)
    res = rt.generate(world.prompts[:batch], SamplingParams(max_new_tokens=MAX_NEW), "ar")
    check_exact(res, [g[:MAX_NEW] for g in world.greedy[:batch]], f"ar batch {batch}")
    assert all(r.finish_reason == "length" for r in res)


@pytest.mark.parametrize("block", [4, 8, 16])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_speculative_equals_transformers(world, batch, block):
    rt = runtime(world, block)
    want = [g[:MAX_NEW] for g in world.greedy[:batch]]
    for mode in ("dflash", "retrace"):
        res = rt.generate(world.prompts[:batch], SamplingParams(max_new_tokens=MAX_NEW), mode)
        check_exact(res, want, f"{mode} batch {batch} block {block}")
        assert all(r.finish_reason == "length" and r.stats["tau"] >= 1 for r in res)


# -- a drafter that is accepted --------------------------------------------------------------------------
@pytest.mark.parametrize("block", [4, 8, 16])
def test_accepted_drafts_stay_exact(world, block):
    """Oracle drafts: acceptance lengths 0..B-1 all occur, tau > 1, and outputs are still exact."""
    want = [g[:MAX_NEW] for g in world.greedy]
    for mode in ("dflash", "retrace"):
        rt = runtime(world, block, oracle=True, policy="fixed")
        res = rt.generate(world.prompts, SamplingParams(max_new_tokens=MAX_NEW), mode)
        check_exact(res, want, f"oracle {mode} block {block}")
        stats = rt.run_stats()
        hist = stats["accepted_hist"]
        assert len(hist) == block and all(n > 0 for n in hist), f"acceptance lengths seen: {hist}"
        assert stats["tau"] > 1.5
        if mode == "retrace":  # the conditioner was fed real memory (and round 1 had none)
            assert rt.backend.suffix_valid_slots > 0


def test_requests_leave_and_join_with_accepted_drafts(world):
    """max_batch 3 < 8 prompts: finished requests free slots that new ones (with a fresh, empty suffix
    memory and shorter context) reuse mid-run; every output stays exact."""
    rt = runtime(world, 8, oracle=True, max_batch=3)
    res = rt.generate(world.prompts, SamplingParams(max_new_tokens=MAX_NEW), "retrace")
    check_exact(res, [g[:MAX_NEW] for g in world.greedy], "oracle retrace, 8 requests in 3 slots")


# -- EOS ---------------------------------------------------------------------------------------------------
def first_new_token(seq: list[int], lo: int) -> tuple[int, int]:
    """(index, token) of the first token at index >= lo that does not occur earlier in seq."""
    for i in range(lo, len(seq)):
        if seq[i] not in seq[:i]:
            return i, seq[i]
    raise AssertionError("no fresh token in the greedy continuation")


@pytest.mark.parametrize("oracle", [False, True], ids=["random-drafter", "oracle-drafter"])
def test_eos_stops_right_after_it_like_transformers(world, tmp_path, oracle):
    # prompt 5's greedy continuation hits this token first at new-token index >= 20
    at, eos = first_new_token(world.greedy[5], 20)
    target = copy_with_eos(world.target, tmp_path / "target-eos", eos)
    want = [hf_greedy(world.hf, p, MAX_NEW, eos=eos) for p in world.prompts]
    assert len(want[5]) == at + 1 and want[5][-1] == eos
    for mode in ("ar", "dflash", "retrace"):
        rt = runtime(world, 8, oracle=oracle, target=target)
        res = rt.generate(world.prompts, SamplingParams(max_new_tokens=MAX_NEW), mode)
        check_exact(res, want, f"{mode} with eos {eos}")
        for r, w in zip(res, want, strict=True):
            assert r.finish_reason == ("stop" if w[-1] == eos else "length")
    # ignore_eos runs on to max_new_tokens, still exact
    rt = runtime(world, 8, oracle=oracle, target=target)
    res = rt.generate(world.prompts[5:6], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True), "retrace")
    check_exact(res, [world.greedy[5][:MAX_NEW]], "retrace ignore_eos")


# -- stop strings ------------------------------------------------------------------------------------------
def stop_cases(world) -> list[tuple[str, int]]:
    """Stop strings found in prompt 0's greedy text, each with the new-token count at which it completes.
    They start and end inside words ("t5x t17x" -> "5x t1"), and one spans three words."""
    seq = world.greedy[0][:MAX_NEW]
    text = words(seq)
    out = []
    for lo, n in ((9, 2), (25, 3), (40, 1)):
        piece = words(seq[lo:lo + n])
        s = piece[1:-1] if n > 1 else piece[1:]
        first = text.find(s)
        # the token that completes the first occurrence
        done = next(m for m in range(1, len(seq) + 1) if s in words(seq[:m]))
        out.append((s, done))
        assert first >= 0
    return out


@pytest.mark.parametrize("oracle", [False, True], ids=["random-drafter", "oracle-drafter"])
def test_stop_strings(world, oracle):
    seq = world.greedy[0][:MAX_NEW]
    for stop, done in stop_cases(world):
        want_ids = seq[:done]
        full = words(want_ids)
        want_text = full[: full.find(stop)]
        for mode in ("ar", "dflash", "retrace"):
            rt = runtime(world, 16, oracle=oracle)
            params = SamplingParams(max_new_tokens=MAX_NEW, stop=(stop,))
            (res,) = rt.generate(world.prompts[:1], params, mode)
            assert res.token_ids == want_ids, (mode, stop)
            assert res.text == want_text and res.finish_reason == "stop", (mode, stop)
            # streaming: nothing past the stop string, ever
            rt = runtime(world, 16, oracle=oracle)
            events = list(rt.stream(world.prompts[0], params, mode))
            assert [t for e in events for t in e.token_ids] == want_ids
            assert "".join(e.text for e in events) == want_text
            assert events[-1].finished and not any(e.finished for e in events[:-1])


def test_stop_string_in_a_batch_does_not_disturb_others(world):
    (stop, done), *_ = stop_cases(world)
    rt = runtime(world, 8, oracle=True)
    res = rt.generate(world.prompts, SamplingParams(max_new_tokens=MAX_NEW, stop=(stop,)), "retrace")
    for r, g in zip(res, world.greedy, strict=True):
        g = g[:MAX_NEW]
        m = next((m for m in range(1, len(g) + 1) if stop in words(g[:m])), len(g))
        assert r.token_ids == g[:m]
    assert res[0].token_ids == world.greedy[0][:done]


def test_oracle_acceptance_lengths_are_spread(world):
    """Guard on the oracle itself: its rejection slots cover 1..B (B = whole block right)."""
    rt = runtime(world, 8, oracle=True, policy="fixed")
    rt.generate(world.prompts, SamplingParams(max_new_tokens=MAX_NEW), "dflash")
    seen = Counter(rt.backend.rejection_slots)
    assert set(seen) == set(range(1, 9))


# -- verify policy -----------------------------------------------------------------------------------------
class ContextSpy:
    """Wraps a backend and checks what every draft call gets as context: exactly the committed positions
    since the previous draft call of that slot (all of them after rounds without a draft call), each with
    the target taps of its committed token (the last ones the target wrote there)."""

    def __init__(self, inner):
        self.inner = inner
        for k in ("name", "target_config", "drafter_config", "max_batch", "max_seq_len", "has_conditioner"):
            setattr(self, k, getattr(inner, k))
        self.taps: dict[tuple[int, int], torch.Tensor] = {}
        self.seen: dict[int, int] = {}  # slot -> first position the drafter has not been given
        self.draft_calls = 0
        self.longest_context = 0

    def target(self, slots, input_ids, positions, logits_index):
        logits, taps = self.inner.target(slots, input_ids, positions, logits_index)
        for n, s in enumerate(slots.tolist()):
            if int(positions[n, 0]) == 0:
                self.seen[s] = 0
            for t, p in enumerate(positions[n].tolist()):
                self.taps[(s, p)] = taps[n, t].clone()
        return logits, taps

    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        self.draft_calls += 1
        for n, s in enumerate(slots.tolist()):
            anchor = int(block_positions[n, 0])
            real = ctx_positions[n] < anchor
            assert ctx_positions[n][real].tolist() == list(range(self.seen[s], anchor))
            for i in real.nonzero().flatten().tolist():
                assert torch.equal(ctx_taps[n, i], self.taps[(s, int(ctx_positions[n, i]))])
            self.longest_context = max(self.longest_context, anchor - self.seen[s])
            self.seen[s] = anchor
        return self.inner.draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)

    def release(self, slot):
        self.inner.release(slot)


@pytest.mark.parametrize("ragged", [False, True], ids=["shared-K", "ragged"])
@pytest.mark.parametrize("oracle", [False, True], ids=["random-drafter", "oracle-drafter"])
def test_adaptive_policy_stays_exact(world, oracle, ragged):
    """An adaptive policy with a fixed cost model (deterministic): K varies over 0..B-1 (oracle drafter)
    or drafting turns off and is re-probed (random drafter); batch 1, 2, 5 and 8 requests in 3 slots
    (joining and leaving). Every output equals transformers' greedy decode, and the drafter is given
    every committed position exactly once."""
    B = 8
    want = [g[:MAX_NEW] for g in world.greedy]
    for mode in ("dflash", "retrace"):
        for batch, max_batch in ((1, 8), (2, 8), (5, 8), (8, 3)):
            be = TorchBackend.from_dirs(world.target, world.drafter, max_batch=max_batch, max_seq_len=128)
            spy = ContextSpy(OracleDrafter(be, world.sequences(), seed=batch) if oracle else be)
            rt = Runtime(spy, TextCodec.find(world.target), block_size=B, prompt_lookup=False,  # the policy alone
                         verify_policy=steep_cost_policy(B, ragged=ragged))
            res = rt.generate(world.prompts[:batch], SamplingParams(max_new_tokens=MAX_NEW), mode)
            check_exact(res, want[:batch], f"adaptive {mode} batch {batch} oracle={oracle} ragged={ragged}")
            hist = rt.run_stats()["verify_hist"]
            chosen = [k for k, n in enumerate(hist) if n]
            if oracle:
                assert len(chosen) >= 3 and max(chosen) > 1, hist
            else:  # never pays: most rounds plain decoding, without a draft call
                assert hist[0] > 0.8 * sum(hist) and spy.draft_calls < 0.5 * rt.run_stats()["rounds"] / batch
                assert spy.longest_context > 4  # taps of several rounds without a draft went in at once


def test_fixed_and_adaptive_policies_by_name(world):
    for policy in ("fixed", "adaptive"):
        rt = runtime(world, 8, oracle=True, policy=policy)
        res = rt.generate(world.prompts[:3], SamplingParams(max_new_tokens=MAX_NEW), "retrace")
        check_exact(res, [g[:MAX_NEW] for g in world.greedy[:3]], policy)
        stats = rt.run_stats()
        assert stats["verify_policy"] == policy and sum(stats["verify_hist"]) == stats["rounds"]
        if policy == "fixed":
            assert stats["verify_hist"] == [0] * 7 + [stats["rounds"]]
    with pytest.raises(RetraceError, match="unknown verify policy"):
        runtime(world, policy="sometimes")
