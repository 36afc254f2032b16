"""The systems a benchmark compares, behind one small interface.

Each system runs a list of prompts (token ids) at a batch size and returns exactly `n` new tokens per
prompt, with EOS treated as an ordinary token (nothing stops early), so every system does the same work; greedy,
or sampled at the run's one setting by the system's own library (`decoding`, retrace.bench.decoding):
- ours: `retrace-<backend>-<mode>` (the default verify policy; `...-fixed`: the whole block every round;
  the runtime's scheduler driven directly so that every round's accepted length is recorded, and the
  backend's forwards timed to split model time from loop time);
- `hf-ar`: transformers `generate` on the target alone (`eos_token_id=None`, left padding for batches);
- `hf-dflash`: transformers' own DFlash assisted generation with the same drafter weights (batch 1 only;
  rounds counted through `DFlashTokenCandidateGenerator.update_candidate_strategy`);
- `ortgenai-ar`: onnxruntime-genai's autoregressive decoding of the same target (`eos_token_id: []` in its
  config copy, right padding for batches, `max_length = longest prompt + n`);
- `ortgenai-ngram[-adaptive]`, `ortgenai-draft[-adaptive]`: onnxruntime-genai's own speculative decoding
  (n-gram lookup, or a small autoregressive draft model wired as `model.draft` in its config) through
  `GeneratorParams.set_speculative_options`, batch 1 only; `Generator.get_speculative_stats()`
  summed over the prompts.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from retrace.bench.decoding import GREEDY, Decoding
from retrace.runtime.stats import AcceptStats

ProgressFn = Callable[[int], None]


@dataclass
class RunOut:
    outputs: list[list[int]]  # new token ids per prompt, in prompt order
    wall_s: float
    # per prompt, per verify round: accepted drafts as the system itself counts them (None for AR peers)
    accepted: list[list[int]] | None = None
    time: dict | None = None  # ours: the loop's split and the time inside model forwards
    stats: dict | None = None  # onnxruntime-genai's speculative statistics, summed over the prompts
    verify_hist: list[int] | None = None  # ours: rounds that verified K drafts, index K


def enumerate_chunks(items: list, size: int) -> Iterator[tuple[int, list]]:
    """(index of the chunk's first item, the chunk) for consecutive chunks of `size`."""
    for i in range(0, len(items), size):
        yield i, items[i: i + size]


class System:
    name: str = ""
    family: str = "peer"  # "peer" | "retrace"
    backend: str | None = None
    mode: str | None = None
    decoding: Decoding = GREEDY  # how it picks tokens (set by its builder for a sampled run)

    def supports(self, batch_size: int) -> str | None:
        """None if the batch size runs, else the reason it does not (reported as n/a)."""
        return None

    def run(self, prompts: list[list[int]], n: int, batch_size: int, progress: ProgressFn | None = None) -> RunOut:
        raise NotImplementedError

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------- ours
@dataclass
class _SeqStats(AcceptStats):
    """AcceptStats that also keeps the accepted length of every round, in order."""

    seq: list[int] = field(default_factory=list)

    def record(self, accepted: int, verified: int = 0, drafted: int = 0) -> None:
        super().record(accepted, verified, drafted)
        self.seq.append(int(accepted))


class _Timed:
    """Wraps a backend method and sums the wall time spent inside it."""

    def __init__(self, fn):
        self.fn = fn
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


class ForwardTimers:
    """Time inside `backend.target` and `backend.draft` (the model forwards, cache writes included)."""

    def __init__(self, backend):
        self.target = _Timed(backend.target)
        self.draft = _Timed(backend.draft)
        backend.target = self.target  # instance attributes shadow the bound methods
        backend.draft = self.draft

    def reset(self) -> None:
        for t in (self.target, self.draft):
            t.seconds, t.calls = 0.0, 0


class RetraceSystem(System):
    family = "retrace"

    def __init__(self, runtime, backend_name: str, mode: str, timers: ForwardTimers, name: str | None = None,
                 decoding: Decoding = GREEDY):
        self.rt = runtime
        self.decoding = decoding
        self.backend = backend_name
        self.mode = mode
        self.timers = timers
        self.name = name or f"retrace-{backend_name}-{mode}"

    def supports(self, batch_size: int) -> str | None:
        mb = self.rt.backend.max_batch
        return None if batch_size <= mb else f"the runtime was built for max_batch {mb}"

    def run(self, prompts, n, batch_size, progress=None) -> RunOut:
        sched = self.rt.scheduler()
        self.rt.reset_stats()
        self.timers.reset()
        outputs: list[list[int]] = []
        accepted: list[list[int]] = []
        t0 = time.perf_counter()
        for start, chunk in enumerate_chunks(prompts, batch_size):
            reqs = [sched.add(p, self.decoding.params(n, start + i), self.mode) for i, p in enumerate(chunk)]
            for r in reqs:
                r.stats = _SeqStats()
            while not all(r.finished for r in reqs):
                events = sched.step()
                if progress is not None:
                    progress(sum(len(e.token_ids) for e in events))
            outputs.extend(list(r.output_ids) for r in reqs)
            accepted.extend(list(r.stats.seq) for r in reqs)
        wall = time.perf_counter() - t0
        t = sched.timing
        fwd = self.timers.target.seconds + self.timers.draft.seconds
        split = {
            "wall_s": wall,
            "prefill_s": t.prefill,
            "draft_s": t.draft,
            "verify_s": t.verify,
            "other_s": max(0.0, wall - t.prefill - t.draft - t.verify),
            "target_forward_s": self.timers.target.seconds,
            "draft_forward_s": self.timers.draft.seconds,
            "forward_s": fwd,
            "outside_forward_s": max(0.0, wall - fwd),
            "target_calls": self.timers.target.calls,
            "draft_calls": self.timers.draft.calls,
        }
        return RunOut(outputs, wall, accepted if self.mode != "ar" else None, split,
                      verify_hist=list(sched.stats[self.mode].verify_hist))


# ----------------------------------------------------------------------------------------------- transformers
def _left_pad(batch: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(p) for p in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), L), dtype=torch.int64)
    for i, p in enumerate(batch):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    return ids, mask


class HFArSystem(System):
    name = "hf-ar"

    def __init__(self, model, pad_id: int, decoding: Decoding = GREEDY):
        self.model = model
        self.pad_id = pad_id
        self.decoding = decoding

    @torch.inference_mode()
    def run(self, prompts, n, batch_size, progress=None) -> RunOut:
        outputs: list[list[int]] = []
        t0 = time.perf_counter()
        for start, chunk in enumerate_chunks(prompts, batch_size):
            ids, mask = _left_pad(chunk, self.pad_id)
            self.decoding.seed_torch(start)
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, eos_token_id=None,
                                      pad_token_id=self.pad_id, **self.decoding.hf_kwargs())
            outputs.extend(out[:, ids.shape[1]:].tolist())
            if progress is not None:
                progress(n * len(chunk))
        return RunOut(outputs, time.perf_counter() - t0)


@contextlib.contextmanager
def count_dflash_rounds() -> Iterator[list[int]]:
    """Record `num_matches` of every call of transformers' DFlash per-round hook (first call = prefill)."""
    from transformers.generation import candidate_generator as cg

    cls = cg.DFlashTokenCandidateGenerator
    orig = cls.update_candidate_strategy
    seen: list[int] = []

    def hook(self, input_ids, scores, num_matches):
        seen.append(int(num_matches))
        return orig(self, input_ids, scores, num_matches)

    cls.update_candidate_strategy = hook
    try:
        yield seen
    finally:
        cls.update_candidate_strategy = orig


class HFDFlashSystem(System):
    name = "hf-dflash"

    def __init__(self, model, assistant, decoding: Decoding = GREEDY):
        self.model = model
        self.assistant = assistant
        self.decoding = decoding

    def supports(self, batch_size: int) -> str | None:
        return None if batch_size == 1 else "transformers' assisted (DFlash) generation supports batch 1 only"

    @torch.inference_mode()
    def run(self, prompts, n, batch_size, progress=None) -> RunOut:
        outputs: list[list[int]] = []
        accepted: list[list[int]] = []
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], dtype=torch.int64)
            self.decoding.seed_torch(i)
            with count_dflash_rounds() as seen:
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=self.assistant,
                                          speculation_type="dflash", max_new_tokens=n, eos_token_id=None,
                                          **self.decoding.hf_kwargs())
            outputs.append(out[0, ids.shape[1]:].tolist())
            accepted.append(seen[1:])  # the first call is the prefill (its 1 token is not a verify round)
            if progress is not None:
                progress(n)
        return RunOut(outputs, time.perf_counter() - t0, accepted)


# ----------------------------------------------------------------------------------------------- onnxruntime-genai
def sum_speculative_stats(per_prompt: list[dict]) -> dict:
    """Counters (`rounds`, `draft_tokens_accepted`, ...) summed over prompts; the rates recomputed from them
    (`acceptance_rate` = accepted / evaluated, `tokens_per_round` = emitted / rounds)."""
    keep = ("rounds", "draft_tokens_proposed", "draft_tokens_evaluated", "draft_tokens_accepted",
            "correction_tokens", "bonus_tokens", "tokens_emitted", "draft_forward_passes", "target_forward_passes",
            "target_verify_forward_passes", "target_reanchor_forward_passes", "standard_fallback_steps",
            "full_accept_rounds", "partial_accept_rounds", "zero_accept_rounds", "ngram_lookup_hits",
            "ngram_lookup_misses", "adaptive_k_increases", "adaptive_k_decreases")
    out = {k: sum(int(s.get(k, 0)) for s in per_prompt) for k in keep}
    out["acceptance_rate"] = out["draft_tokens_accepted"] / out["draft_tokens_evaluated"] \
        if out["draft_tokens_evaluated"] else None
    out["tokens_per_round"] = out["tokens_emitted"] / out["rounds"] if out["rounds"] else None
    out["effective_k_last"] = [s.get("effective_k") for s in per_prompt]
    return out


class OrtGenaiSystem(System):
    """`speculative`: options for `GeneratorParams.set_speculative_options` (None: plain AR). `model` may be
    an `og.Model` already loaded (the n-gram systems share the AR system's)."""

    name = "ortgenai-ar"

    def __init__(self, model_dir, pad_id: int | None, name: str = "ortgenai-ar", speculative: dict | None = None,
                 model=None, decoding: Decoding = GREEDY):
        import onnxruntime_genai as og

        self.decoding = decoding
        self.og = og
        self.model = model if model is not None else og.Model(str(model_dir))
        self.pad_id = pad_id
        self.name = name
        self.speculative = dict(speculative) if speculative else None

    def supports(self, batch_size: int) -> str | None:
        if self.speculative and batch_size > 1:
            return "onnxruntime-genai's speculative decoding runs batch 1 only"
        if batch_size > 1 and self.pad_id is None:
            return "the model has no pad_token_id, which onnxruntime-genai needs to batch prompts"
        return None

    def run(self, prompts, n, batch_size, progress=None) -> RunOut:
        import numpy as np

        og = self.og
        outputs: list[list[int]] = []
        stats: list[dict] = []
        t0 = time.perf_counter()
        for start, chunk in enumerate_chunks(prompts, batch_size):
            L = max(len(p) for p in chunk)
            # right padding: onnxruntime-genai 0.18 masks pad tokens and positions the rows correctly
            arr = np.full((len(chunk), L), self.pad_id if self.pad_id is not None else 0, dtype=np.int32)
            for i, p in enumerate(chunk):
                arr[i, : len(p)] = p
            params = og.GeneratorParams(self.model)
            params.set_search_options(max_length=L + n, batch_size=len(chunk), **self.decoding.genai_options(start))
            if self.speculative:
                params.set_speculative_options(**self.speculative)
            gen = og.Generator(self.model, params)
            gen.append_tokens(arr)
            while not gen.is_done():
                gen.generate_next_token()
            for i in range(len(chunk)):
                outputs.append([int(t) for t in gen.get_sequence(i)[L:]])
            if self.speculative:
                stats.append(gen.get_speculative_stats())
            del gen
            if progress is not None:
                progress(n * len(chunk))
        wall = time.perf_counter() - t0
        return RunOut(outputs, wall, stats=sum_speculative_stats(stats) if self.speculative else None)
