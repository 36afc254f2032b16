"""Prompts admitted together are prefilled in calls of similar lengths (runtime/prefill_groups.py): the
grouping rule, and a batch of short and long prompts that takes several calls and still gives the target's
own greedy tokens, first tokens committed in admission order after one read."""

from __future__ import annotations

import pytest
import torch
from runtime_fixtures import hf_greedy, load_hf_target, write_pair

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.prefill_groups import CPU_FREE_ROWS, CUDA_FREE_ROWS, free_rows_for, prefill_groups
from retrace.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")


def padded(lengths, groups):
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def test_held_out_prompts_lose_their_padding():
    """The zoo's first 32 held-out prompts at the 0.6B bench's tokenizer, admitted four at a time: one call
    per admission padded 3,932 tokens to 5,144 (+31%); grouped, 4,078 (+3.7%), each call adding at most
    max(8, 1/8 of its tokens)."""
    lengths = [111, 122, 108, 112, 68, 68, 90, 104, 181, 127, 159, 196, 127, 187, 191, 86, 64, 83, 84, 110, 164,
               86, 199, 136, 95, 78, 124, 167, 77, 101, 130, 197]
    before = after = 0
    for b in range(0, 32, 4):
        batch = lengths[b:b + 4]
        groups = prefill_groups(batch)
        assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
        for g in groups:
            real = sum(batch[i] for i in g)
            assert padded(batch, [g]) - real <= max(CPU_FREE_ROWS, real / 8)
        before += 4 * max(batch)
        after += padded(batch, groups)
    assert (sum(lengths), before, after) == (3932, 5144, 4078)


def test_grouping_rule():
    assert prefill_groups([5]) == [[0]]
    assert prefill_groups([7, 7, 7, 7]) == [[0, 1, 2, 3]]  # equal lengths: one call
    assert prefill_groups([3, 1, 4, 2], free_rows=8) == [[0, 1, 2, 3]]  # short prompts: 6 padded rows are cheap
    assert prefill_groups([3, 1, 6, 2], free_rows=8) == [[0, 1, 3], [2]]  # the 6 would pad 12
    assert prefill_groups([200, 20, 199], free_rows=8) == [[1], [0, 2]]  # indices ascending in each call
    assert prefill_groups([100, 10, 100, 10], free_rows=0, slack=0.0) == [[1, 3], [0, 2]]
    assert free_rows_for(torch.device("cpu")) == CPU_FREE_ROWS
    assert free_rows_for(torch.device("cuda")) == CUDA_FREE_ROWS
    with pytest.raises(ValueError, match="positive"):
        prefill_groups([3, 0])


class CallLog:
    """The torch backend, logging each target call's [N, T]."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def target(self, slots, ids, *args, **kwargs):
        self.calls.append(tuple(ids.shape))
        return self.inner.target(slots, ids, *args, **kwargs)


@pytest.mark.parametrize("mode", ["ar", "retrace"])
def test_short_and_long_prompts_prefill_apart_and_stay_exact(tmp_path_factory, mode):
    pair = write_pair(tmp_path_factory.mktemp("prefill"), vocab=128, block_size=8, conditioner="random", seed=5)
    be = CallLog(TorchBackend.from_dirs(*pair, max_batch=4, max_seq_len=96))
    prompts = [[5, 9, 2], [(3 * i) % 120 + 1 for i in range(40)], [7, 1], [(5 * i) % 120 + 2 for i in range(38)]]
    outs = Runtime(be, None).generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True), mode)
    assert be.calls[:2] == [(2, 3), (2, 40)]  # the two short prompts, then the two long ones
    hf = load_hf_target(pair[0])
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
