"""Triton deployment pieces that need no server: request validation, repository layout, serving loop."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from triton_fixtures import FakeSink, write_standin_bundle

from retrace.export.triton import standin
from retrace.export.triton.repository import RepositoryError, render_config, write_repository
from retrace.export.triton.serving import Job, RuntimeAdapter, ServingLoop, bundle_limits
from retrace.export.triton.validation import INPUTS, Limits, RequestError, parse_request

LIMITS = Limits(max_tokens=100, max_seq_len=200, vocab_size=128)


def S(*xs):  # BYTES tensor as the python backend hands it over
    return np.array([x.encode() if isinstance(x, str) else x for x in xs], dtype=np.object_)


def base(**kw):
    d = {"text_input": S("abc"), "max_tokens": np.array([5], np.int32)}
    d.update(kw)
    return d


# ------------------------------------------------------------------------------------------ validation
def test_valid_request_defaults_and_all_inputs():
    spec = parse_request(base(), "{}", LIMITS)
    assert (spec.prompt_text, spec.max_tokens, spec.temperature, spec.top_p, spec.top_k, spec.stream) == (
        "abc", 5, 0.0, 1.0, 0, False)
    assert spec.mode == "retrace" and spec.seed is None and spec.stop == []
    spec = parse_request(
        {"input_ids": np.array([[1, 2, 3]], np.int64), "max_tokens": np.array([7], np.int32),
         "temperature": np.array([0.7], np.float32), "top_p": np.array([0.9], np.float32),
         "top_k": np.array([20], np.int32), "seed": np.array([3], np.int64), "stop": S("\n", "END"),
         "mode": S("dflash"), "stream": np.array([True])},
        "", LIMITS)
    assert spec.prompt_ids == [1, 2, 3] and spec.prompt_text is None
    assert spec.sampling_kwargs() == {"max_new_tokens": 7, "temperature": pytest.approx(0.7),
                                      "top_p": pytest.approx(0.9),
                                      "top_k": 20, "seed": 3, "stop": ["\n", "END"]}
    assert spec.mode == "dflash" and spec.stream is True
    # Triton's reserved parameters pass
    parse_request(base(), json.dumps({"triton_enable_empty_final_response": True}), LIMITS)


@pytest.mark.parametrize(
    ("inputs", "params", "needle"),
    [
        ({"max_tokens": np.array([5], np.int32)}, "{}", "missing prompt"),
        (base(input_ids=np.array([1], np.int64)), "{}", "not both"),
        (base(text_input=S("")), "{}", "empty prompt"),
        (base(text_input=S("a", "b")), "{}", "exactly one string"),
        (base(text_input=S(b"\xff\xfe")), "{}", "not valid UTF-8"),
        (base(text_input=np.array([1.0], np.float32)), "{}", "expected BYTES"),
        ({"input_ids": np.array([], np.int64), "max_tokens": np.array([5], np.int32)}, "{}",
         "'input_ids' is an empty prompt"),
        ({"input_ids": np.array([1.5], np.float32), "max_tokens": np.array([5], np.int32)}, "{}",
         "'input_ids' has data type float32"),
        ({"input_ids": np.array([5, 999], np.int64), "max_tokens": np.array([5], np.int32)}, "{}",
         "token id 999 outside [0, 128)"),
        ({"input_ids": np.array([-1], np.int64), "max_tokens": np.array([5], np.int32)}, "{}", "token id -1"),
        ({"input_ids": np.ones((2, 2), np.int64), "max_tokens": np.array([5], np.int32)}, "{}", "must be 1-D"),
        ({"text_input": S("abc")}, "{}", "missing input 'max_tokens'"),
        (base(max_tokens=np.array([0], np.int32)), "{}", "'max_tokens' must be > 0"),
        (base(max_tokens=np.array([-5], np.int32)), "{}", "'max_tokens' must be > 0"),
        (base(max_tokens=np.array([101], np.int32)), "{}", "above this model's limit of 100"),
        (base(max_tokens=np.array([1, 2], np.int32)), "{}", "exactly one value"),
        (base(max_tokens=np.array([1.0], np.float32)), "{}", "'max_tokens' has data type float32"),
        ({"input_ids": np.arange(150, dtype=np.int64) % 100, "max_tokens": np.array([60], np.int32)}, "{}", "exceeds"),
        (base(temperature=np.array([-0.1], np.float32)), "{}", "'temperature' must be >= 0"),
        (base(temperature=np.array([np.nan], np.float32)), "{}", "'temperature' must be a finite number"),
        (base(temperature=np.array([1], np.int32)), "{}", "'temperature' has data type int32, expected FP32"),
        (base(top_p=np.array([0.0], np.float32)), "{}", "'top_p' must be in (0, 1]"),
        (base(top_p=np.array([1.5], np.float32)), "{}", "'top_p' must be in (0, 1]"),
        (base(top_k=np.array([-1], np.int32)), "{}", "'top_k' must be >= 0"),
        (base(seed=np.array([-1], np.int64)), "{}", "'seed' must be >= 0"),
        (base(stop=S("")), "{}", "'stop' contains an empty string"),
        (base(stop=S(*["x"] * 17)), "{}", "at most 16"),
        (base(mode=S("turbo")), "{}", "unknown mode 'turbo'"),
        (base(stream=np.array([1], np.int32)), "{}", "'stream' has data type int32, expected BOOL"),
        (base(), json.dumps({"temprature": 0.5}), "unknown request parameter(s) 'temprature'"),
        (base(), "not json", "not valid JSON"),
        (base(), "[1]", "must be a JSON object"),
        (base(bogus=np.array([1])), "{}", "unknown input(s) 'bogus'"),
    ],
)
def test_malformed_requests_name_the_problem(inputs, params, needle):
    with pytest.raises(RequestError) as ei:
        parse_request(inputs, params, LIMITS)
    assert needle in str(ei.value)


def test_inputs_table_matches_the_brief():
    # every input optional for Triton: the vLLM convention has no max_tokens tensor (parse_request checks)
    assert INPUTS["text_input"] == ("TYPE_STRING", True) and INPUTS["max_tokens"] == ("TYPE_INT32", True)
    assert all(opt for _, opt in INPUTS.values())
    trtllm = {"text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "stream": "TYPE_BOOL",
              "exclude_input_in_output": "TYPE_BOOL", "end_id": "TYPE_INT32", "pad_id": "TYPE_INT32",
              "min_length": "TYPE_INT32", "stop_words": "TYPE_STRING", "bad_words": "TYPE_STRING",
              "beam_width": "TYPE_INT32"}
    vllm = {"text_input": "TYPE_STRING", "stream": "TYPE_BOOL", "exclude_input_in_output": "TYPE_BOOL",
            "sampling_parameters": "TYPE_STRING"}
    assert all(INPUTS[k][0] == t for k, t in {**trtllm, **vllm}.items())


def B(*xs):
    return np.array(xs, dtype=bool)


def I(*xs):  # noqa: E743
    return np.array(xs, np.int32)


def test_trtllm_convention_as_genai_perf_sends_it():
    # genai-perf --backend tensorrtllm --output-tokens-mean 12 --output-tokens-mean-deterministic --streaming
    spec = parse_request({"text_input": S("abc"), "max_tokens": I(12), "exclude_input_in_output": B(True),
                          "stream": B(True), "min_length": I(12)}, None, LIMITS)
    assert (spec.max_tokens, spec.min_tokens, spec.stream, spec.exclude_input) == (12, 12, True, True)
    assert spec.sampling_kwargs()["min_tokens"] == 12 and "ignore_eos" not in spec.sampling_kwargs()
    lim = Limits(max_tokens=100, eos_ids=(7,))
    spec = parse_request(base(end_id=I(7), pad_id=I(0), beam_width=I(1), stop_words=S("END", ""),
                              bad_words=S(""), exclude_input_in_output=B(False)), None, lim)
    assert spec.stop == ["END"] and spec.exclude_input is False
    assert parse_request(base(ignore_eos=B(True), min_tokens=I(3)), None, LIMITS).sampling_kwargs()["ignore_eos"]


def test_vllm_convention_sampling_parameters():
    sp = json.dumps({"max_tokens": "12", "min_tokens": "12"})  # genai-perf: numbers as strings
    spec = parse_request({"text_input": S("abc"), "sampling_parameters": S(sp), "stream": B(True),
                          "exclude_input_in_output": B(True)}, None, LIMITS)
    assert (spec.max_tokens, spec.min_tokens, spec.stream) == (12, 12, True)
    sp = json.dumps({"max_tokens": 9, "ignore_eos": True, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 4,
                     "stop": "\n\n", "min_tokens": 2})
    spec = parse_request({"text_input": S("abc"), "sampling_parameters": S(sp)}, None, LIMITS)
    assert spec.sampling_kwargs() == {"max_new_tokens": 9, "temperature": 0.5, "top_p": 0.9, "top_k": 0, "seed": 4,
                                      "stop": ["\n\n"], "ignore_eos": True, "min_tokens": 2}
    spec = parse_request({"text_input": S("abc"), "sampling_parameters": S("{}")}, None, LIMITS)
    assert spec.max_tokens == 16  # vLLM's default


@pytest.mark.parametrize(("extra", "needle"), [
    ({"beam_width": I(4)}, "beam_width 1 only"),
    ({"end_id": I(3)}, "'end_id' is 3, but this model ends at its own EOS token(s) [7]"),
    ({"bad_words": S("foo")}, "'bad_words' is not supported"),
    ({"pad_id": I(-1)}, "'pad_id' must be >= 0"),
    ({"min_length": I(6)}, "input 'min_length' must be in [0, max_tokens=5]"),
    ({"min_tokens": I(-1)}, "input 'min_tokens' must be in [0, max_tokens=5]"),
    ({"ignore_eos": I(1)}, "'ignore_eos' has data type int32, expected BOOL"),
    ({"min_tokens": I(1), "min_length": I(1)},
     "'min_tokens' is given twice (input 'min_tokens' and input 'min_length')"),
    ({"stop": S("a"), "stop_words": S("b")}, "'stop' is given twice"),
    ({"sampling_parameters": S('{"max_tokens": 3}')}, "'max_tokens' is given twice (input 'max_tokens' and "
                                                     "sampling_parameters 'max_tokens')"),
    ({"sampling_parameters": S('{"max_tokns": 3}')}, "unknown key(s) 'max_tokns' in 'sampling_parameters'"),
    ({"sampling_parameters": S("{bad")}, "'sampling_parameters' is not valid JSON"),
    ({"sampling_parameters": S("[1]")}, "'sampling_parameters' must be a JSON object"),
    ({"sampling_parameters": S('{"top_p": "x"}')}, "sampling_parameters 'top_p' must be a number"),
    ({"sampling_parameters": S('{"seed": 1.5}')}, "sampling_parameters 'seed' must be an integer"),
    ({"sampling_parameters": S('{"ignore_eos": "maybe"}')}, "sampling_parameters 'ignore_eos' must be true or false"),
    ({"sampling_parameters": S('{"temperature": -1}')}, "sampling_parameters 'temperature' must be >= 0"),
    ({"sampling_parameters": S('{"stop": [1]}')}, "sampling_parameters 'stop' must be a string or a list"),
    ({"exclude_input_in_output": S("yes")}, "'exclude_input_in_output' has data type object, expected BOOL"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_conventions_refuse_with_a_named_error(extra, needle):
    with pytest.raises(RequestError) as ei:
        parse_request(base(**extra), None, Limits(max_tokens=100, eos_ids=(7,)))
    assert needle in str(ei.value)


# ------------------------------------------------------------------------------------------ repository
def test_write_repository_layout(tmp_path):
    bundle = write_standin_bundle(tmp_path / "b")
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "activate").write_text("")
    repo = write_repository(bundle, tmp_path / "repo", model_name="m1", instances=2, max_batch=4, env_path=env)
    cfg = (repo / "m1" / "config.pbtxt").read_text()
    for needle in ('name: "m1"', 'backend: "python"', "decoupled: true", "count: 2 kind: KIND_CPU",
                   'key: "EXECUTION_ENV_PATH" value: { string_value: "' + str(env) + '" }',
                   'key: "RETRACE_BUNDLE" value: { string_value: "bundle" }',
                   'key: "RETRACE_MAX_BATCH" value: { string_value: "4" }',
                   'key: "RETRACE_VERIFY_POLICY" value: { string_value: "adaptive" }',
                   "max_batch_size: 0",
                   '{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true }',
                   '{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] optional: true }',
                   '{ name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true }',
                   '{ name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] optional: true }',
                   '{ name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }',
                   '{ name: "stats" data_type: TYPE_STRING dims: [ -1 ] }'):
        assert needle in cfg, needle
    assert "RETRACE_RUNTIME_FACTORY" not in cfg
    assert (repo / "m1" / "1" / "model.py").read_text().startswith('"""Triton python-backend model')
    assert (repo / "m1" / "1" / "retrace" / "export" / "triton" / "serving.py").is_file()
    assert not list((repo / "m1" / "1" / "retrace").rglob("__pycache__"))
    assert (repo / "m1" / "bundle" / "manifest.json").read_text() == (bundle / "manifest.json").read_text()
    meta = json.loads((repo / "m1" / "retrace.json").read_text())
    assert meta["instances"] == 2 and meta["bundle_source"] == str(bundle)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "env", "repo"]  # no temp dirs left

    with pytest.raises(RepositoryError, match="exists; pass force=True"):
        write_repository(bundle, repo, model_name="m1")
    repo2 = write_repository(bundle, repo, model_name="m2", copy_bundle=False, vendor_package=False,
                             force=True, pythonpath=[tmp_path], verify_policy="fixed")
    assert sorted(p.name for p in repo2.iterdir()) == [".retrace-output.json", "m2"]  # + the owner marker
    cfg2 = (repo2 / "m2" / "config.pbtxt").read_text()
    assert f'string_value: "{bundle}"' in cfg2 and "EXECUTION_ENV_PATH" not in cfg2
    assert 'key: "RETRACE_VERIFY_POLICY" value: { string_value: "fixed" }' in cfg2
    assert f'key: "RETRACE_PYTHONPATH" value: {{ string_value: "{tmp_path}" }}' in cfg2
    assert not (repo2 / "m2" / "bundle").exists() and not (repo2 / "m2" / "1" / "retrace").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "env", "repo"]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [({"model_name": "a b"}, "must match"), ({"instances": 0}, ">= 1"), ({"max_batch": 0}, ">= 1"),
     ({"env_path": "/nonexistent/env"}, "no bin/activate"), ({"modes": []}, "modes must be"),
     ({"verify_policy": "sometimes"}, "verify_policy must be")],
)
def test_write_repository_refuses(tmp_path, kw, needle):
    bundle = write_standin_bundle(tmp_path / "b")
    with pytest.raises(RepositoryError, match=needle):
        write_repository(bundle, tmp_path / "repo", **kw)
    with pytest.raises(RepositoryError, match="no manifest.json"):
        write_repository(tmp_path, tmp_path / "repo2")
    with pytest.raises(RepositoryError, match="must not contain the bundle"):
        write_repository(bundle, tmp_path, force=True)
    with pytest.raises(RepositoryError, match="must not be inside the bundle"):
        write_repository(bundle, bundle / "repo")
    assert not (tmp_path / "repo").exists()


def test_render_config_escapes_values():
    text = render_config("m", instances=1, parameters={"K": 'a "quoted" \\ value'})
    assert 'string_value: "a \\"quoted\\" \\\\ value"' in text


def test_bundle_limits_reads_top_level_and_sections():
    assert bundle_limits({"max_seq_len": 100, "limits": {"max_new_tokens": 50}, "target": {"vocab_size": 9}}) == {
        "max_seq_len": 100, "max_new_tokens": 50, "vocab_size": 9}
    assert bundle_limits({}) == {"max_seq_len": None, "max_new_tokens": None, "vocab_size": None}


# ------------------------------------------------------------------------------------------ serving loop
def make_loop(tmp_path, max_batch=4, delay=0.002):
    rt = standin.create_runtime(str(write_standin_bundle(tmp_path / "b", 256)), max_batch=max_batch,
                                step_delay_s=delay)
    adapter = RuntimeAdapter(rt)
    loop = ServingLoop(adapter, Limits(max_tokens=100, max_seq_len=256 - adapter.reserve), max_batch=max_batch)
    loop.start()
    return rt, loop


def submit(loop, text, max_tokens, stream=False, stop=()):
    spec = parse_request({"text_input": S(text), "max_tokens": np.array([max_tokens], np.int32),
                          "stream": np.array([stream]), **({"stop": S(*stop)} if stop else {})}, "", loop.limits)
    sink = FakeSink()
    loop.submit(Job(spec=spec, sink=sink))
    return sink


def test_loop_batches_streams_and_cancels(tmp_path):
    rt, loop = make_loop(tmp_path)
    try:
        sinks = [submit(loop, f"p{i}", 12, stream=i % 2 == 0) for i in range(10)]
        for s in sinks:
            assert s.done.wait(10)
        for i, s in enumerate(sinks):
            want = standin.expected_output(f"p{i}", 12)
            assert not s.errors
            assert "".join(r[1] for r in s.responses) == want
            assert [t for r in s.responses for t in r[0]] == [ord(c) for c in want]
            assert [r[3] for r in s.responses] == [False] * (len(s.responses) - 1) + [True]
            if i % 2:
                assert len(s.responses) == 1
            else:
                assert len(s.responses) > 1  # one response per round
            stats = s.responses[-1][2]
            assert stats["completion_tokens"] == 12 and stats["finish_reason"] == "length"
            assert stats["rounds"] == sum(stats["accepted_hist"]) and stats["tau"] > 1
            assert 1 <= stats["max_batch_seen"] <= 4
        assert loop.max_batch_seen == 4 and max(rt.scheduler().batch_sizes) == 4
        # stop string: text cut before it; the tail that might become a stop string is held back
        s = submit(loop, "a", 20, stream=True, stop=("gh",))
        assert s.done.wait(10)
        assert "".join(r[1] for r in s.responses) == "bcdef" and s.responses[-1][2]["finish_reason"] == "stop"
        # cancellation frees the slot
        s = submit(loop, "long", 100, stream=True)
        while not s.responses:
            time.sleep(0.001)
        s.cancel = True
        t0 = time.monotonic()
        while loop.cancelled == 0 and time.monotonic() - t0 < 5:
            time.sleep(0.005)
        assert loop.cancelled == 1 and s.errors == [("the request was cancelled", "cancelled")]
        assert rt.scheduler().cancelled and not rt.scheduler().running
        # runtime-side rejection and crash become errors; the loop keeps serving
        s = submit(loop, "__reject__", 5)
        assert s.done.wait(5) and "runtime rejected the request" in s.errors[0][0] and s.errors[0][1] == "invalid"
        s = submit(loop, "__crash__", 5)
        assert s.done.wait(5) and "the runtime failed" in s.errors[0][0]
        s = submit(loop, "ok", 5)
        assert s.done.wait(5) and s.responses[-1][1] == standin.expected_output("ok", 5)
    finally:
        loop.stop()


def test_loop_stop_fails_outstanding_requests(tmp_path):
    rt, loop = make_loop(tmp_path, max_batch=1, delay=0.01)
    sinks = [submit(loop, "x", 100) for _ in range(3)]
    time.sleep(0.05)
    loop.stop()
    for s in sinks:
        assert s.done.is_set() and s.errors == [("the model is shutting down", "unavailable")]
    late = FakeSink()
    loop.submit(Job(spec=parse_request(base(), "", LIMITS), sink=late))
    assert late.errors and late.errors[0][1] == "unavailable"


# ------------------------------------------------------------------------------------------ env cache
@pytest.mark.slow
def test_ensure_triton_env_builds_once_under_a_lock(tmp_path):
    """Two processes racing on an empty cache: one builds, the other waits; a third call is instant."""
    import subprocess
    import sys

    code = ("import json, sys; from retrace.export.triton.env import ensure_triton_env;"
            "print(json.dumps(ensure_triton_env(sys.argv[1], requirements=('numpy<2',)).as_dict()))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    envs = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert envs[0] == envs[1]
    logs = "".join(e for _, e in outs)
    assert logs.count("create model venv") == 1 and logs.count("install nvidia-pytriton") == 1, logs
    from pathlib import Path

    from retrace.export.triton.env import ensure_triton_env

    env = ensure_triton_env(tmp_path, requirements=("numpy<2",), log=lambda m: pytest.fail(f"rebuilt: {m}"))
    assert env.tritonserver.is_file() and (env.backend_dir / "python" / "triton_python_backend_stub").is_file()
    assert (env.model_env / "bin" / "activate").is_file() and Path(env.python_libdir).is_dir()
    assert "numpy==1." in (env.model_env / "requirements.lock.txt").read_text()
    assert not list(tmp_path.glob("*.partial"))
