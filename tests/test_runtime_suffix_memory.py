"""Rejected-suffix memory: alignment, features, bookkeeping (retrace/runtime/suffix_memory.py), and the
same facts checked end to end on what the scheduler actually feeds the drafter.

Round r: anchor at absolute position p, a drafts accepted, next anchor p' = p + a + 1. Old block slot j
(absolute p + j) becomes new slot k = j - a - 1. Valid new slots: k = 1 .. B-2-a (slot 0, the new anchor,
never; nothing after a >= B-2). Slot k carries the drafter's hidden state at old slot j = k + a + 1, its
correction is the verify taps that scored d_j, i.e. those at old slot j - 1 = k + a (absolute p' + k - 1),
and its features are [target argmax at j-1 == d_j, target prob of d_j at j-1, drafter prob of d_j at j].
"""

from __future__ import annotations

import pytest
import torch
from runtime_fixtures import OracleDrafter, single_thread, steep_cost_policy, write_pair

from retrace.models.conditioner import FEATURES
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.suffix_memory import SuffixMemory, align
from retrace.runtime.torch_backend import TorchBackend

BLOCKS = [2, 3, 4, 8, 16]


@pytest.mark.parametrize("B", BLOCKS)
def test_align_every_accepted_length(B):
    accepted = torch.arange(B)  # one row per a = 0 .. B-1 (a = B-1: everything accepted)
    old, valid, corr = align(accepted, B)
    assert old.shape == valid.shape == corr.shape == (B, B)
    for a in range(B):
        valid_k = [k for k in range(B) if valid[a, k]]
        assert valid_k == list(range(1, B - 1 - a)), f"a={a}"  # k = 1 .. B-2-a
        for k in valid_k:
            assert int(old[a, k]) == k + a + 1  # same absolute position: p + j == p' + k
            assert int(corr[a, k]) == k + a  # verify slot j - 1, the one that scored d_j
            assert 1 <= int(old[a, k]) <= B - 1
    assert not valid[:, 0].any()  # the anchor slot is never fused
    assert not valid[B - 2:].any()  # a = B-2 and a = B-1: empty memory
    if B >= 3:
        assert valid[0].sum() == B - 2  # nothing accepted: all of d_2 .. d_{B-1} remembered


def reference_features(block, verify_logits, draft_logits, j):
    """Features of old slot j, computed directly from their definitions (one row)."""
    d_j = int(block[j])
    p_target = verify_logits[j - 1].softmax(-1)
    p_draft = draft_logits[j - 1].softmax(-1)  # draft_logits[i] is block slot i + 1
    return torch.tensor([float(int(verify_logits[j - 1].argmax()) == d_j), float(p_target[d_j]),
                         float(p_draft[d_j])])


@pytest.mark.parametrize("B", [4, 8, 16])
def test_write_read_clear(B):
    torch.manual_seed(B)
    S, d, V = 6, 5, 11
    mem = SuffixMemory(S, B, d)
    accepted_all = list(range(B))
    # ragged rows in one write, non-contiguous slots, every a including B-2 and B-1
    for start in range(0, B, 3):
        acc = torch.tensor(accepted_all[start:start + 3])
        N = acc.numel()
        slots = torch.tensor([5, 1, 3][:N])
        hidden = torch.randn(N, B, d)
        block = torch.randint(0, V, (N, B))
        verify = torch.randn(N, B, V) * 3
        draft = torch.randn(N, B - 1, V) * 3
        # make some drafts agree with the target's argmax so both feature values occur
        post = verify.argmax(-1)
        block[:, 2::2] = post[:, 1:-1:2]
        anchor_pos = torch.tensor([7, 30, 100][:N])
        if start % 2:  # the loop passes the target argmax it already has; same result either way
            mem.write(slots, hidden, block, verify, draft, acc, anchor_pos, target_argmax=verify.argmax(-1))
        else:
            mem.write(slots, hidden, block, verify, draft, acc, anchor_pos)
        got = mem.read(slots)
        for n in range(N):
            a, s = int(acc[n]), int(slots[n])
            p_next = int(anchor_pos[n]) + a + 1
            assert int(mem.position[s]) == p_next
            assert int(mem.count[s]) == max(0, B - 2 - a)
            # the verify taps of this round sit at positions p .. p+B-1 (index i <-> p + i) and are the
            # next draft call's context: corr_index must point at position p' + k - 1
            for k in range(B):
                j = k + a + 1
                if 1 <= k <= B - 2 - a:
                    assert got.valid[n, k] == 1
                    torch.testing.assert_close(got.memory[n, k], hidden[n, j], rtol=0, atol=0)
                    assert int(anchor_pos[n]) + int(got.corr_index[n, k]) == p_next + k - 1
                    torch.testing.assert_close(got.features[n, k], reference_features(block[n], verify[n], draft[n], j))
                else:
                    assert got.valid[n, k] == 0
                    assert got.memory[n, k].abs().max() == 0 and got.features[n, k].abs().max() == 0
        feats = got.features[got.valid.bool()]
        if feats.numel():
            assert feats.shape[-1] == len(FEATURES)
    # release: cleared completely (a stale corr_index must not survive: the drafter gathers with it)
    mem.write(torch.tensor([2]), torch.randn(1, B, d), torch.randint(0, V, (1, B)), torch.randn(1, B, V),
              torch.randn(1, B - 1, V), torch.tensor([0]), torch.tensor([4]))
    before = mem.read(torch.tensor([5]))
    mem.clear(2)
    cleared = mem.read(torch.tensor([2]))
    assert cleared.valid.sum() == 0 and cleared.memory.abs().sum() == 0 and cleared.features.abs().sum() == 0
    assert cleared.corr_index.abs().sum() == 0
    assert int(mem.count[2]) == 0 and int(mem.position[2]) == -1
    after = mem.read(torch.tensor([5]))  # other slots untouched
    for x, y in zip((before.memory, before.valid, before.corr_index), (after.memory, after.valid, after.corr_index),
                    strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# -- end to end: what the scheduler feeds the drafter ---------------------------------------------------------
class SuffixSpy(OracleDrafter):
    """Checks every retrace draft call against the previous call for the same slot: the memory must be
    that call's hidden states shifted by a + 1, the correction index must point at position p' + k - 1,
    and only the drafts the target scored are remembered: old slots j <= min(K+1, B-1) for a verify of K
    drafts (K = the length of that verify call - 1); nothing after a round without a draft call."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.last: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> (anchor position, drafter hidden)
        self.verified: dict[int, int | None] = {}  # slot -> K of its last verify (None: no draft call)
        self.drafted: set[int] = set()  # slots drafted since their last verify
        self.checked = {"rounds": 0, "valid_slots": 0, "accepted": set(), "verified": set()}

    def target(self, slots, input_ids, positions, logits_index):
        prefill = bool((positions[:, 0] == 0).all())
        for s in slots.tolist():
            if prefill:  # a new request in these slots
                self.last.pop(s, None)
                self.verified[s] = None
            else:
                self.verified[s] = input_ids.shape[1] - 1 if s in self.drafted else None
            self.drafted.discard(s)
        return super().target(slots, input_ids, positions, logits_index)

    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        B = block_ids.shape[1]
        for n, s in enumerate(slots.tolist()):
            self.drafted.add(s)
            p_new = int(block_positions[n, 0])
            K = self.verified.get(s)
            if s not in self.last or K is None:  # first round of a request, or no draft last round
                assert suffix.valid[n].sum() == 0
                continue
            p_old, h_old = self.last[s]
            W = h_old.shape[0]  # the last round's block width (the verify policy's draft width)
            a = p_new - p_old - 1
            assert 0 <= a <= K <= W - 1
            self.checked["accepted"].add(a)
            self.checked["verified"].add(K)
            self.checked.setdefault("widths", set()).update({W, B})
            for k in range(B):
                if 1 <= k and k + a + 1 <= min(K + 1, W - 1):
                    assert suffix.valid[n, k] == 1
                    torch.testing.assert_close(suffix.memory[n, k], h_old[k + a + 1], rtol=0, atol=0)
                    assert int(ctx_positions[n, int(suffix.corr_index[n, k])]) == p_new + k - 1
                    self.checked["valid_slots"] += 1
                else:
                    assert suffix.valid[n, k] == 0
            self.checked["rounds"] += 1
        hidden, logits = super().draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)
        for n, s in enumerate(slots.tolist()):
            self.last[s] = (int(block_positions[n, 0]), hidden[n].clone())
        return hidden, logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    with single_thread():
        root = tmp_path_factory.mktemp("suffix")
        target, drafter = write_pair(root, vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48,
                                     block_size=8, tokenizer=False, seed=1)
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 63, (n,), generator=g).tolist() for n in (4, 1, 9, 2, 6)]
        rt = Runtime.from_dirs(target, drafter, max_batch=8, max_seq_len=128)
        ref = rt.generate(prompts, SamplingParams(max_new_tokens=60), "ar")  # == transformers (greedy tests)
        seqs = {tuple(p): p + r.token_ids for p, r in zip(prompts, ref, strict=True)}
        yield target, drafter, prompts, seqs


@pytest.mark.parametrize("policy", ["fixed", "adaptive", "adaptive-ragged"])
def test_scheduler_feeds_aligned_memory(pair, policy):
    target, drafter, prompts, seqs = pair
    B = 8
    verify_policy = "fixed" if policy == "fixed" else steep_cost_policy(B, ragged=policy.endswith("ragged"))
    with single_thread():
        spy = SuffixSpy(TorchBackend.from_dirs(target, drafter, max_batch=3, max_seq_len=128), seqs, seed=5)
        rt = Runtime(spy, verify_policy=verify_policy)  # 5 requests in 3 slots: slots reused mid-run
        sched = rt.scheduler()
        reqs = [sched.add(p, SamplingParams(max_new_tokens=40), "retrace") for p in prompts]
        anchor_before: dict[int, int] = {}
        hist_before: dict[int, list[int]] = {}
        while sched.has_work:
            sched.step()
            for r in sched.running.values():  # position bookkeeping after every round
                # this row's own K (ragged: may be less than the verify call's length - 1)
                hist = r.stats.verify_hist + [0] * B
                old = hist_before.get(r.rid, []) + [0] * (len(hist) - len(hist_before.get(r.rid, [])))
                hist_before[r.rid] = list(r.stats.verify_hist)
                if spy.verified.get(r.slot) is not None:
                    spy.verified[r.slot] = next(k for k, (x, y) in enumerate(zip(hist, old, strict=True)) if x != y)
                if r.rid in anchor_before:
                    a = r.anchor_pos - anchor_before[r.rid] - 1
                    K = spy.verified[r.slot]
                    assert int(sched.memory.position[r.slot]) == (r.anchor_pos if K is not None else -1)
                    W = spy.last[r.slot][1].shape[0] if r.slot in spy.last else B  # its block width
                    assert int(sched.memory.count[r.slot]) == (0 if K is None else max(0, min(K + 1, W - 1) - a - 1))
                anchor_before[r.rid] = r.anchor_pos
        # released slots are empty
        assert sched.memory.valid.sum() == 0 and sched.memory.count.sum() == 0
        assert (sched.memory.position == -1).all()
    for r, p in zip(reqs, prompts, strict=True):
        assert r.output_ids == seqs[tuple(p)][len(p):len(p) + 40]
    assert spy.checked["valid_slots"] > 0 and spy.checked["rounds"] > 10
    if policy == "fixed":
        assert spy.checked["accepted"] == set(range(B))  # including a = B-2 and all-accepted
        assert spy.checked["verified"] == {B - 1}
    else:  # drafted-but-unverified slots occurred and were left out of the memory; narrower blocks too
        assert len(spy.checked["verified"] - {B - 1}) >= 2, spy.checked
        assert len(spy.checked["widths"]) >= 2, spy.checked  # the draft width's exploration (draft_width.py)


@pytest.mark.parametrize("B", [4, 8])
def test_write_keeps_only_the_drafts_the_target_scored(B):
    """Verify policy: row n sent K_n < B-1 drafts (a padded verify of max K + 1 slots; S drafted slots).
    Remembered: old slots j = a+2 .. min(K_n+1, S) with the same memory / features / correction as a full
    verify would give them; the drafted-but-unscored ones after them are invalid and zero."""
    torch.manual_seed(B)
    d, V = 5, 11
    for S in (B - 1, B - 2):
        rows = [(a, K) for K in range(S + 1) for a in range(K + 1)]
        N = len(rows)
        mem = SuffixMemory(N, B, d)
        acc = torch.tensor([a for a, _ in rows])
        ver = torch.tensor([K for _, K in rows])
        Kmax = int(ver.max())
        hidden = torch.randn(N, B, d)
        block = torch.randint(0, V, (N, S + 1))
        verify = torch.randn(N, Kmax + 1, V) * 3
        draft = torch.randn(N, S, V) * 3
        anchor_pos = torch.arange(N) * 3
        mem.write(torch.arange(N), hidden, block, verify, draft, acc, anchor_pos, verify.argmax(-1), ver)
        got = mem.read(torch.arange(N))
        for n, (a, K) in enumerate(rows):
            last = min(K + 1, S)
            for k in range(B):
                j = k + a + 1
                if k >= 1 and j <= last:
                    assert got.valid[n, k] == 1, (a, K, k)
                    torch.testing.assert_close(got.memory[n, k], hidden[n, j], rtol=0, atol=0)
                    assert int(got.corr_index[n, k]) == k + a  # the verify slot that scored d_j (<= K)
                    torch.testing.assert_close(got.features[n, k], reference_features(block[n], verify[n], draft[n], j))
                else:
                    assert got.valid[n, k] == 0, (a, K, k)
                    assert got.memory[n, k].abs().max() == 0 and got.features[n, k].abs().max() == 0
            assert int(mem.count[n]) == max(0, last - a - 1)
    # a round without a draft call empties the memory of its rows
    mem.write(torch.tensor([0, 2]), None, block[:2, :1], verify[:2, :1], None, torch.zeros(2, dtype=torch.int64),
              anchor_pos[:2])
    assert mem.valid[[0, 2]].sum() == 0 and int(mem.position[0]) == -1


@pytest.mark.parametrize("N", [1, 5])
def test_write_features_are_the_bits_of_suffix_features(N):
    """The write computes the features at the kept slots only (softmaxes over the rows some row keeps, when
    the round's host values say which): the same bits as `suffix_features` over the whole block gathered by
    the alignment, the previous write and what the zoo's conditioner was trained on; memory, valid,
    correction index and count as `align` gives them."""
    from retrace.runtime.device import index_tensor
    from retrace.runtime.suffix_memory import suffix_features

    B, d, V = 8, 5, 300
    g = torch.Generator().manual_seed(N)
    checked = 0
    for S in (B - 1, B - 3):
        for _ in range(12):
            acc = torch.randint(0, S + 1, (N,), generator=g)
            ver = torch.minimum(acc + torch.randint(0, S + 1, (N,), generator=g), torch.tensor(S))
            K = int(ver.max())
            hidden = torch.randn(N, B, d, generator=g)
            block = torch.randint(0, V, (N, S + 1), generator=g)
            verify = torch.randn(N, K + 1, V, generator=g) * 4
            draft = torch.randn(N, S, V, generator=g) * 4
            block[:, 1: K + 1] = torch.where(torch.rand(N, K, generator=g) < 0.5, verify[:, :K].argmax(-1),
                                             block[:, 1: K + 1])
            pos = torch.randint(0, 50, (N,), generator=g)
            old, valid, corr = align(acc, B, ver.clamp_max(S - 1))
            L = min(K + 1, S)
            feats = suffix_features(block[:, : L + 1], verify, draft[:, :L], verify.argmax(-1))
            want = torch.gather(feats, 1, old.unsqueeze(-1).expand(-1, -1, 3)) * valid.unsqueeze(-1).float()
            for hint in (False, True):  # without the host values: every row's softmax
                mem = SuffixMemory(N, B, d)
                slots = index_tensor(list(range(N)), torch.device("cpu"))
                v = index_tensor(ver.tolist(), torch.device("cpu")) if hint else ver
                mem.write(slots, hidden, block, verify, draft, acc, pos, verify.argmax(-1), v,
                          acc.tolist() if hint else None)
                assert torch.equal(mem.features, want) and not mem.features.signbit().any()
                assert torch.equal(mem.valid, valid.float()) and torch.equal(mem.corr_index, corr)
                assert torch.equal(mem.count, valid.sum(1)) and torch.equal(mem.position, pos + acc + 1)
                checked += int(valid.sum())
    assert checked > 50
    for b in BLOCKS:  # the host copy of the counts the write uses to pick the rows
        m = SuffixMemory(1, b, 2)
        assert m._count_host == m._valid.sum(1).to(torch.int64).tolist()
