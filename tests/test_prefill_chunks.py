"""Chunked prefill (runtime/prefill_chunks.py, `--prefill-chunk`): a long prompt enters the cache over several
steps while the running requests go on with their rounds; the output is the target's own greedy decode, a
seeded sampling request draws what it draws unchunked, and the budget is shared by every new prompt."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from runtime_fixtures import hf_greedy, load_hf_target, write_pair

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.prefill_chunks import next_chunks
from retrace.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")
LONG = [(3 * i) % 120 + 1 for i in range(45)]
SHORT = [5, 9, 2]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_thread):
    return write_pair(tmp_path_factory.mktemp("chunks"), vocab=128, block_size=8, conditioner="random", seed=5)


class CallLog:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def target(self, slots, ids, positions, *args, **kwargs):
        self.calls.append((slots.tolist(), ids.shape[1], positions[:, 0].tolist()))
        return self.inner.target(slots, ids, positions, *args, **kwargs)


def test_the_budget_is_shared_first_admitted_first():
    reqs = [SimpleNamespace(prompt_ids=[0] * n, prefilled=p) for n, p in ((40, 0), (10, 0), (30, 25))]
    assert next_chunks(reqs, None) == [(reqs[0], 0, 40), (reqs[1], 0, 10), (reqs[2], 25, 30)]
    assert next_chunks(reqs, 16) == [(reqs[0], 0, 16)]
    reqs[0].prefilled = 32
    assert next_chunks(reqs, 16) == [(reqs[0], 32, 40), (reqs[1], 0, 8)]


@pytest.mark.parametrize("mode", ["ar", "retrace"])
def test_chunked_prompts_give_the_targets_greedy_tokens(pair, mode):
    be = CallLog(TorchBackend.from_dirs(*pair, max_batch=4, max_seq_len=96))
    rt = Runtime(be, None, prefill_chunk=16)
    outs = rt.generate([LONG, SHORT], SamplingParams(max_new_tokens=12, ignore_eos=True), mode)
    long_prefill = [start[0] for slots, T, start in be.calls if slots == [0] and T > 1][:3]
    assert long_prefill == [0, 16, 32]  # the long prompt (slot 0) in three calls, the short one after it
    hf = load_hf_target(pair[0])
    assert [o.token_ids for o in outs] == [hf_greedy(hf, LONG, 12), hf_greedy(hf, SHORT, 12)]


def test_running_requests_decode_between_a_long_prompts_chunks(pair):
    """A short request is running when a long prompt joins: with chunks of 8 it commits tokens in the steps
    that prefill the long prompt, which gets its first token only after ceil(45 / 8) = 6 steps."""
    be = TorchBackend.from_dirs(*pair, max_batch=2, max_seq_len=96)
    sched = Runtime(be, None, prefill_chunk=8).scheduler()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    short = sched.add(SHORT, params, "ar")
    sched.step()
    long = sched.add(LONG, params, "ar")
    steps = 0
    while not long.output_ids:
        n = len(short.output_ids)
        sched.step()
        steps += 1
        assert len(short.output_ids) == n + 1  # one token every step, the long prompt's chunks beside it
    assert steps == 6 and long.prefilled == len(LONG)


def test_a_seeded_sampling_request_draws_the_same_chunked(pair):
    """With the fixed policy (the adaptive one and prompt lookup first choose from timings, so a seeded sample
    is bit-reproducible only with `fixed`: docs/design.md)."""
    be = TorchBackend.from_dirs(*pair, max_batch=2, max_seq_len=96)
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=11, ignore_eos=True)
    whole = Runtime(be, None, verify_policy="fixed").generate([LONG], params, "retrace")[0].token_ids
    chunked = Runtime(be, None, verify_policy="fixed", prefill_chunk=7).generate([LONG], params, "retrace")
    assert chunked[0].token_ids == whole


def test_chunk_settings_and_the_servers_default(pair):
    """0 (or None) prefills whole prompts, "auto" by device (256 tokens a step on a CPU, 2048 on CUDA; what
    `retrace serve` runs with unless --prefill-chunk is given); anything else is refused with its name."""
    import torch

    from retrace.runtime.options import RuntimeOptions
    from retrace.runtime.prefill_chunks import budget_for

    be = TorchBackend.from_dirs(*pair, max_batch=1, max_seq_len=96)
    assert [Runtime(be, None, prefill_chunk=c).scheduler().prefill_chunk for c in (None, 0, 5, "auto")] == [
        None, None, 5, 256]
    assert (budget_for("auto", torch.device("cuda")), budget_for(0, torch.device("cpu"))) == (2048, None)
    for bad in (-1, "x", 2.5, True):
        with pytest.raises(RetraceError, match="prefill_chunk must be a number of tokens >= 0"):
            Runtime(be, None, prefill_chunk=bad)
    assert RuntimeOptions().serving().prefill_chunk == "auto"
    assert RuntimeOptions(prefill_chunk=0).serving().prefill_chunk == 0


def test_a_request_cancelled_mid_prefill_frees_its_slot_for_the_next(pair):
    """Half of a long prompt in the cache, then the client goes away: the slot's next request (a shorter
    prompt over the stale entries) still decodes the target's own tokens."""
    be = TorchBackend.from_dirs(*pair, max_batch=1, max_seq_len=96)
    sched = Runtime(be, None, prefill_chunk=8).scheduler()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    long = sched.add(LONG, params, "retrace")
    sched.step()
    sched.step()
    assert long.prefilled == 16 and not long.output_ids
    sched.cancel(long)
    short = sched.add(SHORT, params, "retrace")
    while sched.has_work:
        sched.step()
    assert long.finish_reason == "cancelled" and short.slot == -1
    assert short.output_ids == hf_greedy(load_hf_target(pair[0]), SHORT, 12)
