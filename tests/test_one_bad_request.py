"""One bad request never hurts another (issue 28, items 1 and 13), on the Engine API and the scheduler.

The shared check (retrace/request_validation.py, SamplingParams' validation) refuses NaN/inf/negative or
non-number temperatures, fractional or boolean integers and non-string stops, and makes a temperature below
1e-5 greedy; a request whose distribution cannot be sampled (PoisonedRows: NaN target logits for it alone)
fails alone with a clear error while its batch-mates, greedy and seeded sampling, produce exactly what
they produce served alone; the Engine refuses malformed prompts with RequestRejected and survives a
listener that raises SystemExit."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from export_fixtures import VOCAB, pair_and_bundle
from runtime_fixtures import PoisonedRows, single_thread, words
from triton_fixtures import FakeSink

from retrace.request_validation import TEMPERATURE_FLOOR, InvalidParameter, check_prompt_text
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.serving_engine import Engine
from retrace.runtime.serving_handle import RequestRejected

MARKER = 5  # prompts starting with this token are poisoned
GREEDY = SamplingParams(max_new_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=30, temperature=0.9, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def world():
    with single_thread():
        built = pair_and_bundle()
        g = torch.Generator().manual_seed(11)
        prompts = [words([t for t in torch.randint(0, VOCAB, (n,), generator=g).tolist() if t != MARKER] or [1])
                   for n in (7, 12, 4)]
        alone = [Runtime.from_bundle(built.bundle, threads=1).generate([p], GREEDY)[0] for p in prompts[:2]]
        alone.append(Runtime.from_bundle(built.bundle, threads=1).generate([prompts[2]], SAMPLED, "ar")[0])
        yield built, prompts, alone


@pytest.mark.parametrize("kw, param", [
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.5}, "temperature"), ({"temperature": "0.7"}, "temperature"),
    ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": math.nan}, "top_p"), ({"max_new_tokens": True}, "max_new_tokens"),
    ({"max_new_tokens": 3.0}, "max_new_tokens"), ({"min_tokens": 1.5}, "min_tokens"),
    ({"min_tokens": 500}, "min_tokens"), ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"stop": [1]}, "stop"), ({"stop": ["a"] * 17}, "stop"), ({"stop": ["x" * 257]}, "stop"),
    ({"stop": [""]}, "stop"), ({"stop": ["\ud800"]}, "stop"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_sampling_params_refused_naming_the_parameter(kw, param):
    with pytest.raises(InvalidParameter, match=f"^{param} ") as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_temperature_below_the_floor_is_greedy():
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=TEMPERATURE_FLOOR / 2).greedy
    assert SamplingParams(temperature=TEMPERATURE_FLOOR).temperature == TEMPERATURE_FLOOR
    assert SamplingParams(top_k=np.int64(3), temperature=np.float32(0.5)).top_k == 3  # numpy scalars are numbers
    with pytest.raises(InvalidParameter, match="at most 5 are allowed"):
        check_prompt_text("x" * 6, max_chars=5)
    with pytest.raises(InvalidParameter, match="lone surrogate"):
        check_prompt_text("\ud800abc")


@pytest.mark.parametrize("after", [0, 2], ids=["at-prefill", "in-a-verify-round"])
def test_engine_unsampleable_row_fails_alone(world, after):
    built, prompts, alone = world
    rt = Runtime.from_bundle(built.bundle, threads=1)
    rt.backend = PoisonedRows(rt.backend, MARKER, after=after)
    engine = Engine(rt)
    step = engine.sched.step
    engine.sched.step = lambda: (time.sleep(0.02), step())[1]  # the four overlap
    engine.start()
    try:
        with engine._cv:  # the engine thread takes the four in one batch (no timing race with its first round)
            hs = [engine.submit(prompts[0], GREEDY), engine.submit(prompts[1], GREEDY)]
            bad = engine.submit(words([MARKER, 7, 9]), SamplingParams(max_new_tokens=30, temperature=0.8, seed=1))
            hs.append(engine.submit(prompts[2], SAMPLED, mode="ar"))
        with pytest.raises(RequestRejected, match="cannot be sampled .*temperature 0.8"):
            bad.result(60)
        got = [h.result(60) for h in hs]
    finally:
        engine.shutdown()
    assert rt.backend.poisoned_calls >= 1
    for g, a in zip(got, alone, strict=True):
        assert (g.token_ids, g.text, g.finish_reason) == (a.token_ids, a.text, "length")
    assert max(h.max_batch_seen for h in hs) == 4  # the bad one shared rounds with them
    assert engine.failed == 1 and engine.completed == 3
    assert engine.metrics.snapshot()["retrace"]["finish_reasons"].get("error") == 1


def test_runtime_generate_reports_the_failed_row(world):
    built, prompts, alone = world
    # the fixed verify policy: with drafts, how many the adaptive one verifies changes a seeded sample path
    rt = Runtime.from_bundle(built.bundle, threads=1, verify_policy="fixed")
    rt.backend = PoisonedRows(rt.backend, MARKER, after=1)
    sampled = SamplingParams(max_new_tokens=40, temperature=0.7, seed=2, ignore_eos=True)
    out = rt.generate([prompts[0], words([MARKER, 3]), prompts[1]], sampled, "dflash")
    ref = Runtime.from_bundle(built.bundle, threads=1, verify_policy="fixed").generate(
        [prompts[0], prompts[1]], sampled, "dflash")
    assert out[1].finish_reason == "error" and "cannot be sampled" in out[1].error
    assert [(r.token_ids, r.error) for r in (out[0], out[2])] == [(r.token_ids, None) for r in ref]
    assert not rt.scheduler().running and len(rt.scheduler().free_slots) == rt.backend.max_batch


def test_engine_refuses_malformed_requests(world):
    built, prompts, alone = world
    engine = Engine(Runtime.from_bundle(built.bundle, threads=1)).start()
    try:
        for prompt, needle in ((None, "got NoneType"), (5, "got int"), (np.zeros((2, 2), np.int64), "ndarray"),
                               ("\ud800abc", "lone surrogate"), ([1, True], "got list"), ("x" * 1_000_001,
                                                                                          "at most 1000000")):
            with pytest.raises(RequestRejected, match=needle):
                engine.submit(prompt, GREEDY)
        changed = SamplingParams(max_new_tokens=4)
        changed.temperature = math.nan  # changed after it was checked: checked again
        with pytest.raises(RequestRejected, match="temperature must be a finite number"):
            engine.submit(prompts[0], changed)
        ids = np.array(Runtime.from_bundle(built.bundle, threads=1).encode(prompts[0]))
        assert engine.submit(ids, GREEDY).result(60).token_ids == alone[0].token_ids  # a 1-D array is ids

        class Exits:  # a listener that raises SystemExit ends only its own request
            def on_event(self, h, ev):
                raise SystemExit(3)

        h = engine.submit(prompts[1], GREEDY, listener=Exits())
        with pytest.raises(Exception, match="client went away"):
            h.result(60)
        assert engine.running and engine.submit(prompts[1], GREEDY).result(60).token_ids == alone[1].token_ids
    finally:
        engine.shutdown()
    with pytest.raises(Exception, match="cannot start again: create a new Engine"):
        engine.start()


# ------------------------------------------------------------------------------ the Triton model's loop
def triton_inputs(text, max_tokens, **extra):
    return {"text_input": np.array([text.encode()], dtype=np.object_),
            "max_tokens": np.array([max_tokens], np.int32), **extra}


def test_triton_loop_unsampleable_row_fails_alone(world):
    from retrace.export.triton.serving import Job, RuntimeAdapter, ServingLoop
    from retrace.export.triton.validation import Limits, parse_request

    built, prompts, alone = world
    rt = Runtime.from_bundle(built.bundle, threads=1)
    rt.backend = PoisonedRows(rt.backend, MARKER, after=2)
    adapter = RuntimeAdapter(rt)
    limits = Limits(max_tokens=100, max_seq_len=rt.backend.max_seq_len - adapter.reserve, vocab_size=VOCAB)
    loop = ServingLoop(adapter, limits, max_batch=4)
    step = loop.engine.sched.step
    loop.engine.sched.step = lambda: (time.sleep(0.02), step())[1]
    t = np.array([0.8], np.float32)
    jobs = [(prompts[0], {}), (prompts[1], {"temperature": np.array([1e-38], np.float32)}),  # greedy: below 1e-5
            (words([MARKER, 4]), {"temperature": t, "seed": np.array([1], np.int64)}),
            (words([MARKER, 6]), {"temperature": t, "stream": np.array([True])})]
    sinks = [FakeSink() for _ in jobs]
    loop.start()
    try:
        for (text, extra), sink in zip(jobs, sinks, strict=True):
            spec = parse_request(triton_inputs(text, GREEDY.max_new_tokens, ignore_eos=np.array([True]), **extra),
                                 "", limits)
            loop.submit(Job(spec=spec, sink=sink))
        assert all(s.done.wait(60) for s in sinks)
    finally:
        loop.stop()
    for sink, want in zip(sinks[:2], alone[:2], strict=True):
        assert not sink.errors and sink.responses[-1][:2] == (want.token_ids, want.text)
    for sink in sinks[2:]:
        assert len(sink.errors) == 1 and "cannot be sampled" in sink.errors[0][0] and sink.errors[0][1] == "invalid"
    assert loop.engine.max_batch_seen == 4 and loop.engine.failed == 2


@pytest.mark.parametrize("extra, needle", [
    ({"temperature": np.array([np.nan], np.float32)}, "input 'temperature' must be a finite number"),
    ({"top_p": np.array([0.0], np.float32)}, "input 'top_p' must be in (0, 1]"),
    ({"sampling_parameters": np.array([b'{"top_k": 2.5}'], dtype=np.object_)}, "'top_k' must be an integer"),
    ({"sampling_parameters": np.array([b'{"stop": [1]}'], dtype=np.object_)}, "'stop' must be a string or a list"),
    ({"sampling_parameters": np.array([b'{"seed": -4}'], dtype=np.object_)}, "sampling_parameters 'seed' must be >= 0"),
    ({"text_input": np.array([b"x" * 1_000_001], dtype=np.object_)}, "input 'text_input' has 1000001 characters"),
])
def test_triton_requests_share_the_check(extra, needle):
    from retrace.export.triton.validation import Limits, RequestError, parse_request

    with pytest.raises(RequestError) as e:
        parse_request({**triton_inputs("t1x", 4), **extra}, "", Limits(max_tokens=100))
    assert needle in str(e.value)
