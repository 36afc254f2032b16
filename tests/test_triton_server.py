"""A real tritonserver (CPU, loopback) serving a generated repository with the stand-in runtime."""

from __future__ import annotations

import json
import queue
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from triton_fixtures import (
    MODEL,
    STANDIN_MAX_BATCH,
    STANDIN_MAX_SEQ_LEN,
    as_list,
    fixture_standin_bundle,  # noqa: F401  (pytest fixture)
    fixture_standin_server,  # noqa: F401  (pytest fixture)
    fixture_triton_env,  # noqa: F401  (pytest fixture)
    generate,
    generate_stream,
    http_post,
    requests_total,
    stats_of,
    write_standin_repo,
)

from retrace.export.triton import standin
from retrace.export.triton_server import TritonServer, TritonServerError

expected = standin.expected_output
BUDGET = STANDIN_MAX_SEQ_LEN - standin.StandinScheduler.block_size - 1  # prompt + max_tokens per request


def test_generate_text_ids_and_stats(standin_server):
    status, out = generate(standin_server, {"text_input": "abc", "max_tokens": 10})
    assert status == 200, out
    assert out["text_output"] == expected("abc", 10) == "defghijklm"
    assert as_list(out["output_ids"]) == [ord(c) for c in "defghijklm"]
    st = stats_of(out)
    assert st["completion_tokens"] == 10 and st["prompt_tokens"] == 3 and st["finish_reason"] == "length"
    assert st["rounds"] == sum(st["accepted_hist"]) and st["tau"] == pytest.approx(10 / st["rounds"])
    assert st["max_batch_seen"] >= 1 and st["mode"] == "retrace" and st["runtime"] == "standin"

    # token ids in, every sampling input forwarded to the runtime's SamplingParams
    status, out = generate(standin_server, {"input_ids": [104, 105], "max_tokens": 4, "temperature": 0.5,
                                            "top_p": 0.9, "top_k": 7, "seed": 11, "mode": "dflash"})
    assert status == 200, out
    assert out["text_output"] == "jklm"
    st = stats_of(out)
    assert st["params"] == {"max_new_tokens": 4, "temperature": 0.5, "top_p": pytest.approx(0.9), "top_k": 7,
                            "seed": 11, "stop": [], "ignore_eos": False, "min_tokens": 0}
    assert st["mode"] == "dflash"

    status, out = generate(standin_server, {"text_input": "a", "max_tokens": 50, "stop": ["gh"]})
    assert status == 200 and out["text_output"] == "bcdef" and stats_of(out)["finish_reason"] == "stop"


def test_generate_stream_sse(standin_server):
    status, events = generate_stream(standin_server, {"text_input": "abc", "max_tokens": 20, "stream": True})
    assert status == 200, events
    assert len(events) > 3 and all("error" not in e for e in events)  # one event per committed round
    assert "".join(e["text_output"] for e in events) == expected("abc", 20)
    assert [t for e in events for t in as_list(e["output_ids"])] == [ord(c) for c in expected("abc", 20)]
    assert "stats" not in events[0] and stats_of(events[-1])["completion_tokens"] == 20
    # stream=false on /generate_stream: one event with everything
    status, events = generate_stream(standin_server, {"text_input": "abc", "max_tokens": 20})
    assert status == 200 and len(events) == 1 and events[0]["text_output"] == expected("abc", 20)
    # errors arrive as an error event
    status, events = generate_stream(standin_server, {"text_input": "abc", "max_tokens": 0, "stream": True})
    assert "max_tokens" in json.dumps(events)


def _grpc_inputs(grpcclient, text: str | None, max_tokens: int, stream: bool, **extra):
    """gRPC inputs; text None leaves text_input out (pass input_ids=(array, "INT64") in extra instead)."""
    def mk(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        return t

    inputs = [] if text is None else [mk("text_input", np.array([text.encode()], dtype=np.object_), "BYTES")]
    inputs += [mk("max_tokens", np.array([max_tokens], np.int32), "INT32"),
               mk("stream", np.array([stream]), "BOOL")]
    for name, (arr, dtype) in extra.items():
        inputs.append(mk(name, arr, dtype))
    return inputs


def _grpc_stream_all(grpcclient, url: str, requests: dict[str, list], timeout: float = 120.0) -> dict[str, list]:
    """Send every request on one decoupled gRPC stream; per request id, its responses as (output_ids, text,
    stats or None) tuples, or an error string, up to the one carrying the stats (the last)."""
    results: queue.Queue = queue.Queue()
    got: dict[str, list] = {rid: [] for rid in requests}
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for rid, inputs in requests.items():
            client.async_stream_infer(MODEL, inputs, request_id=rid)
        done: set[str] = set()
        deadline = time.monotonic() + timeout
        while len(done) < len(requests) and time.monotonic() < deadline:
            result, error = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            if error is not None:  # a stream error does not name its request: fail loudly
                raise AssertionError(f"gRPC stream error: {error}")
            rid = result.get_response().id
            ids, text, stats = (result.as_numpy(n) for n in ("output_ids", "text_output", "stats"))
            got[rid].append((ids.tolist() if ids is not None else [],
                             text[0].decode() if text is not None else "",
                             json.loads(stats[0]) if stats is not None else None))
            if stats is not None:
                done.add(rid)
        assert done == set(requests), (done, got)
    finally:
        client.stop_stream()
        client.close()
    return got


def test_grpc_streaming_client(standin_server):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(standin_server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(MODEL, _grpc_inputs(grpcclient, "Hello", 30, True), request_id="s1")
        client.async_stream_infer(MODEL, _grpc_inputs(grpcclient, "xyz", 9, False), request_id="s2")
        client.async_stream_infer(MODEL, _grpc_inputs(grpcclient, "xyz", 0, False), request_id="bad")
        got: dict[str, list] = {"s1": [], "s2": [], "bad": []}
        done: set[str] = set()
        deadline = time.monotonic() + 30
        while len(done) < 3 and time.monotonic() < deadline:
            result, error = results.get(timeout=30)
            if error is not None:
                got["bad"].append(str(error))
                done.add("bad")
                continue
            rid = result.get_response().id
            got[rid].append(result)
            if result.as_numpy("stats") is not None:
                done.add(rid)
        assert done == {"s1", "s2", "bad"}
        text = "".join(r.as_numpy("text_output")[0].decode() for r in got["s1"])
        assert text == expected("Hello", 30) and len(got["s1"]) > 3
        ids = np.concatenate([r.as_numpy("output_ids") for r in got["s1"]]).tolist()
        assert ids == [ord(c) for c in text]
        assert len(got["s2"]) == 1 and got["s2"][0].as_numpy("text_output")[0].decode() == expected("xyz", 9)
        st = json.loads(got["s2"][0].as_numpy("stats")[0])
        assert st["completion_tokens"] == 9
        assert "max_tokens" in got["bad"][0] and "> 0" in got["bad"][0]
    finally:
        client.stop_stream()
        client.close()


def test_grpc_wrong_dtype_and_missing_input(standin_server):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    from tritonclient.utils import InferenceServerException

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(standin_server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        ids = grpcclient.InferInput("input_ids", [3], "INT32")  # the model declares INT64
        ids.set_data_from_numpy(np.array([1, 2, 3], np.int32))
        mt = grpcclient.InferInput("max_tokens", [1], "INT32")
        mt.set_data_from_numpy(np.array([4], np.int32))
        client.async_stream_infer(MODEL, [ids, mt])
        _, error = results.get(timeout=30)
        assert isinstance(error, InferenceServerException) and "input_ids" in str(error)
        assert "INT32" in str(error) or "TYPE_INT32" in str(error)
        client.async_stream_infer(MODEL, _grpc_inputs(grpcclient, "abc", 3, False)[:1])  # text only
        _, error = results.get(timeout=30)
        assert error is not None and "max_tokens" in str(error)
    finally:
        client.stop_stream()
        client.close()


def test_concurrent_clients_are_batched(standin_server):
    n = 32

    def one(i):
        prompt = f"client {i:02d} "
        body = {"text_input": prompt, "max_tokens": 24 + i % 5}
        if i % 3 == 0:
            body["stream"] = True
            status, events = generate_stream(standin_server, body)
            text = "".join(e.get("text_output", "") for e in events)
            return i, status, text, stats_of(events[-1]) if events and "stats" in events[-1] else events
        status, out = generate(standin_server, body)
        return i, status, out.get("text_output"), stats_of(out) if "stats" in out else out

    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=n) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.monotonic() - t0
    batches = []
    for i, status, text, st in results:
        assert status == 200, (i, st)
        assert text == expected(f"client {i:02d} ", 24 + i % 5), i
        batches.append(st["max_batch_seen"])
    # requests share rounds: the scheduler ran up to its max_batch, never above
    assert max(batches) == STANDIN_MAX_BATCH and all(1 <= b <= STANDIN_MAX_BATCH for b in batches)
    print(f"\n[triton] {n} concurrent clients in {wall:.2f} s, max_batch_seen per request {sorted(batches)}")


MALFORMED = [
    ({"max_tokens": 5}, "missing prompt"),
    ({"text_input": "abc"}, "missing input 'max_tokens'"),
    ({"text_input": "abc", "input_ids": [1], "max_tokens": 5}, "not both"),
    ({"text_input": "", "max_tokens": 5}, "empty prompt"),
    ({"input_ids": [], "max_tokens": 5}, "empty prompt"),
    ({"input_ids": [1, 500], "max_tokens": 5}, "token id 500 outside [0, 128)"),
    ({"text_input": "abc", "max_tokens": 0}, "'max_tokens' must be > 0"),
    ({"text_input": "abc", "max_tokens": -3}, "'max_tokens' must be > 0"),
    ({"text_input": "abc", "max_tokens": 100000}, "above this model's limit"),
    ({"text_input": "abc", "max_tokens": 3000000000}, "'max_tokens'"),  # wraps to a negative INT32
    ({"text_input": "x" * 400, "max_tokens": BUDGET - 300}, "exceeds the model's token budget"),
    ({"text_input": "abc", "max_tokens": 5, "temperature": -1}, "'temperature' must be >= 0"),
    ({"text_input": "abc", "max_tokens": 5, "top_p": 0}, "'top_p' must be in (0, 1]"),
    ({"text_input": "abc", "max_tokens": 5, "top_p": 1.01}, "'top_p' must be in (0, 1]"),
    ({"text_input": "abc", "max_tokens": 5, "top_k": -2}, "'top_k' must be >= 0"),
    ({"text_input": "abc", "max_tokens": 5, "mode": "fast"}, "unknown mode 'fast'"),
    ({"text_input": "abc", "max_tokens": 5, "stop": [""]}, "'stop' contains an empty string"),
    ({"text_input": "abc", "max_tokens": 5, "temprature": 0.5}, "unknown request parameter(s) 'temprature'"),
    ({"text_input": "__reject__", "max_tokens": 5}, "runtime rejected the request"),
]


@pytest.mark.parametrize(("body", "needle"), MALFORMED, ids=[m[1][:30] for m in MALFORMED])
def test_malformed_request_gets_named_error_then_valid_works(standin_server, body, needle):
    status, out = generate(standin_server, body)
    assert status == 400, (status, out)
    assert needle in out["error"], out
    status, out = generate(standin_server, {"text_input": "ok", "max_tokens": 3})
    assert status == 200 and out["text_output"] == expected("ok", 3)


def test_server_side_rejections(standin_server):
    # JSON that is not a number for an INT32 input: Triton itself refuses it before the model sees it
    # (2.51: HTTP 500 "Unable to parse 'data': attempt to access JSON non-signed-integer as signed-integer")
    status, out = generate(standin_server, {"text_input": "abc", "max_tokens": "abc"})
    assert status >= 400 and "error" in out
    status, out = http_post(standin_server, f"/v2/models/{MODEL}/generate", "{not json")
    assert status >= 400
    # stream=true asks for several responses, which /generate refuses (use /generate_stream)
    status, out = generate(standin_server, {"text_input": "abc", "max_tokens": 8, "stream": True})
    assert "error" in out and "generate stream" in out["error"]
    # a runtime crash fails the requests of that round only; the next request works; failures are counted
    errors = requests_total(standin_server, "error")
    status, out = generate(standin_server, {"text_input": "__crash__", "max_tokens": 5})
    assert status >= 400 and "the runtime failed" in out["error"]
    assert requests_total(standin_server, "error") == errors + 1
    status, out = generate(standin_server, {"text_input": "ok", "max_tokens": 3})
    assert status == 200 and out["text_output"] == expected("ok", 3)


def _open_stream(port: int, body: dict) -> tuple[socket.socket, bytes]:
    """Start a /generate_stream request on a raw socket and read until the first SSE event."""
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST /v2/models/{MODEL}/generate_stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    buf = b""
    while b"data:" not in buf:
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk
    return s, buf


def test_client_disconnect_mid_stream_frees_slot_and_does_not_stall_others(standin_server):
    log_before = standin_server.log_text().count("cancelled by the client")
    cancelled = requests_total(standin_server, "cancelled")
    # max_tokens chosen so the stream would take ~2 s (10 ms rounds, ~2.5 tokens a round)
    socks = [_open_stream(standin_server.http_port, {"text_input": f"long{i}", "max_tokens": 480, "stream": True})[0]
             for i in range(3)]
    for s in socks:
        s.close()  # hang up mid-stream
    # the server notices each hang-up and drops the request (480 tokens would hold a slot for seconds) ...
    deadline = time.monotonic() + 10
    while standin_server.log_text().count("cancelled by the client") < log_before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert standin_server.log_text().count("cancelled by the client") >= log_before + 3, standin_server.log_tail()
    assert requests_total(standin_server, "cancelled") >= cancelled + 3  # counted, as the finished ones are
    # ... and goes on serving new clients exactly
    with ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(lambda i: generate(standin_server, {"text_input": f"q{i}", "max_tokens": 12}), range8()))
    assert all(st == 200 and o["text_output"] == expected(f"q{i}", 12) for i, (st, o) in enumerate(outs))


def range8():
    return range(8)


def test_grpc_stream_cancel(standin_server):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    before = standin_server.log_text().count("cancelled by the client")
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(standin_server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(MODEL, _grpc_inputs(grpcclient, "grpc-long", 480, True))
    result, error = got.get(timeout=30)
    assert error is None
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 10
    while standin_server.log_text().count("cancelled by the client") <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert standin_server.log_text().count("cancelled by the client") > before
    status, out = generate(standin_server, {"text_input": "after", "max_tokens": 4})
    assert status == 200 and out["text_output"] == expected("after", 4)


def test_clean_shutdown_with_requests_in_flight(tmp_path, triton_env, standin_bundle):
    repo = write_standin_repo(tmp_path / "repo", standin_bundle, triton_env, max_batch=2, instances=2)
    srv = TritonServer(repo, triton_env, log_path=tmp_path / "server.log", models=[MODEL], stop_timeout=30)
    with srv:
        assert srv.is_running()
        assert "retrace (retrace_0_0) serving" in srv.log_text() and "retrace (retrace_0_1) serving" in srv.log_text()
        pid = srv.proc.pid
        outs: list = []
        threads = [threading.Thread(target=lambda i=i: outs.append(
            generate(srv, {"text_input": f"s{i}", "max_tokens": 100}, timeout=60))) for i in range(4)]
        for t in threads:
            t.start()
        hung, _ = _open_stream(srv.http_port, {"text_input": "gone", "max_tokens": 400, "stream": True})
        hung.close()
        time.sleep(0.2)
    # __exit__ stopped it with SIGINT alone (stop(check=True) raises otherwise) and nothing is left
    assert srv.exit_code == 0 and srv.stop_signal is not None and srv.stop_signal.name == "SIGINT"
    assert not srv.leftover
    with pytest.raises(ProcessLookupError):
        import os

        os.killpg(pid, 0)
    for t in threads:
        t.join(10)
    # in-flight requests either finished or were told the model is shutting down
    for status, out in outs:
        assert (status == 200 and len(out["text_output"]) == 100) or "shutting down" in out.get("error", ""), out
    log = srv.log_text()
    assert "successfully unloaded 'retrace'" in log and log.count("stopped: {") == 2


def test_model_refuses_numpy2_environment(tmp_path, triton_env, standin_bundle):
    """numpy 2 in the execution env garbles tensors in tritonserver 2.51: the model must refuse to load."""
    import subprocess
    import sys
    import sysconfig

    env = tmp_path / "np2env"
    subprocess.run([triton_env.model_env / "bin" / "python", "-c", f"import venv; venv.create({str(env)!r})"],
                   check=True)
    # borrow this interpreter's packages (numpy 2) instead of installing anything
    site = Path(sysconfig.get_paths()["purelib"])
    pyver = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (env / "lib" / pyver / "site-packages" / "borrow.pth").write_text(str(site) + "\n")
    repo = write_standin_repo(tmp_path / "repo", standin_bundle, triton_env)
    patched = (repo / MODEL / "config.pbtxt").read_text().replace(str(triton_env.model_env), str(env))
    (repo / MODEL / "config.pbtxt").write_text(patched)
    srv = TritonServer(repo, triton_env, log_path=tmp_path / "server.log", models=[MODEL], startup_timeout=60)
    with pytest.raises(TritonServerError, match="exited with code|not ready"):
        srv.start()
    assert "the python backend needs numpy<2" in srv.log_text()
    assert not srv.is_running() and not srv.leftover


def test_real_runtime_torch_backend_through_triton(tmp_path, triton_env, standin_bundle):
    """The model against the real retrace.runtime (torch backend, tiny random pair): lossless greedy output
    in every mode, continuous batching across concurrent requests, stats from the runtime."""
    helpers = pytest.importorskip("helpers")
    from retrace.runtime import Runtime, SamplingParams

    target = helpers.write_target(tmp_path / "target")
    drafter = helpers.write_drafter(tmp_path / "drafter", target, layers=1, block_size=4, conditioner="random")
    prompts = [[1, 2, 3], [5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    rt = Runtime.from_dirs(target, drafter, backend="torch", max_batch=4, max_seq_len=128)
    want = [r.token_ids for r in rt.generate(prompts, SamplingParams(max_new_tokens=8), mode="ar")]

    from retrace.export.triton.repository import write_repository

    repo = write_repository(
        standin_bundle, tmp_path / "repo", model_name=MODEL, max_batch=4, env_path=triton_env.model_env,
        runtime_factory="retrace.export.triton.standin:create_runtime_from_dirs",
        runtime_options={"target_dir": str(target), "drafter_dir": str(drafter), "max_seq_len": 128},
    )
    with TritonServer(repo, triton_env, log_path=tmp_path / "server.log", models=[MODEL]) as srv:
        def one(i):
            body = {"input_ids": prompts[i % 4], "max_tokens": 8, "mode": ["retrace", "dflash", "ar"][i % 3]}
            if i % 2:
                body["stream"] = True
                status, events = generate_stream(srv, body)
                ids = [t for e in events for t in as_list(e.get("output_ids", []))]
                return i, status, ids, stats_of(events[-1]) if "stats" in events[-1] else events
            status, out = generate(srv, body)
            return i, status, as_list(out.get("output_ids", [])), stats_of(out) if "stats" in out else out

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(one, range(8)))
        for i, status, ids, st in results:
            assert status == 200, st
            assert ids == want[i % 4], (i, ids, want[i % 4])  # lossless in every mode and batch
            assert st["rounds"] >= 1 and st["tokens"] == 8 and st["finish_reason"] == "length"
            assert isinstance(st["accepted_hist"], list) and st["tau"] >= 1
        assert max(st["max_batch_seen"] for *_, st in results) > 1
        assert max(st["scheduler_max_batch_seen"] for *_, st in results) <= 4
        status, out = generate(srv, {"text_input": "hello", "max_tokens": 4})
        assert status == 400 and "no tokenizer" in out["error"]
        status, out = generate(srv, {"input_ids": [1, 2], "max_tokens": 200})
        assert status == 400 and "max_tokens" in out["error"]


def test_real_onnxruntime_bundle_through_triton(tmp_path, triton_env):
    """The production path (no factory: Runtime.from_bundle(..., backend="onnxruntime")) on a real bundle:
    32 concurrent clients over HTTP generate, in all three modes, each get exactly the offline greedy output
    of `retrace generate --engine`, and the runtime batches them (batch > 1). Then the streaming paths on the
    same server: for two prompts in each mode, the HTTP SSE stream (generate_stream) and a decoupled gRPC
    stream each deliver, concatenated, the same greedy ids, with the stats on the last response only.

    Uses the test session's bundle (tests/export_fixtures.py); RETRACE_TRITON_TEST_BUNDLE=<bundle> serves
    another one (e.g. the one `make demo` builds)."""
    import os

    from export_fixtures import pair_and_bundle

    from retrace.export.triton.repository import write_repository
    from retrace.runtime import Runtime, SamplingParams

    grpcclient = pytest.importorskip("tritonclient.grpc")
    bundle = os.environ.get("RETRACE_TRITON_TEST_BUNDLE") or str(pair_and_bundle().bundle)
    rt = Runtime.from_bundle(bundle, backend="onnxruntime", max_batch=4)
    has_text = bool(os.environ.get("RETRACE_TRITON_TEST_BUNDLE")) and rt.codec is not None
    prompts = ["def parse_args(argv):", "import os\n", "class Foo:", "for i in range("] if has_text else [
        [1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    want = rt.generate(prompts, SamplingParams(max_new_tokens=16), mode="ar")
    limit = rt.backend.max_batch
    repo = write_repository(bundle, tmp_path / "repo", model_name=MODEL, max_batch=limit, env_path=triton_env.model_env)
    key = "text_input" if has_text else "input_ids"
    # streaming cases: (prompt index, mode), each sent over HTTP SSE and over gRPC
    cases = {f"p{k}-{mode}": (k, mode) for k in range(2) for mode in ("ar", "dflash", "retrace")}

    def grpc_request(k, mode):
        extra = {"mode": (np.array([mode.encode()], dtype=np.object_), "BYTES")}
        if not has_text:
            extra["input_ids"] = (np.array(prompts[k], np.int64), "INT64")
        return _grpc_inputs(grpcclient, prompts[k] if has_text else None, 16, True, **extra)

    with TritonServer(repo, triton_env, log_path=tmp_path / "server.log", models=[MODEL]) as srv:
        def one(i):
            body = {key: prompts[i % 4], "max_tokens": 16, "mode": ["retrace", "dflash", "ar"][i % 3]}
            return generate(srv, body, timeout=300)

        def sse(case):
            k, mode = case
            return generate_stream(srv, {key: prompts[k], "max_tokens": 16, "mode": mode, "stream": True},
                                   timeout=300)

        with ThreadPoolExecutor(max_workers=32) as pool:
            outs = list(pool.map(one, range(32)))
            sse_outs = dict(zip(cases, pool.map(sse, cases.values()), strict=True))
        grpc_outs = _grpc_stream_all(grpcclient, srv.grpc_url,
                                     {rid: grpc_request(k, mode) for rid, (k, mode) in cases.items()})
    for rid, (k, mode) in cases.items():
        status, events = sse_outs[rid]
        assert status == 200 and events and all("error" not in e for e in events), (rid, events)
        ids = [t for e in events for t in as_list(e.get("output_ids", []))]
        assert ids == want[k].token_ids, (rid, ids, want[k].token_ids)  # SSE: lossless greedy
        if has_text:
            assert "".join(e.get("text_output", "") for e in events) == want[k].text, rid
        assert all("stats" not in e for e in events[:-1]) and "stats" in events[-1], (rid, events)
        st = stats_of(events[-1])
        assert st["mode"] == mode and st["rounds"] >= 1 and st["completion_tokens"] == len(ids), (rid, st)
        if mode == "ar":
            assert len(events) > 1, (rid, events)  # one event per committed round, not one at the end
        responses = grpc_outs[rid]
        ids = [t for r_ids, _, _ in responses for t in r_ids]
        assert ids == want[k].token_ids, (rid, ids, want[k].token_ids)  # gRPC stream: lossless greedy
        if has_text:
            assert "".join(text for _, text, _ in responses) == want[k].text, rid
        assert all(r[2] is None for r in responses[:-1]) and responses[-1][2]["mode"] == mode, (rid, responses)
    print(f"streamed responses per request (SSE, gRPC): "
          f"{ {rid: (len(sse_outs[rid][1]), len(grpc_outs[rid])) for rid in cases} }")
    batches = []
    for i, (status, out) in enumerate(outs):
        assert status == 200, out
        assert as_list(out["output_ids"]) == want[i % 4].token_ids  # greedy: lossless in every mode
        if has_text:
            assert out["text_output"] == want[i % 4].text
        st = stats_of(out)
        assert st["rounds"] >= 1 and st["max_batch_seen"] >= 1
        batches.append(st["max_batch_seen"])
    print(f"runtime batch sizes seen by the 32 clients: max {max(batches)}, histogram "
          f"{ {b: batches.count(b) for b in sorted(set(batches))} }")
    assert max(batches) > 1, "concurrent requests were not batched together"
