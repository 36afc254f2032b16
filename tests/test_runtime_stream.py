"""Streaming and continuous batching: `Runtime.stream` yields exactly what `generate` returns; requests
that join a running batch (or share it with other modes, or follow a cancelled one in the same slot) get
the same output as alone. The greedy reference here is `ar` mode, which the greedy tests pin to
transformers."""

from __future__ import annotations

import pytest
import torch
from runtime_fixtures import OracleDrafter, write_pair

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.torch_backend import TorchBackend

VOCAB = 96
MAX_NEW = 48


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("stream")
    target, drafter = write_pair(root, vocab=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=64,
                                 block_size=8, conditioner="random", seed=1)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 1, 11, 3)] + [[3]]
    rt = Runtime.from_dirs(target, drafter, max_seq_len=160)
    alone = [rt.generate([p], SamplingParams(max_new_tokens=MAX_NEW + 24), "ar")[0].token_ids for p in prompts]
    seqs = {tuple(p): p + a for p, a in zip(prompts, alone, strict=True)}
    return target, drafter, prompts, [a[:MAX_NEW] for a in alone], seqs


def make(world, oracle=False, max_batch=8, policy="adaptive") -> Runtime:
    target, drafter, _, _, seqs = world
    be = TorchBackend.from_dirs(target, drafter, max_batch=max_batch, max_seq_len=160)
    return Runtime(OracleDrafter(be, seqs) if oracle else be, TextCodec.find(target), verify_policy=policy)


CASES = [
    ("ar", {}, False), ("dflash", {}, False), ("retrace", {}, False), ("retrace", {}, True),
    ("retrace", dict(temperature=0.9, top_p=0.9, seed=3), False), ("dflash", dict(temperature=1.0, seed=4), True),
]


@pytest.mark.parametrize("mode,sampling,oracle", CASES,
                         ids=["ar", "dflash", "retrace", "retrace-oracle", "retrace-sampled", "dflash-sampled-oracle"])
def test_stream_yields_what_generate_returns(world, mode, sampling, oracle):
    prompt = world[2][2]
    params = SamplingParams(max_new_tokens=MAX_NEW, **sampling)
    # a seeded sample is reproducible only when K is: the adaptive policy's K follows wall-clock timings
    policy = "fixed" if sampling else "adaptive"
    (res,) = make(world, oracle, policy=policy).generate([prompt], params, mode)
    events = list(make(world, oracle, policy=policy).stream(prompt, params, mode))
    assert [t for e in events for t in e.token_ids] == res.token_ids
    assert "".join(e.text for e in events) == res.text
    assert res.text and len(res.token_ids) == MAX_NEW
    assert events[-1].finished and not any(e.finished for e in events[:-1])
    assert all(e.token_ids for e in events)
    if oracle:  # several tokens per event
        assert len(events) < MAX_NEW


@pytest.mark.parametrize("mode,oracle", [("dflash", False), ("retrace", False), ("retrace", True)])
def test_request_added_mid_run_equals_alone(world, mode, oracle):
    _, _, prompts, alone, _ = world
    rt = make(world, oracle)
    sched = rt.scheduler()
    a = sched.add(prompts[0], SamplingParams(max_new_tokens=MAX_NEW), mode)
    for _ in range(3):
        sched.step()
    assert not a.finished and len(a.output_ids) >= 3
    b = sched.add(prompts[2], SamplingParams(max_new_tokens=MAX_NEW), mode)
    while sched.has_work:
        sched.step()
    assert a.output_ids == alone[0]
    assert b.output_ids == alone[2]


def test_mixed_modes_share_a_batch(world):
    _, _, prompts, alone, _ = world
    rt = make(world, oracle=True)
    sched = rt.scheduler()
    modes = ["ar", "dflash", "retrace", "retrace"]
    reqs = [sched.add(p, SamplingParams(max_new_tokens=MAX_NEW), m) for p, m in zip(prompts, modes, strict=False)]
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs] == alone[:4]
    assert sched.max_batch_seen == 4


def test_runtime_reuse_after_retrace_run(world):
    """A second generate on the same runtime: slots freed by finished retrace requests (whose suffix
    memory was full) serve new requests with 1-token prompts; outputs equal a fresh runtime's."""
    _, _, prompts, alone, _ = world
    rt = make(world, oracle=True)
    first = rt.generate(prompts[:4], SamplingParams(max_new_tokens=MAX_NEW), "retrace")
    assert [r.token_ids for r in first] == alone[:4]
    again = rt.generate([prompts[4], prompts[1]], SamplingParams(max_new_tokens=MAX_NEW), "retrace")
    assert [r.token_ids for r in again] == [alone[4], alone[1]]


def test_closed_stream_frees_its_slot(world):
    _, _, prompts, alone, _ = world
    rt = make(world, max_batch=1)
    it = rt.stream(prompts[0], SamplingParams(max_new_tokens=MAX_NEW), "retrace")
    next(it)
    next(it)
    it.close()  # client went away: cancelled, slot and suffix memory released
    sched = rt.scheduler()
    assert not sched.running and sched.free_slots == [0]
    (res,) = rt.generate([prompts[3]], SamplingParams(max_new_tokens=MAX_NEW), "retrace")
    assert res.token_ids == alone[3]


@pytest.mark.parametrize("oracle", [False, True], ids=["random-drafter", "oracle-drafter"])
def test_interleaved_streams_each_see_all_their_tokens(world, oracle):
    """Two streams consumed in turn (as an async server would) plus a generate call in between: each step
    commits tokens for every request, and every stream still yields all of its own, in order."""
    _, _, prompts, alone, _ = world
    rt = make(world, oracle)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    streams = {0: rt.stream(prompts[0], params, "retrace"), 2: rt.stream(prompts[2], params, "dflash")}
    got = {k: [] for k in streams}
    texts = {k: "" for k in streams}
    turn = 0
    while streams:
        for k in list(streams):
            try:
                ev = next(streams[k])
            except StopIteration:
                del streams[k]
                continue
            got[k] += ev.token_ids
            texts[k] += ev.text
        turn += 1
        if turn == 2:  # a blocking generate while both streams are open
            assert rt.generate([prompts[3]], params, "retrace")[0].token_ids == alone[3]
    assert got == {0: alone[0], 2: alone[2]}
    codec = rt.codec
    assert texts == {0: codec.decode(alone[0]), 2: codec.decode(alone[2])}
