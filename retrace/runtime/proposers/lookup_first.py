"""Prompt lookup before the drafter (`PromptLookup(first=True)`, `--prompt-lookup first`): where the verify
policy plans a draft call, the round's lookup tokens are weighed against it first, and a round whose lookup is
expected to commit faster than the drafter's recent rounds did verifies the lookup's tokens and makes no draft
call (the drafter's time saved; its rejected-suffix memory is then empty for the next drafted round, as after
any round without a draft call). Glossary:
  lookup gain    the lookup's expected commit rate over plain decoding's at its best K (PromptLookup.best:
                 its decayed per-token acceptance and the policy's cost model of the verify);
  drafting gain  the same ratio for the drafter, the verify policy's average over its recent drafted rounds
                 (draft call included; VerifyPolicy.drafting_gain; None before the first one and after a pause:
                 then the drafter drafts).
Both are expectations from the same cost model, so they compare; suffix decoding's hybrid with a model drafter
(Arctic Inference) makes the same choice by a score threshold. Lossless either way: a round verifies what one
proposer offers with the same acceptance rule (greedy, or speculative sampling: runtime/sampling.py)."""

from __future__ import annotations

from retrace.runtime.proposers.base import Proposer, RoundBatch
from retrace.runtime.proposers.select import ProposerPlan


class LookupFirstPlan(ProposerPlan):
    def pick(self, batch: RoundBatch) -> tuple[Proposer, int]:
        proposer, slots = super().pick(batch)
        if proposer is not self.drafter or self.lookup is None:
            return proposer, slots
        drafting = self.policy.drafting_gain(batch.mode)
        if drafting is None:
            return proposer, slots
        lookup = self.lookup.gain(batch)
        return (self.lookup, 0) if lookup is not None and lookup > drafting else (proposer, slots)
