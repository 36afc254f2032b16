"""The Triton model driven the way NVIDIA's clients drive it (one real tritonserver, the real runtime).

genai-perf's two KServe converters (``--endpoint-type kserve --backend tensorrtllm | vllm``) send, over a
decoupled gRPC stream, [1]-shaped tensors: text_input, max_tokens (TensorRT-LLM) or a sampling_parameters
JSON string with numbers as strings (vLLM), stream, exclude_input_in_output, and min_length / min_tokens
for --output-tokens-mean-deterministic. Each answer must equal offline decoding token for token, with the
EOS suppressed up to the minimum; then Triton's metrics port carries the acceptance counters.
"""

from __future__ import annotations

import json
import queue
import time
import urllib.request

import numpy as np
import pytest
from runtime_fixtures import copy_with_eos, write_pair
from triton_fixtures import MODEL, as_list, fixture_triton_env, generate, stats_of  # noqa: F401

from retrace.export.triton.repository import write_repository
from retrace.export.triton_server import TritonServer
from retrace.runtime import Runtime, SamplingParams

VOCAB = 128
N = 24  # output tokens (genai-perf --output-tokens-mean)
PROMPTS = [[3, 17, 9, 44], [60, 2, 2, 91, 15, 7], [100, 5]]


def words(ids):
    return " ".join(f"t{i}x" for i in ids)


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_env):
    """(server, offline runtime, eos): a word-tokenizer pair whose EOS comes early in prompt 0's decode."""
    root = tmp_path_factory.mktemp("conventions")
    target, drafter = write_pair(root, vocab=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48,
                                 block_size=4, conditioner="random", seed=7)
    free = Runtime.from_dirs(target, drafter, backend="torch", max_batch=4, max_seq_len=128).generate(
        [words(p) for p in PROMPTS], SamplingParams(max_new_tokens=N, ignore_eos=True), "ar")[0].token_ids
    eos = next(t for i, t in enumerate(free[2:10], 2) if t not in free[:i])
    target = copy_with_eos(target, root / "target-eos", eos)
    offline = Runtime.from_dirs(target, drafter, backend="torch", max_batch=4, max_seq_len=128)
    repo = write_repository(
        write_bundle(root / "bundle"), root / "repo", model_name=MODEL, max_batch=4, env_path=triton_env.model_env,
        runtime_factory="retrace.export.triton.standin:create_runtime_from_dirs",
        runtime_options={"target_dir": str(target), "drafter_dir": str(drafter), "max_seq_len": 128})
    with TritonServer(repo, triton_env, log_path=root / "server.log", models=[MODEL], die_with_parent=True) as srv:
        yield srv, offline, eos


def write_bundle(path):
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps({"format": "standin", "max_seq_len": 128}))
    return path


def offline(rt, k: int, **kw) -> list[int]:
    return rt.generate([words(PROMPTS[k])], SamplingParams(**kw), "ar")[0].token_ids


def tensor(grpcclient, name, value):
    arr = np.array([value.encode() if isinstance(value, str) else value],
                   dtype=np.object_ if isinstance(value, str) else None)
    if arr.dtype == np.int64:
        arr = arr.astype(np.int32)
    dtype = {"O": "BYTES", "b": "BOOL", "i": "INT32"}[arr.dtype.kind]
    t = grpcclient.InferInput(name, [1], dtype)
    t.set_data_from_numpy(arr)
    return t


def stream_all(grpcclient, url, requests: dict[str, dict]) -> dict[str, tuple[list[int], str, dict]]:
    """One decoupled gRPC stream (as perf_analyzer's): per request id, (ids, text, stats of the last)."""
    results: queue.Queue = queue.Queue()
    got = {rid: ([], "", None) for rid in requests}
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        for rid, inputs in requests.items():
            client.async_stream_infer(MODEL, [tensor(grpcclient, k, v) for k, v in inputs.items()], request_id=rid)
        deadline, done = time.monotonic() + 120, set()
        while len(done) < len(requests) and time.monotonic() < deadline:
            result, error = results.get(timeout=120)
            assert error is None, error
            rid = result.get_response().id
            ids, text, stats = got[rid]
            st = result.as_numpy("stats")
            got[rid] = (ids + result.as_numpy("output_ids").tolist(), text + result.as_numpy("text_output")[0].decode(),
                        json.loads(st[0]) if st is not None else stats)
            if st is not None:
                done.add(rid)
        assert done == set(requests)
    finally:
        client.stop_stream()
        client.close()
    return got


def scrape(srv) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) if fam.name.startswith("retrace_") for s in fam.samples}


def test_genai_perf_kserve_requests_are_exact_and_counted(served):
    grpcclient = pytest.importorskip("tritonclient.grpc")
    srv, rt, eos = served
    before = scrape(srv)
    assert offline(rt, 0, max_new_tokens=N)[-1] == eos  # without a minimum, prompt 0 stops early
    trt = {"max_tokens": N, "exclude_input_in_output": True, "stream": True}
    vllm_sp = json.dumps({"max_tokens": f"{N}", "min_tokens": f"{N}"})  # exactly what genai-perf writes
    reqs, want = {}, {}
    for k in range(len(PROMPTS)):
        reqs[f"trt-det-{k}"] = {"text_input": words(PROMPTS[k]), **trt, "min_length": N}
        want[f"trt-det-{k}"] = offline(rt, k, max_new_tokens=N, min_tokens=N)
        reqs[f"vllm-det-{k}"] = {"text_input": words(PROMPTS[k]), "exclude_input_in_output": True, "stream": True,
                                 "sampling_parameters": vllm_sp}
        want[f"vllm-det-{k}"] = want[f"trt-det-{k}"]
        reqs[f"trt-{k}"] = {"text_input": words(PROMPTS[k]), **trt}
        want[f"trt-{k}"] = offline(rt, k, max_new_tokens=N)
    got = stream_all(grpcclient, srv.grpc_url, reqs)
    for rid, (ids, text, st) in got.items():
        assert ids == want[rid], rid
        assert text == words(want[rid]) and st["completion_tokens"] == len(ids), rid
    assert all(len(got[r][0]) == N for r in got if "det" in r) and len(got["trt-0"][0]) < N

    # vLLM-style sampling_parameters over HTTP /generate: ignore_eos, a stop string, the prompt in the output
    stop = words(want["trt-det-1"][5:7])
    sp = {"max_tokens": N, "ignore_eos": True, "temperature": 0, "top_k": -1, "stop": [stop]}
    status, out = generate(srv, {"text_input": words(PROMPTS[1]), "sampling_parameters": json.dumps(sp),
                                 "exclude_input_in_output": False})
    assert status == 200, out
    ref = rt.generate([words(PROMPTS[1])], SamplingParams(max_new_tokens=N, ignore_eos=True, stop=(stop,)), "ar")[0]
    assert as_list(out["output_ids"]) == ref.token_ids and ref.finish_reason == "stop"
    assert out["text_output"] == words(PROMPTS[1]) + ref.text and stop not in ref.text
    stats = [st for _, _, st in got.values()] + [stats_of(out)]
    status, out = generate(srv, {"text_input": "t1x", "sampling_parameters": json.dumps({"best_of": 2})})
    assert status == 400 and "unknown key(s) 'best_of'" in out["error"]
    status, out = generate(srv, {"text_input": "t1x", "max_tokens": 4, "beam_width": 2})
    assert status == 400 and "beam_width 1 only" in out["error"]

    # Triton's metrics port: the acceptance counters moved by exactly what the requests' stats say
    after = scrape(srv)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    mode = stats[0]["mode"]
    assert delta("retrace_rounds_total", mode=mode) == sum(s["rounds"] for s in stats) > 0
    assert delta("retrace_output_tokens_total", mode=mode) == sum(s["tokens"] for s in stats)
    assert delta("retrace_draft_tokens_total", mode=mode) == sum(s["drafted"] for s in stats)
    acc = sum(a * n for s in stats for a, n in enumerate(s["accepted_hist"]))
    assert delta("retrace_accepted_tokens_total", mode=mode) == acc
    assert delta("retrace_requests_total", mode=mode, finish_reason="length") == sum(
        s["finish_reason"] == "length" for s in stats)
    assert delta("retrace_accepted_length_count", mode=mode) == sum(s["rounds"] for s in stats)
    assert delta("retrace_accepted_length_sum", mode=mode) == acc
    assert delta("retrace_verify_length_count", mode=mode) == sum(sum(s["verify_hist"]) for s in stats)
    assert delta("retrace_accepted_length_bucket", mode=mode, le="+Inf") == sum(s["rounds"] for s in stats)


def test_trtllm_min_length_in_retrace_mode_is_exact(served):
    """The default mode (retrace: drafts, conditioner) with min_length stays exact over gRPC streaming."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    srv, rt, _ = served
    want = rt.generate([words(PROMPTS[0])], SamplingParams(max_new_tokens=N, min_tokens=N - 4), "ar")[0].token_ids
    got = stream_all(grpcclient, srv.grpc_url, {
        m: {"text_input": words(PROMPTS[0]), "max_tokens": N, "min_length": N - 4, "stream": True, "mode": m}
        for m in ("retrace", "dflash")})
    for m, (ids, _, st) in got.items():
        assert ids == want and st["mode"] == m and st["rounds"] >= 1
