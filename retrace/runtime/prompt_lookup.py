"""Prompt lookup: drafts copied from a request's own tokens, for the rounds the drafter sits out.

When the verify policy decides a drafter call does not pay (`plan` -> 0 draft slots: plain decoding),
the round can still verify a few tokens for almost nothing: the continuation of the last place in the
request's prompt and output where its last n tokens already occurred (n from `max_ngram` down to
`min_ngram`; the most recent occurrence wins). That costs no forward pass at all, only a verify a few
tokens wider, which on a bandwidth-bound CPU target is close to the price of one decode step; code
edits, quoting and retrieval-heavy prompts repeat long spans. Verification is the same as for the drafter's
tokens, so the output stays the target's own: the greedy check, and for a sampling row speculative sampling
with each copied token as a point mass (q(d) = 1: d is kept with the target's processed probability p(d), and a
rejection samples max(0, p - q) normalised, p without d), as vLLM's rejection sampler treats n-gram drafts.

How many lookup tokens a round verifies is cost-aware (`choose`): with a per-token acceptance estimate
`a` (decayed hit/miss counts of earlier lookup rounds, kept per matched n-gram size: a row's proposal is
weighed by the rate of matches of its size; with `explore`, the default, by a draw from that size's
Beta(hits, misses) posterior, Thompson sampling, instead of its mean) and the policy's verify cost curve t(T), the
round verifies the K that maximises (N + sum over rows of a + ... + a^min(L_i, K)) / t(N, K + 1), L_i
being row i's proposal length; K = 0 is a plain decoding step (a policy without a cost model verifies every
proposal whole). Greedy and sampling rows keep separate estimates (a greedy row keeps a token the target
ranks first, a sampling row one with the target's probability of it). Rounds of more than `max_rows` rows
(default 8) take none. At the Qwen3-0.6B shape on 2 CPU cores (docs/bench/prompt-lookup.md,
2026-12-06), fp32: 16 requests through 4 slots 1.21x plain decoding with lookup in rounds of up to 4 rows
against 1.16x with 1 (the drafter alone 1.10x); 24 requests through 8 slots 1.14x with up to 8 rows against
1.03x with 4 (one cold run; two warm runs of the 8-row default, 2026-12-07: 1.09x). int4, where each verify row
costs ~0.45 of a decode, the cost-aware K declines: 1.00-1.01x at batch 4 either way, 1.03x at batch 8 (warm).
(On 2026-12-01, with one pooled acceptance estimate, 4 rows lost: 0.92x.)

Why draws: only rounds that verify lookup tokens update the estimate, so a size whose mean says "does not pay"
was never tried again, however wrong the mean (at int4, batch 8, the 0.5 prior priced every lookup out and the
lookup made no round in a whole run). A draw from a wide posterior is sometimes high enough to try; once tried
the posterior narrows round by round, and a size that really does not pay is then drawn high rarely. In the
replay of benchmarks/lookup_oracle.py (128 held-out prompts x 96, --rows 1,4,8) this changes nothing where the
mean already found the lookup's rounds (int4 and fp32 curves, within 0.5%) and finds them where it did not (a
verify row at 0.2 of a decode: 1.00x -> 1.09x plain decoding at 4 rows, oracle 1.16x).

`first=True`: lookup also before the drafter (runtime/proposers/lookup_first.py): a round whose lookup
tokens are expected to commit faster than the drafter's recent rounds did (`best`'s rate over plain
decoding against the verify policy's `drafting_gain`) verifies them and skips the draft call.
"""

from __future__ import annotations

import random

import torch

from retrace.errors import RetraceError
from retrace.runtime.device import CPU, host_values, index_tensor


class _Index:
    """n-gram -> the position after its most recent occurrence that something follows, for n in sizes."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.tokens: list[int] = []
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.matched = 0  # the n-gram size of the last `find`'s match (0: none)

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            i = len(self.tokens)  # the n-grams ending at i - 1 now have a follower: tokens[i]
            for n in self.sizes:
                if i >= n:
                    self.maps[n][tuple(self.tokens[i - n:i])] = i
            self.tokens.append(t)

    def find(self, max_tokens: int) -> list[int]:
        L = len(self.tokens)
        self.matched = 0
        for n in reversed(self.sizes):
            if L > n:
                j = self.maps[n].get(tuple(self.tokens[L - n:]))
                if j is not None:
                    self.matched = n
                    return self.tokens[j:j + max_tokens]
        return []


class PromptLookup:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_tokens: int = 8, decay: float = 0.98,
                 prior: tuple[float, float] = (1.0, 1.0), max_rows: int = 8, first: bool = False,
                 explore: bool = True, seed: int = 0):
        if not 1 <= min_ngram <= max_ngram:
            raise RetraceError(f"prompt lookup n-gram sizes must satisfy 1 <= min <= max, got {min_ngram}..{max_ngram}")
        if max_tokens < 1:
            raise RetraceError(f"prompt lookup needs max_tokens >= 1, got {max_tokens}")
        if min(prior) < 0 or sum(prior) <= 0:
            raise RetraceError(f"prompt lookup's prior (hits, misses) must be >= 0 and not both 0, got {prior}")
        self.sizes = range(min_ngram, max_ngram + 1)
        self.max_tokens = max_tokens
        self.max_rows = max_rows
        self.first = first  # also before the drafter, where it is expected to pay more (proposers/lookup_first.py)
        self.decay = decay
        self.hits, self.misses = prior  # decayed counts of accepted / rejected lookup tokens
        self.by_size = {n: list(prior) for n in self.sizes}  # the same per matched n-gram size (a longer match
        #   is the likelier continuation), greedy rows: what `best` weighs each row's proposal by
        self.by_size_sampling = {n: list(prior) for n in self.sizes}  # the same for sampling rows
        self._matched: list[int] = []  # the matched size per row of the last `propose` (0: no proposal)
        self._sampling: list[bool] = []  # per row of the last `propose`: a sampling row
        self.index: dict[int, _Index] = {}  # slot -> the request's tokens so far
        self.explore = explore  # weigh each size by a draw from its Beta(hits, misses) posterior, not its mean
        self.rng = random.Random(seed)  # the draws' own generator: the same choices in every run of a process
        self.rounds = self.verified = self.accepted = 0

    @property
    def accept_rate(self) -> float:
        return self.hits / (self.hits + self.misses)

    def size_rate(self, n: int, sampling: bool = False) -> float:
        """The decayed per-token acceptance of proposals from an n-token match (of greedy or sampling rows)."""
        hits, misses = self._counts(sampling)[n]
        return hits / (hits + misses)

    def _counts(self, sampling: bool) -> dict[int, list[float]]:
        return self.by_size_sampling if sampling else self.by_size

    def _draw(self, n: int, sampling: bool = False) -> float:
        """A draw from size n's Beta(hits, misses), the counts floored above 0 (betavariate refuses 0: a
        `prior` of (0, m) or (h, 0), the decayed counts of a size that never hit, or always did)."""
        hits, misses = self._counts(sampling)[n]
        return self.rng.betavariate(max(hits, 1e-9), max(misses, 1e-9))

    def clear(self, slot: int) -> None:
        self.index.pop(slot, None)

    def _tokens(self, r) -> list[int]:
        idx = self.index.get(r.slot)
        if idx is None:
            idx = self.index[r.slot] = _Index(self.sizes)
        seen = len(idx.tokens) - len(r.prompt_ids)
        idx.extend(r.prompt_ids if seen < 0 else [])
        idx.extend(r.output_ids[max(seen, 0):])
        found = idx.find(self.max_tokens)
        self._matched.append(idx.matched)
        return found

    def propose(self, reqs, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (drafts [N, L] int64 padded with 0, lengths [N]) from each request's own tokens, both on the host
        (the lengths with their host copy: `best` reads nothing)."""
        self._matched, self._sampling = [], [not r.params.greedy for r in reqs]
        if len(reqs) > self.max_rows:
            self._matched = [0] * len(reqs)
            return torch.zeros(len(reqs), 0, dtype=torch.int64, device=CPU), index_tensor([0] * len(reqs), CPU)
        props = [self._tokens(r)[:max_tokens] for r in reqs]
        L = max(len(p) for p in props)
        drafts = torch.tensor([p + [0] * (L - len(p)) for p in props], dtype=torch.int64, device=CPU)
        return drafts, index_tensor([len(p) for p in props], CPU)

    def choose(self, lengths: torch.Tensor, cost) -> int:
        """K lookup tokens to verify this round (0: a plain step); cost: the policy's CostModel, None =
        verify every proposal."""
        return self.best(lengths, cost)[0]

    def best(self, lengths: torch.Tensor, cost) -> tuple[int, float | None]:
        """-> (K, its expected commit rate over plain decoding's: 1.0 for K = 0; None without a cost model)."""
        lengths = host_values(lengths)  # built on the host (propose): no read
        L = max(lengths, default=0)
        if L == 0 or cost is None:
            return L, None if cost is None else 1.0
        N = len(lengths)
        sizes = self._matched if len(self._matched) == N else [0] * N  # lengths not from `propose`: pooled
        keys = list(zip(sizes, self._row_kinds(N), strict=True))
        draws = {k: self._draw(*k) if self.explore else self.size_rate(*k)
                 for k in sorted(set(keys)) if k[0]}  # one draw per size, row kind and round, shared by its rows
        a = [draws[k] if k[0] else self.accept_rate for k in keys]
        best, plain = 0, N / cost.verify(N, 1)
        best_rate = plain
        for k in range(1, L + 1):
            gain = sum(sum(ai ** j for j in range(1, min(n, k) + 1)) for n, ai in zip(lengths, a, strict=True))
            rate = (N + gain) / cost.verify(N, k + 1)
            if rate > best_rate:
                best, best_rate = k, rate
        return best, best_rate / plain

    def observe(self, verified: torch.Tensor | list[int], accepted: torch.Tensor | list[int]) -> None:
        """verified, accepted [N]: lookup tokens each row verified and accepted (host lists: no read)."""
        if isinstance(verified, torch.Tensor):
            verified, accepted = verified.tolist(), accepted.tolist()
        on = [(v, a) for v, a in zip(verified, accepted, strict=True) if v > 0]
        if not on:
            return
        hits = sum(a for _, a in on)
        misses = sum(a < v for v, a in on)
        self.hits = self.decay * self.hits + hits
        self.misses = self.decay * self.misses + misses
        sizes = self._matched if len(self._matched) == len(verified) else [0] * len(verified)
        kinds = self._row_kinds(len(verified))
        for sampling in (False, True):  # the rows of the proposal verified, by row kind and matched size
            for n, c in self._counts(sampling).items():
                rows = [(v, a) for v, a, m, k in zip(verified, accepted, sizes, kinds, strict=True)
                        if v > 0 and m == n and k == sampling]
                if rows:
                    c[0] = self.decay * c[0] + sum(a for _, a in rows)
                    c[1] = self.decay * c[1] + sum(a < v for v, a in rows)
        self.rounds += 1
        self.verified += sum(verified)
        self.accepted += hits

    def to_dict(self) -> dict:
        return {"ngram": [self.sizes.start, self.sizes.stop - 1], "max_tokens": self.max_tokens,
                "max_rows": self.max_rows, "first": self.first, "explore": self.explore,
                "rounds": self.rounds, "verified": self.verified, "accepted": self.accepted,
                "accept_rate_estimate": round(self.accept_rate, 4),
                "accept_rate_by_ngram": {n: round(self.size_rate(n), 4) for n in self.sizes},
                "accept_rate_by_ngram_sampling": {n: round(self.size_rate(n, True), 4) for n in self.sizes}}

    def _row_kinds(self, N: int) -> list[bool]:
        """Per row of the last `propose`: a sampling row (all greedy when the rows are not from it)."""
        return self._sampling if len(self._sampling) == N else [False] * N
