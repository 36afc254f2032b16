"""`retrace serve` under hostile input (issue 28, items 1-4, 9 (chat templates), 11, 14): one request whose
distribution cannot be sampled gets its own 400 (a stream: an error event and [DONE]) while its batch-mates
get exactly their texts served alone; bodies, prompts and stop lists are bounded (413/400, OpenAI-style,
refused before the tokenizer is called); tokenizing and chat templates run off the event loop, so /health
answers while one is slow, and a template stuck in a loop is stopped at its time limit; lone surrogates,
raising templates, JSON type errors get clear 4xx; SIGTERM past the drain timeout answers 503 / an error
event and [DONE]."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import pytest
import torch
from export_fixtures import VOCAB, pair_and_bundle
from helpers import http_json, serving
from runtime_fixtures import PoisonedRows, single_thread, words

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

import retrace.cli  # noqa: E402, F401  (before retrace.serve.cli: their import cycle starts here)
from retrace.errors import RetraceError  # noqa: E402
from retrace.runtime import Runtime, SamplingParams  # noqa: E402
from retrace.runtime.serving_engine import Engine  # noqa: E402
from retrace.serve.app import Service, create_app  # noqa: E402
from retrace.serve.chat import ChatTemplate  # noqa: E402
from retrace.serve.cli import _server_class  # noqa: E402
from retrace.serve.limits import ServeLimits  # noqa: E402

MARKER = 5
MAX_NEW = 30
SLOW = "t9x t9x t9x t9x"  # the tokenizer blocks on this prompt until the test lets it go
TEMPLATE = ("{% for m in messages %}{% if m['content'] == 'LOOP' %}{% for i in range(100000) %}"
            "{% for j in range(100000) %}{% endfor %}{% endfor %}{% elif m['content'] == 'RAISE' %}"
            "{{ raise_exception('this template refuses RAISE') }}{% elif m['content'] == 'UNDEF' %}"
            "{{ nothing.attr }}{% endif %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t1x{% endif %}")


class GatedCodec:
    """The real tokenizer, counting its calls; on SLOW it waits until `release` is set."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text):
        self.calls += 1
        if text == SLOW:
            self.entered.set()
            self.release.wait(30)
        return self.inner.encode(text)


def slow_steps(engine, delay_s):
    step = engine.sched.step
    engine.sched.step = lambda: (time.sleep(delay_s), step())[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with single_thread():
        built = pair_and_bundle()
        g = torch.Generator().manual_seed(21)
        prompts = [words([t for t in torch.randint(0, VOCAB, (n,), generator=g).tolist() if t != MARKER] or [1])
                   for n in (6, 11, 3)]
        ref = Runtime.from_bundle(built.bundle, threads=1)
        alone = [ref.generate([p], SamplingParams(max_new_tokens=MAX_NEW))[0].text for p in prompts]
        rt = Runtime.from_bundle(built.bundle, threads=1)
        rt.backend = PoisonedRows(rt.backend, MARKER, after=1)
        tmpl = tmp_path_factory.mktemp("chat") / "chat.jinja"
        tmpl.write_text(TEMPLATE)
        engine = Engine(rt)
        engine.codec = GatedCodec(engine.codec)
        svc = Service(engine, "tiny", ChatTemplate.load(built.bundle / "tokenizer", tmpl),
                      limits=ServeLimits(work_timeout_s=1.0))
        with serving(create_app(svc)) as (server, thread, port):
            yield built, prompts, alone, svc, port, ref


def post(port, body, path="/v1/completions", **kw):
    return http_json(port, "POST", path, body, **kw)


def sse(raw: str) -> list:
    return [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]


def test_unsampleable_row_fails_alone_batch_mates_exact(world):
    built, prompts, alone, svc, port, ref = world
    slow_steps(svc.engine, 0.02)
    bad = {"prompt": words([MARKER, 8, 9]), "max_tokens": MAX_NEW, "temperature": 0.8, "seed": 1}
    bodies = [{"prompt": prompts[0], "max_tokens": MAX_NEW, "temperature": 0},
              {"prompt": prompts[1], "max_tokens": MAX_NEW, "temperature": 1e-38},  # below the floor: greedy
              {"prompt": prompts[2], "max_tokens": MAX_NEW, "temperature": 0, "stream": True},
              bad, {**bad, "stream": True}]
    out: list = [None] * len(bodies)

    def one(i):
        out[i] = post(port, bodies[i], parse=not bodies[i].get("stream"))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    try:
        for t in threads:
            t.start()
            time.sleep(0.05)  # in order: the bad ones join while the others run
        for t in threads:
            t.join(120)
    finally:
        svc.engine.sched.step = type(svc.engine.sched).step.__get__(svc.engine.sched)
    for i in (0, 1):
        assert out[i][0] == 200 and out[i][1]["choices"][0]["text"] == alone[i], out[i]
    status, raw = out[2]
    events = sse(raw)
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == alone[2]
    status, err = out[3]
    assert status == 400 and "cannot be sampled" in err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    status, raw = out[4]
    events = sse(raw)
    assert events[-1] == "[DONE]" and "cannot be sampled" in json.loads(events[-2])["error"]["message"]


def test_sizes_are_bounded_before_the_tokenizer(world):
    built, prompts, alone, svc, port, ref = world
    codec = svc.engine.codec
    calls = codec.calls
    big = json.dumps({"prompt": "t1x " * 3_000_000, "max_tokens": 4})  # 12 MB
    t0 = time.perf_counter()
    status, out = post(port, big)
    print(f"12 MB prompt: {status} in {time.perf_counter() - t0:.3f} s")
    assert status == 413 and out["error"]["code"] == "request_too_large" and set(out["error"]) == {
        "message", "type", "param", "code"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # chunked: no Content-Length to refuse by
    conn.request("POST", "/v1/completions", body=iter([b'{"prompt": "'] + [b"t1x " * 2**18] * 40 + [b'"}']),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    conn.close()
    for body, path, param in (
        ({"prompt": "t1x " * 300_000}, "/v1/completions", "prompt"),  # 1.2 M characters, a 1.2 MB body
        ({"messages": [{"role": "user", "content": "t1x " * 150_000}] * 2}, "/v1/chat/completions", "messages"),
    ):
        status, out = post(port, body, path)
        assert status == 400 and out["error"]["param"] == param and "1000000" in out["error"]["message"], out
    assert codec.calls == calls  # nothing above reached the tokenizer
    for stop, needle in ((["a"] * 5, "at most 4"), (["x" * 300], "at most 256 characters")):
        status, out = post(port, {"prompt": "t1x", "stop": stop})
        assert status == 400 and needle in out["error"]["message"] and out["error"]["param"] == "stop"
    status, out = post(port, {"prompt": "t1x " * 200, "max_tokens": 4})  # too many tokens
    assert status == 400 and "exceeds the configured max length" in out["error"]["message"]


def test_health_answers_while_a_prompt_is_tokenized(world):
    built, prompts, alone, svc, port, ref = world
    codec = svc.engine.codec
    codec.entered.clear()
    codec.release.clear()
    got = {}
    t = threading.Thread(target=lambda: got.update(r=post(port, {"prompt": SLOW, "max_tokens": 4})))
    t.start()
    try:
        assert codec.entered.wait(30)  # the tokenizer is now busy with SLOW
        t0 = time.perf_counter()
        status, out = http_json(port, "GET", "/health")
        print(f"/health while tokenizing: {time.perf_counter() - t0:.3f} s")
        assert status == 200 and out["status"] == "ok" and "r" not in got
        t.join(30)  # nobody lets it go: the time limit answers
        assert got["r"][0] == 400 and "did not finish within 1 s" in got["r"][1]["error"]["message"]
    finally:
        codec.release.set()
        t.join(30)
    status, out = post(port, {"prompt": prompts[0], "max_tokens": MAX_NEW, "temperature": 0})
    assert status == 200 and out["choices"][0]["text"] == alone[0]


@pytest.mark.parametrize("content, needle", [
    ("LOOP", "the chat template did not finish within 1 s"),
    ("RAISE", "TemplateError: this template refuses RAISE"),
    ("UNDEF", "UndefinedError"),
])
def test_chat_template_that_loops_or_raises_is_a_400(world, content, needle):
    built, prompts, alone, svc, port, ref = world
    status, out = post(port, {"messages": [{"role": "user", "content": content}]}, "/v1/chat/completions")
    assert status == 400 and needle in out["error"]["message"], out
    assert http_json(port, "GET", "/health")[0] == 200


@pytest.mark.parametrize("raw, path", [
    ('{"prompt": "\\ud800abc"}', "/v1/completions"),
    ('{"prompt": "\\ud800abc", "stream": true}', "/v1/completions"),
    ('{"prompt": "t1x", "model": "\\ud800"}', "/v1/completions"),
    ('{"prompt": "t1x", "stop": ["\\udfff"]}', "/v1/completions"),
    ('{"messages": [{"role": "user", "content": "\\ud800abc"}]}', "/v1/chat/completions"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}], "stream": true}',
     "/v1/chat/completions"),
])
def test_lone_surrogates_get_a_400(world, raw, path):
    built, prompts, alone, svc, port, ref = world
    status, out = post(port, raw, path)
    assert status == 400 and "lone surrogate" in out["error"]["message"], out


@pytest.mark.parametrize("raw, param", [
    ('{"prompt": "t1x", "max_tokens": true}', "max_tokens"),
    ('{"prompt": "t1x", "max_tokens": 2.5}', "max_tokens"),
    ('{"prompt": "t1x", "top_k": 2.5}', "top_k"),
    ('{"prompt": "t1x", "temperature": "0.5"}', "temperature"),
    ('{"prompt": "t1x", "temperature": NaN}', "temperature"),
    ('{"prompt": "t1x", "stop": [1]}', "stop.str"),
    ('{"prompt": "t1x", "stream": "yes"}', "stream"),
    ('{"prompt": "t1x", "max_tokens": 4', None),  # malformed JSON: no byte offset as the param
])
def test_json_types_are_not_coerced(world, raw, param):
    built, prompts, alone, svc, port, ref = world
    status, out = post(port, raw)
    assert status == 422 and out["error"]["param"] == param, out
    if param is None:
        assert "not valid JSON" in out["error"]["message"]


def test_tree_budget_room_and_refusal(world):
    built, prompts, alone, svc, port, ref = world
    rt = Runtime.from_bundle(built.bundle, threads=1, tree_budget=12)
    tree_svc = Service(Engine(rt), "tiny")
    ids = rt.encode(prompts[0])
    fits = tree_svc.max_seq_len - len(ids) - tree_svc.reserve  # what a chat request without max_tokens gets
    rt.scheduler().check(ids, SamplingParams(max_new_tokens=fits))
    with pytest.raises(RetraceError, match=rf"prompt of {len(ids)} tokens \+ max_new_tokens {fits + 1} \+ draft "
                                           rf"tree 12 \+ 1 exceeds the configured max length"):
        rt.scheduler().check(ids, SamplingParams(max_new_tokens=fits + 1))
    with pytest.raises(RetraceError, match="tree budget 100000 leaves no room"):
        Runtime.from_bundle(built.bundle, threads=1, tree_budget=100000)


def test_sigterm_past_drain_timeout_answers_503_and_done(world):
    built, prompts, alone, svc, port, ref = world
    engine = Engine(Runtime.from_bundle(built.bundle, threads=1))
    slow_steps(engine, 0.05)  # 100 tokens in ar mode: >= 5 s, far past the drain timeout
    drain_svc = Service(engine, "tiny", drain_s=0.3)
    out: dict = {}
    body = {"prompt": prompts[0], "max_tokens": 100, "mode": "ar"}
    with serving(create_app(drain_svc), _server_class()) as (server, thread, dport):
        server.on_exit = drain_svc.begin_drain
        threads = [threading.Thread(target=lambda: out.update(plain=post(dport, body))),
                   threading.Thread(target=lambda: out.update(stream=post(dport, {**body, "stream": True},
                                                                          parse=False)))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while engine.snapshot()["active"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.snapshot()["active"] == 2
        server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
        for t in threads:
            t.join(60)
        thread.join(60)
        assert not thread.is_alive() and not engine.running  # the server ended by itself
    status, err = out["plain"]
    assert status == 503 and err["error"]["code"] == "unavailable" and "shutting down" in err["error"]["message"]
    status, raw = out["stream"]
    events = sse(raw)
    assert status == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "unavailable"
