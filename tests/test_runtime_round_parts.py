"""The round's parts, each against its claim (runtime/proposers/, verify_accept.py, suffix_memory.py,
stop_strings.py):

- every proposer's Proposal has the shapes its fields document, and the plan picks the proposer the verify
  policy's plan asks for (drafter / prompt lookup / none);
- the chain is the tree's special case: a chain verified as a one-path tree under the ancestor mask accepts
  exactly what the chain verify accepts (token-exact against transformers' greedy decode), with the same
  taps, and leaves the same K/V cache (the next verify's logits agree);
- the one rejected-suffix memory holds, after every recorded round of a generate, both views exactly as
  defined (the conditioner's memory and the tree's rejected trajectory, at old slot j = k + a + 1), and
  rounds without a drafter call and released slots leave both empty;
- committing a block of tokens at once gives the output, text, finish reason and streamed text that
  committing one token per round gives (EOS, length, stop strings spanning tokens, UTF-8 tails).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from runtime_fixtures import hf_greedy, load_hf_target, write_pair, write_word_tokenizer

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.draft_tree import SOURCE_BITS, DraftTree
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.proposers import (
    DrafterChain,
    DrafterTree,
    LookupProposer,
    NoProposer,
    Proposal,
    RoundBatch,
)
from retrace.runtime.stop_strings import append
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.verify_policy import FixedPolicy

pytestmark = pytest.mark.usefixtures("one_thread")
B, V = 8, 64
PROMPTS = [[5, 9, 2, 5, 9, 2, 5, 9], [7, 7, 3], [1, 2, 3, 4, 1, 2, 3, 4]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_thread):
    return write_pair(tmp_path_factory.mktemp("round-parts"), vocab=V, block_size=B, conditioner="random", seed=2)


def prefilled(pair, prompts, mode="retrace", params=None, **kw):
    """A scheduler with `prompts` admitted and prefilled (no round yet) and their RoundBatch."""
    rt = Runtime.from_dirs(*pair, max_batch=2 * len(prompts), max_seq_len=96, **{"verify_policy": "fixed", **kw})
    sched = rt.scheduler()
    for p in prompts:
        sched.add(p, params or SamplingParams(max_new_tokens=16), mode)
    sched._prefill(sched._admit(), {})
    reqs = sorted(sched.running.values(), key=lambda r: r.slot)
    return sched, reqs


# -- proposers ---------------------------------------------------------------------------------------------
def test_each_proposers_proposal_has_its_documented_shapes(pair):
    N = len(PROMPTS)
    sched, reqs = prefilled(pair, PROMPTS, params=SamplingParams(max_new_tokens=16, temperature=1.0, seed=1))
    batch = RoundBatch.of(reqs, sched.device)
    d = sched.backend.drafter_config.hidden_size
    assert isinstance(sched.drafter, DrafterChain)
    p = sched.drafter.propose(batch, B - 1)
    assert (p.kind, p.slots, p.drafted, len(p.marks)) == ("chain", B - 1, True, 2)
    assert p.drafts.shape == (N, B - 1) and p.drafts.dtype == torch.int64
    assert p.verified.shape == (N,) and p.verified.host_values == [B - 1] * N  # K on the host: no read
    assert p.hidden.shape == (N, B, d) and p.draft_logits.shape == (N, B - 1, V)
    # sampling rows: the processed q (temperature alone: the dense form of runtime/candidates.py)
    assert len(p.q) == N and all(q.probs.shape == (B - 1, V) and q.ids is None for q in p.q)
    assert p.tree is None

    sched, reqs = prefilled(pair, PROMPTS, tree_budget=6)
    batch = RoundBatch.of(reqs, sched.device)
    assert isinstance(sched.drafter, DrafterTree)
    p = sched.drafter.propose(batch, 3)  # a tree draws on every slot, whatever the plan's count
    assert (p.kind, p.slots, p.drafted, len(p.marks), p.verified) == ("tree", B - 1, True, 3, None)
    assert p.drafts.shape == (N, B - 1) and p.q == [None] * N
    M = p.tree.nodes
    assert M <= 6 and p.tree.tokens.shape == p.tree.parent.shape == p.tree.depth.shape == (N, M)
    assert torch.equal(p.tree.tokens[:, 0], batch.anchor) and bool((p.tree.size <= 6).all())

    # every token occurs in these prompts: whatever the first token, the lookup finds where it occurred
    sched, reqs = prefilled(pair, [list(range(V)), list(range(V))[::-1]], prompt_lookup=PromptLookup(max_rows=2))
    batch = RoundBatch.of(reqs, sched.device)
    N = 2
    lookup = sched.plan.lookup
    assert isinstance(lookup, LookupProposer)
    p = lookup.propose(batch, 0)
    k = p.verified.host_values
    assert (p.kind, p.slots, p.drafted, p.marks, p.q) == ("chain", 0, False, (), None)
    assert p.drafts.shape == (N, max(k)) and len(k) == N and min(k) >= 1
    for r, row, n in zip(reqs, p.drafts.tolist(), k, strict=True):  # a continuation from the request itself
        seen = r.prompt_ids + r.output_ids
        assert any(seen[i:i + n] == row[:n] for i in range(len(seen) - n))

    p = NoProposer().propose(batch, 0)
    assert p.drafts.shape == (N, 0) and p.verified is None and not p.drafted


def test_the_plan_picks_the_proposer_the_policy_plans(pair):
    sched, _ = prefilled(pair, PROMPTS[:1], prompt_lookup=PromptLookup())
    plan = sched.plan

    def batch(mode):
        return SimpleNamespace(mode=mode, rows=1)

    assert plan.pick(batch("ar")) == (plan.none, 0)
    assert plan.pick(batch("retrace")) == (sched.drafter, B - 1)  # fixed policy: the whole block
    plan.policy = SimpleNamespace(plan=lambda mode, rows: 0)  # a policy that plans no draft call
    assert plan.pick(batch("dflash")) == (plan.lookup, 0)
    plan.lookup = None
    assert plan.pick(batch("dflash")) == (plan.none, 0)


# -- verify and accept: the chain as the tree's special case ----------------------------------------------
def chain_tree(anchor: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """[anchor, d_1 .. d_S] as a one-path tree: node m's parent is m - 1."""
    N, S = drafts.shape
    idx = torch.arange(S + 1).expand(N, S + 1)
    source = torch.full((N, S + 1), SOURCE_BITS["topk"])
    source[:, 0] = 0
    return DraftTree(torch.cat([anchor.unsqueeze(1), drafts], 1), (idx - 1).clamp_min(0), idx.clone(), source,
                     torch.full((N,), S + 1))


def test_a_chain_verified_as_a_tree_accepts_what_the_chain_verify_accepts(pair):
    hf = load_hf_target(pair[0])
    greedy = [hf_greedy(hf, p, B + 1) for p in PROMPTS]
    N = len(PROMPTS)
    sched, reqs = prefilled(pair, PROMPTS + PROMPTS)  # rows i and N + i: the same request in two slots
    chain, tree = RoundBatch.of(reqs[:N], sched.device), RoundBatch.of(reqs[N:], sched.device)
    assert chain.anchor.tolist() == tree.anchor.tolist() == [g[0] for g in greedy]
    wrong = [0, 3, B - 1]  # row i's drafts follow the target's greedy decode up to slot wrong[i]
    drafts = torch.tensor([g[1:B] for g in greedy])
    for i, w in enumerate(wrong):
        if w < B - 1:
            drafts[i, w] = (drafts[i, w] + 1) % V
    verified = sched.drafter.policy.choose("retrace", None, drafts, [None] * N)
    a = sched.verify_and_accept["chain"](chain, Proposal("chain", None, drafts, verified, B - 1))
    t = sched.verify_and_accept["tree"](tree, Proposal("tree", None, drafts, None, B - 1, [None] * N,
                                                       tree=chain_tree(tree.anchor, drafts)))
    assert a.accepted.tolist() == t.accepted.tolist() == wrong  # token-exact: the target's own greedy decode
    assert a.bonus.tolist() == t.bonus.tolist() == [g[w + 1] for g, w in zip(greedy, wrong, strict=True)]
    assert torch.equal(a.tokens, t.tokens) and torch.equal(a.block, t.block)
    assert torch.equal(a.target_argmax, t.target_argmax) and a.width == t.width == B
    assert a.judged.tolist() == t.judged.tolist() == [B - 1] * N and t.path_len.tolist() == [B - 1] * N
    torch.testing.assert_close(a.taps, t.taps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.path_logits(), t.path_logits(), rtol=1e-5, atol=1e-5)
    # the tree moved its path's K/V where the chain wrote them: the next verify reads the same cache
    nxt = []
    for batch, o in ((chain, a), (tree, t)):
        for r, acc, bonus in zip(batch.reqs, o.accepted.tolist(), o.bonus.tolist(), strict=True):
            r.anchor, r.anchor_pos = bonus, r.anchor_pos + acc + 1
        batch = RoundBatch.of(batch.reqs, sched.device)
        nxt.append(sched.verify_and_accept["chain"](batch, NoProposer().propose(batch, 0)).logits)
    torch.testing.assert_close(nxt[0], nxt[1], rtol=1e-5, atol=1e-5)


# -- the one rejected-suffix memory -----------------------------------------------------------------------
class EveryThirdPlain(FixedPolicy):
    """The fixed policy, except that every third round plans no drafter call."""

    def __init__(self, block_size):
        super().__init__(block_size)
        self.rounds = 0

    def plan(self, mode, rows):
        self.rounds += 1
        return 0 if self.rounds % 3 == 0 else super().plan(mode, rows)


def test_the_memory_holds_both_views_as_defined_after_every_round(pair):
    """Recorded rounds of a tree generate (every third round skips the drafter): after each, slot s of
    row i (a accepted, old slot j = k + a + 1 at new slot k) holds suffix[k] = block[j] (j <= B-1),
    target[k] = the round path's argmax at j - 1 (j - 1 <= L), and the conditioner's memory of old slot j
    where the target scored it (j <= min(L + 1, B - 1)); a round without a drafter call empties both."""
    rt = Runtime.from_dirs(*pair, max_batch=2, max_seq_len=96, tree_budget=6, verify_policy=EveryThirdPlain(B))
    sched = rt.scheduler()
    mem, seen = sched.memory, {"drafted": 0, "plain": 0}
    observe = mem.observe

    def check(o):
        observe(o)
        if not o.proposal.drafted:
            seen["plain"] += 1
            for s in o.batch.slots.tolist():
                assert mem.valid[s].sum() == 0 and (mem.suffix[s] == -1).all() and (mem.target[s] == -1).all()
            return
        seen["drafted"] += 1
        for i, s in enumerate(o.batch.slots.tolist()):
            a, L = int(o.accepted[i]), int(o.path_len[i])
            assert int(mem.position[s]) == int(o.batch.anchor_pos[i]) + a + 1
            for k in range(1, B):
                j = k + a + 1
                assert int(mem.suffix[s, k - 1]) == (int(o.block[i, j]) if j <= B - 1 else -1)
                assert int(mem.target[s, k - 1]) == (int(o.target_argmax[i, j - 1]) if j - 1 <= L else -1)
                scored = j <= min(L + 1, B - 1)
                assert bool(mem.valid[s, k]) == scored
                if scored:
                    assert torch.equal(mem.memory[s, k], o.proposal.hidden[i, j])
                    assert int(mem.corr_index[s, k]) == j - 1

    mem.observe = check  # the round calls its observers' `observe`
    rt.generate(PROMPTS, SamplingParams(max_new_tokens=40, ignore_eos=True), "retrace")
    assert seen["drafted"] >= 5 and seen["plain"] >= 1, seen
    assert mem.valid.sum() == 0 and (mem.suffix == -1).all() and (mem.target == -1).all()  # released: cleared
    assert (mem.position == -1).all() and not mem.filled


# -- stop strings ---------------------------------------------------------------------------------------------
def _request(params):
    return SimpleNamespace(params=params, output_ids=[], text="", emitted_text=0, detok=None, finish_reason=None)


@pytest.mark.parametrize("case", ["stop-strings", "eos", "length"])
def test_a_block_commits_what_one_token_per_round_commits(tmp_path, case):
    codec = TextCodec(write_word_tokenizer(tmp_path, 50))
    rng = random.Random(3)
    eos = {7}
    for trial in range(30):
        ids = [rng.randrange(50) for _ in range(40)]
        ids = [t for t in ids if t != 7]
        if case == "eos":
            ids.insert(rng.randrange(3, 30), 7)
        words = codec.decode(ids)
        stop = ()
        if case == "stop-strings":  # one spanning two tokens' words, one inside a word, one never there
            a = rng.randrange(5, 30)
            stop = (codec.decode(ids[a:a + 2])[2:], "zz", codec.decode(ids[a + 6:a + 7])[:3])
        params = SamplingParams(max_new_tokens=25 if case == "length" else 64, stop=stop)
        one, block = _request(params), _request(params)
        streamed = {"one": "", "block": ""}
        for t in ids:
            if one.finish_reason is None:
                streamed["one"] += append(one, [t], eos, codec)
        upto = 0
        while upto < len(ids) and block.finish_reason is None:
            n = rng.randint(1, 8)
            streamed["block"] += append(block, ids[upto:upto + n], eos, codec)
            upto += n
        assert (block.output_ids, block.text, block.finish_reason) == (one.output_ids, one.text, one.finish_reason), \
            (trial, words, stop)
        assert streamed["block"] == streamed["one"] == one.text  # finished: everything streamed, nothing more
        assert one.finish_reason == ("length" if case == "length" else "stop")


def test_the_timings_observer_follows_a_stats_reset(pair):
    """Runtime.reset_stats gives the scheduler a fresh Timing: the rounds after it are timed into that one."""
    rt = Runtime.from_dirs(*pair, max_batch=2, max_seq_len=96, verify_policy="fixed")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    rt.generate(PROMPTS[:1], params, "retrace")
    rt.reset_stats()
    assert rt.scheduler().timing.draft == rt.scheduler().timing.verify == 0
    rt.generate(PROMPTS[:1], params, "retrace")
    t = rt.scheduler().timing
    assert t.draft > 0 and t.verify > 0


class RecordedDraftTimes(FixedPolicy):
    """The fixed policy, recording the draft time each round's observe gets."""

    def __init__(self, block_size):
        super().__init__(block_size)
        self.draft_s = []

    def observe(self, mode, rows, verify_tokens, verify_s, draft_s, verified, accepted):
        self.draft_s.append(draft_s)


def test_a_draft_call_that_caught_up_on_earlier_positions_is_not_timed_as_drafting(pair):
    """The first draft call after a 20-token prompt (block 8) runs the prompt's taps through the drafter
    too: the policy gets no draft time for it (round_outcome.PolicyObserver); every later call, one round's
    taps (C <= B), is timed."""
    policy = RecordedDraftTimes(B)
    rt = Runtime.from_dirs(*pair, max_batch=1, max_seq_len=96, verify_policy=policy)
    sched = rt.scheduler()
    contexts, propose = [], sched.drafter.propose

    def spy(batch, slots):
        p = propose(batch, slots)
        contexts.append(p.context)
        return p

    sched.drafter.propose = spy
    rt.generate([list(range(1, 21))], SamplingParams(max_new_tokens=24), "dflash")
    assert contexts[0] == 20 and len(contexts) > 2 and all(c <= B for c in contexts[1:]), contexts
    assert policy.draft_s[0] is None and all(s is not None and s > 0 for s in policy.draft_s[1:])
