"""The engine (retrace/runtime/serving_engine.py) embedded in an asyncio app, no HTTP: 32 concurrent requests
(streamed with `async for` or awaited whole) decode exactly what the offline `Runtime.generate` does, batched
together; cancellation frees the slot; back-pressure, bad requests, drain and hard shutdown."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from export_fixtures import MAX_BATCH, VOCAB, pair_and_bundle
from runtime_fixtures import single_thread, words

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.serving_engine import Engine
from retrace.runtime.serving_handle import EngineClosed, EngineFull, RequestCancelled, RequestRejected

N = 32
MAX_NEW = 12


@pytest.fixture(scope="module")
def world():
    with single_thread():
        built = pair_and_bundle()
        g = torch.Generator().manual_seed(5)
        lens = torch.randint(1, 20, (N,), generator=g).tolist()
        prompts = [words(torch.randint(0, VOCAB, (n,), generator=g).tolist()) for n in lens]
        ref = Runtime.from_bundle(built.bundle, threads=1).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
        yield built, prompts, ref


def slow_engine(built, delay_s: float, **kw) -> Engine:
    """An engine whose rounds take at least delay_s (so a test can act while requests run)."""
    eng = Engine(Runtime.from_bundle(built.bundle, threads=1), **kw)
    step = eng.sched.step

    def slow_step():
        time.sleep(delay_s)
        return step()

    eng.sched.step = slow_step
    return eng


def test_asyncio_app_32_concurrent_requests_exact(world):
    built, prompts, ref = world
    engine = Engine(Runtime.from_bundle(built.bundle, threads=1)).start()

    async def one(i: int):
        h = engine.submit(prompts[i], SamplingParams(max_new_tokens=MAX_NEW))
        if i % 2:
            return await h
        ids, text = [], ""
        async for ev in h:
            ids += ev.token_ids
            text += ev.text
        res = h.result(0)
        assert (ids, text) == (res.token_ids, res.text)
        return res

    async def app():
        return await asyncio.gather(*(one(i) for i in range(N)))

    try:
        results = asyncio.run(app())
    finally:
        engine.shutdown()
    for i, (r, w) in enumerate(zip(results, ref, strict=True)):
        assert (r.token_ids, r.text, r.finish_reason) == (w.token_ids, w.text, "length"), f"request {i}"
    assert 1 < engine.max_batch_seen <= MAX_BATCH
    snap = engine.metrics.snapshot()["retrace"]
    assert snap["requests"] == N and snap["tokens"] == N * MAX_NEW
    assert engine.snapshot()["outstanding"] == 0 and not engine.running


def test_cancel_backpressure_bad_requests_and_drain(world):
    built, prompts, ref = world
    engine = slow_engine(built, 0.01, max_queue=1).start()
    long = SamplingParams(max_new_tokens=100)
    try:
        handles = [engine.submit(prompts[0], long, mode="ar") for _ in range(MAX_BATCH + 1)]
        with pytest.raises(EngineFull, match="retry later"):
            engine.submit(prompts[0], long, mode="ar")
        for bad, match in (({"mode": "bogus"}, "unknown mode"), ({"params": SamplingParams(max_new_tokens=200)},
                                                                   "exceeds the configured max length")):
            with pytest.raises(RequestRejected, match=match):
                engine.submit(prompts[1], **{"params": long, **bad})
        # a streaming consumer that cancels: its iteration ends, its slot goes to the queued request
        got = []
        for ev in handles[0]:
            got += ev.token_ids
            if len(got) >= 3:
                handles[0].cancel()
        with pytest.raises(RequestCancelled):
            handles[0].result(5)
        deadline = time.monotonic() + 10
        while handles[-1].t_first is None and time.monotonic() < deadline:  # the queued one got the slot
            time.sleep(0.005)
        assert handles[-1].t_first is not None and not any(h.done for h in handles[1:])
        assert engine.cancelled == 1 and engine.snapshot()["outstanding"] == MAX_BATCH
        # a task cancelled while awaiting cancels its request
        async def wait(h):
            return await h

        async def abandon():
            h = engine.submit(prompts[2], long, mode="ar")
            task = asyncio.ensure_future(wait(h))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return h

        h = asyncio.run(abandon())
        with pytest.raises(RequestCancelled):
            h.result(5)
        # drain: shutdown finishes what is in flight, whole; later submits are refused
        short = engine.submit(prompts[3], SamplingParams(max_new_tokens=MAX_NEW))
    finally:
        engine.shutdown(drain=True)
    assert short.result(0).token_ids == ref[3].token_ids
    assert all(len(h.result(0).token_ids) == 100 for h in handles[1:])
    with pytest.raises(EngineClosed):
        engine.submit(prompts[0], long)
    assert engine.metrics.snapshot()["ar"]["finish_reasons"] == {"cancelled": 2, "length": MAX_BATCH}


def test_hard_shutdown_fails_in_flight(world):
    built, prompts, _ = world
    engine = slow_engine(built, 0.01).start()
    handles = [engine.submit(prompts[i], SamplingParams(max_new_tokens=100), mode="ar") for i in range(6)]
    time.sleep(0.05)
    engine.shutdown(drain=False)
    assert not engine.running
    for h in handles:
        with pytest.raises(EngineClosed, match="shutting down"):
            h.result(0)
        with pytest.raises(EngineClosed):
            list(h)


def test_engine_is_the_embedding_api_name_of_the_serving_engine():
    """`Engine` (README's embedding API) and `ServingEngine` (what the package calls it) are one class."""
    from retrace.runtime import Engine as Exported
    from retrace.runtime import ServingEngine

    assert Exported is Engine is ServingEngine
