"""Proposers: who offers the round's drafts (runtime/proposers/base.py: the interface and the Proposal)."""

from retrace.runtime.proposers.base import NoProposer, Proposal, Proposer, RoundBatch
from retrace.runtime.proposers.chain import DrafterCall, DrafterChain
from retrace.runtime.proposers.lookup_first import LookupFirstPlan
from retrace.runtime.proposers.prompt_lookup import LookupProposer
from retrace.runtime.proposers.select import ProposerPlan
from retrace.runtime.proposers.tree import DrafterTree

__all__ = ["DrafterCall", "DrafterChain", "DrafterTree", "LookupFirstPlan", "LookupProposer", "NoProposer",
           "Proposal", "Proposer", "ProposerPlan", "RoundBatch"]
