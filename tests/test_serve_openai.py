"""`retrace serve` on loopback: the official `openai` client (completions and chat, streaming and not) gets
exactly the offline greedy output of `Runtime.generate` on the same bundle; 32 concurrent streaming
clients are exact and batched together; a client that hangs up mid-stream frees its slot; malformed
requests get OpenAI-style errors and the server keeps serving; SIGTERM drains and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from export_fixtures import VOCAB, pair_and_bundle
from helpers import free_port, http_json, serving
from runtime_fixtures import single_thread, words

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from retrace.runtime import Runtime, SamplingParams  # noqa: E402
from retrace.runtime.serving_engine import Engine  # noqa: E402
from retrace.serve.app import Service, create_app  # noqa: E402
from retrace.serve.chat import ChatTemplate  # noqa: E402

N = 32
MAX_NEW = 12
MODEL = "tiny"
# a chat template over the word tokenizer: the messages' words, then t1x as the assistant's cue
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t1x{% endif %}"
CHAT = [{"role": "system", "content": "t3x t4x"}, {"role": "user", "content": "t5x t6x t7x"}]
CHAT_TEXT = "t3x t4x t5x t6x t7x t1x"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    with single_thread():
        built = pair_and_bundle()
        g = torch.Generator().manual_seed(7)
        lens = torch.randint(1, 20, (N,), generator=g).tolist()
        prompts = [words(torch.randint(0, VOCAB, (n,), generator=g).tolist()) for n in lens]
        rt = Runtime.from_bundle(built.bundle, threads=1)
        ref = rt.generate(prompts + [CHAT_TEXT], SamplingParams(max_new_tokens=MAX_NEW))
        tmpl = tmp_path_factory.mktemp("chat") / "chat.jinja"
        tmpl.write_text(TEMPLATE)
        svc = Service(Engine(Runtime.from_bundle(built.bundle, threads=1)), MODEL,
                      ChatTemplate.load(built.bundle / "tokenizer", tmpl))
        with serving(create_app(svc)) as (server, thread, port):
            yield built, prompts, ref, svc, port, rt
    assert not svc.engine.running  # the app's shutdown drained and joined the engine


def request(port: int, method: str, path: str, body=None) -> tuple[int, dict | str]:
    return http_json(port, method, path, body)


def test_openai_client_completions_and_chat_exact(world):
    built, prompts, ref, svc, port, rt = world
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]

    out = client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].text == ref[0].text and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(rt.encode(prompts[0])), MAX_NEW)
    ext = out.usage.model_extra["retrace"]
    assert ext["mode"] == "retrace" and ext["rounds"] == sum(ext["accepted_hist"]) and ext["tau"] >= 1
    # token ids in; streaming
    out = client.completions.create(model=MODEL, prompt=rt.encode(prompts[1]), max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].text == ref[1].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=MAX_NEW, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref[2].text
    assert chunks[-1].choices[0].finish_reason == "length" and len(chunks) > 2

    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].message.content == ref[-1].text and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref[-1].text
    assert chunks[-1].usage.completion_tokens == MAX_NEW

    # stop strings and seeded sampling match the offline runtime too
    stop = ref[3].text.split()[4][:2]
    want = rt.generate([prompts[3]], SamplingParams(max_new_tokens=MAX_NEW, stop=(stop,)))[0]
    out = client.completions.create(model=MODEL, prompt=prompts[3], max_tokens=MAX_NEW, temperature=0, stop=stop)
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "stop"
    # (in `ar` mode: with drafts, how many the adaptive verify policy checks changes the sample path)
    want = rt.generate([prompts[4]], SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9, seed=11), "ar")[0]
    out = client.completions.create(model=MODEL, prompt=prompts[4], max_tokens=MAX_NEW, temperature=0.9, seed=11,
                                    extra_body={"mode": "ar"})
    assert out.choices[0].text == want.text

    status, text = request(port, "GET", "/metrics")
    assert status == 200 and 'retrace_requests_total{finish_reason="length",mode="retrace"}' in text


def test_32_concurrent_streaming_clients_exact_and_batched(world):
    built, prompts, ref, svc, port, rt = world
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

    async def one(i: int):
        text, usage = "", None
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=MAX_NEW, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for c in stream:
            text += c.choices[0].text if c.choices else ""
            usage = c.usage or usage
        return text, usage

    async def run():
        try:
            return await asyncio.gather(*(one(i) for i in range(N)))
        finally:
            await client.close()

    results = asyncio.run(run())
    for i, (text, usage) in enumerate(results):
        assert text == ref[i].text, f"client {i}"
        assert usage.completion_tokens == MAX_NEW
    assert max(u.model_extra["retrace"]["max_batch_seen"] for _, u in results) > 1


def test_client_disconnect_mid_stream_frees_slot(world):
    built, prompts, ref, svc, port, rt = world
    eng = svc.engine
    step = eng.sched.step
    eng.sched.step = lambda: (time.sleep(0.02), step())[1]  # 100 tokens in ar mode: >= 2 s
    try:
        before = eng.cancelled
        body = json.dumps({"model": MODEL, "prompt": prompts[0], "max_tokens": 100, "temperature": 0,
                           "stream": True, "mode": "ar"}).encode()
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        buf = b""
        while buf.count(b"data:") < 2:
            buf += s.recv(4096)
        s.close()  # hang up mid-stream
        deadline = time.monotonic() + 10
        while (eng.cancelled == before or eng.snapshot()["outstanding"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.cancelled == before + 1 and eng.snapshot()["outstanding"] == 0
        assert len(eng.sched.free_slots) == eng.max_batch
    finally:
        eng.sched.step = step
    status, out = request(port, "POST", "/v1/completions", {"prompt": prompts[5], "max_tokens": MAX_NEW,
                                                             "temperature": 0})
    assert status == 200 and out["choices"][0]["text"] == ref[5].text


@pytest.mark.parametrize("body, status, needle", [
    ("{not json", 422, "JSON"),
    ({"max_tokens": 4}, 422, "prompt"),
    ({"prompt": "t1x", "temperature": -1}, 422, "temperature"),
    ({"prompt": "t1x", "max_tokens": 0}, 422, "max_tokens"),
    ({"prompt": "t1x", "mode": "bogus"}, 422, "mode"),
    ({"prompt": "t1x", "n": 2}, 400, "n=2"),
    ({"prompt": ["t1x", "t2x"]}, 400, "batches"),
    ({"prompt": "t1x", "logprobs": 3}, 400, "logprobs"),
    ({"prompt": "t1x", "max_tokens": 1000}, 400, "exceeds"),
    ({"prompt": [VOCAB + 5]}, 400, "token ids"),
    ({"prompt": "t1x", "model": "gpt-4"}, 404, "does not exist"),
])
def test_malformed_requests_get_openai_errors(world, body, status, needle):
    built, prompts, ref, svc, port, rt = world
    got, out = request(port, "POST", "/v1/completions", body)
    assert got == status, out
    err = out["error"]
    assert needle in err["message"] and set(err) == {"message", "type", "param", "code"}
    got, out = request(port, "POST", "/v1/completions", {"prompt": prompts[6], "max_tokens": MAX_NEW,
                                                          "temperature": 0})
    assert got == 200 and out["choices"][0]["text"] == ref[6].text


def test_other_errors_and_health(world):
    built, prompts, ref, svc, port, rt = world
    got, out = request(port, "GET", "/v1/nope")
    assert got == 404 and "error" in out
    chat, svc.chat = svc.chat, None
    try:
        got, out = request(port, "POST", "/v1/chat/completions", {"messages": CHAT})
        assert got == 400 and out["error"]["code"] == "no_chat_template"
    finally:
        svc.chat = chat
    got, out = request(port, "POST", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]})
    assert got == 400 and out["error"]["param"] == "tools"
    queue, svc.engine.max_queue = svc.engine.max_queue, -svc.engine.max_batch  # full: back-pressure
    try:
        got, out = request(port, "POST", "/v1/completions", {"prompt": "t1x"})
        assert got == 503 and out["error"]["code"] == "unavailable" and "retry later" in out["error"]["message"]
    finally:
        svc.engine.max_queue = queue
    got, out = request(port, "GET", "/health")
    assert got == 200 and out["status"] == "ok" and out["outstanding"] == 0


def test_sigterm_drains_and_exits_0(world):
    built, prompts, ref, svc, port, rt = world
    port = free_port()
    exe = Path(sys.executable).parent / "retrace"
    proc = subprocess.Popen([str(exe), "serve", "--engine", str(built.bundle), "--port", str(port), "--threads", "1",
                             "--no-verify-bundle", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300  # a loaded 2-core machine starts it slowly (imports, ORT sessions)
        while True:
            assert proc.poll() is None, f"retrace serve exited with {proc.returncode}: {proc.stdout.read()}"
            assert time.monotonic() < deadline, "retrace serve did not become healthy in 300 s"
            try:
                if request(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        want = rt.generate([prompts[7]], SamplingParams(max_new_tokens=100))[0].text
        stream = client.completions.create(model=built.bundle.name, prompt=prompts[7], max_tokens=100,
                                           temperature=0, stream=True, extra_body={"mode": "ar"})
        chunks = iter(stream)
        text = next(chunks).choices[0].text
        proc.send_signal(signal.SIGTERM)  # in flight: the stream still completes
        text += "".join(c.choices[0].text for c in chunks)
        assert text == want
        assert proc.wait(60) == 0, proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
