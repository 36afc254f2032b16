"""llama.cpp's own speculative decoding as bench peers (retrace.bench.llamacpp_server): the statistics from its
responses, clear rows and errors where its tools are missing or its server does not start, and, where `make
llama-tools` has built llama-server (skipped without: CI does not build llama.cpp), the real server on the
shipped zoo pair: our DFlash drafter converted by llama.cpp's converter drafts in llama.cpp's DFlash mode, and its
greedy output equals its own plain decoding at batch 1 and 2."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from retrace.bench import llamacpp_server as ls
from retrace.bench.config import BenchConfig
from retrace.bench.lineup import Built
from retrace.bench.llamacpp_build import tool
from retrace.errors import RetraceError


def fake_server(monkeypatch, tmp_path, start: str = "", post: str = "") -> None:
    """A stand-in `llama-server` on LLAMA_CPP_BIN: runs `start` first, answers /health, and POSTs with the
    handler method `post` (none: no POST)."""
    fake = tmp_path / "bin" / "llama-server"
    fake.parent.mkdir()
    fake.write_text(f"""#!{sys.executable}
import http.server, json, sys
{start}
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{{}}")
{post}
    def log_message(self, *a):
        pass
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("LLAMA_CPP_BIN", str(fake.parent))


def test_statistics_count_a_round_per_token_not_accepted():
    """Every round emits its accepted drafts plus one token: rounds = tokens - accepted."""
    responses = [{"tokens": list(range(10)), "timings": {"draft_n": 12, "draft_n_accepted": 6}},
                 {"tokens": list(range(10)), "timings": {"draft_n": 8, "draft_n_accepted": 2}}]
    st = ls.speculative_stats(responses)
    assert st["rounds"] == 12 and st["tokens_emitted"] == 20 and st["draft_tokens_accepted"] == 8
    assert st["acceptance_rate"] == pytest.approx(8 / 20) and st["tokens_per_round"] == pytest.approx(20 / 12)
    assert ls.speculative_stats([{"tokens": [1, 2], "timings": {"predicted_n": 2}}]) is None  # plain decoding


def test_missing_tools_are_rows_that_say_how_to_build_them(monkeypatch, tmp_path):
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path / "nowhere"))
    with pytest.raises(RetraceError, match="make llama-tools"):
        tool("llama-server")
    built = Built()
    cfg = BenchConfig(target=str(tmp_path), drafter=str(tmp_path), prompts=[], weights=("fp32", "int4"))
    ls.add_llama_server_systems(built, cfg, tmp_path, 2, [], lambda msg: None, n_ctx=256)
    assert not built.systems
    assert [s["name"] for s in built.skipped] == ["llamacpp-server-ar-q4_k_m", "llamacpp-server-ngram-q4_k_m",
                                                  "llamacpp-dflash-q4_k_m", "llamacpp-dflash-ngram-q4_k_m",
                                                  "llamacpp-draft-q4_k_m"]
    assert all("make llama-tools" in s["reason"] for s in built.skipped)


def test_a_server_that_exits_at_start_is_an_error_with_its_last_log_line(monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "llama-server"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint('error: unknown model architecture: x')\nsys.exit(1)\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("LLAMA_CPP_BIN", str(fake.parent))
    with pytest.raises(RetraceError, match=r"exited \(1\) at start: error: unknown model architecture"):
        ls.LlamaServer(tmp_path / "m.gguf", 1, 64, 1, tmp_path / "logs" / "s.log")


def test_a_server_that_drops_its_draft_model_is_not_a_speculative_peer(monkeypatch, tmp_path):
    """llama-server logs that it could not set speculation up (e.g. draft and target vocabularies differ) and
    serves plain decoding: that must not be reported as its draft-model mode."""
    fake_server(monkeypatch, tmp_path, start=(
        'print("E srv    load_model: failed to initialize speculative decoding context: draft model vocab type '
        'must match target model to use speculation", flush=True)'))
    with pytest.raises(RetraceError, match=r"runs without speculation \(failed to .* vocab type must match"):
        ls.LlamaServer(tmp_path / "m.gguf", 1, 64, 1, tmp_path / "logs" / "s.log", tmp_path / "d.gguf",
                       {"spec_type": "draft-simple", "draft_max": 4})
    plain = ls.LlamaServer(tmp_path / "m.gguf", 1, 64, 1, tmp_path / "logs" / "p.log")  # no draft: no check
    plain.close()
    assert plain.proc.poll() is not None


def test_a_smaller_draft_vocabulary_is_padded_to_the_targets_once(tmp_path):
    """llama.cpp refuses a draft model whose vocabulary differs from the target's: the bench pads a smaller one
    with zero rows (cached), keeps an equal one and refuses a larger one."""
    from helpers import write_target
    from safetensors.torch import load_file

    target = write_target(tmp_path / "target", vocab=256, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=96)
    draft = write_target(tmp_path / "draft", vocab=128, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=96)
    padded = ls.vocab_matched(draft, target, tmp_path / "cache")
    assert json.loads((padded / "config.json").read_text())["vocab_size"] == 256
    w, src = load_file(padded / "model.safetensors"), load_file(draft / "model.safetensors")
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        if k in src:
            assert w[k].shape[0] == 256 and w[k][:128].equal(src[k]) and not w[k][128:].any()
    assert ls.vocab_matched(draft, target, tmp_path / "cache") == padded  # cached
    assert ls.vocab_matched(target, target, tmp_path / "cache") == target
    with pytest.raises(RetraceError, match="larger vocabulary"):
        ls.vocab_matched(target, draft, tmp_path / "cache")


# -- the real llama-server (skipped where `make llama-tools` has not run) ---------------------------------
@pytest.fixture(scope="module")
def zoo_ggufs(tmp_path_factory):
    """The shipped small zoo pair (its trained drafter) as Q8_0 GGUFs."""
    from retrace.bench.llamacpp_build import build_gguf, converter
    from retrace.train import zoo_release

    try:
        tool("llama-server")
        tool("llama-quantize")
        converter()
    except RetraceError as e:
        pytest.skip(str(e))
    out = tmp_path_factory.mktemp("zoo") / "zoo"
    zoo_release.install(out, size="small", progress=False)
    cache = tmp_path_factory.mktemp("gguf")
    target = build_gguf(out / "target", cache, "Q8_0", lambda msg: None)
    drafter = build_gguf(out / "drafter", cache, "Q8_0", lambda msg: None, target_dir=out / "target")
    return out, target, drafter


def _prompts(out, n: int) -> list[list[int]]:
    from retrace.train.tokenizer import load_tokenizer

    tok = load_tokenizer(out / "target").backend_tokenizer
    return [tok.encode(json.loads(line)["prompt"], add_special_tokens=False).ids[:48]
            for line in list((out / "prompts" / "code.jsonl").open())[:n]]


def test_llama_cpp_dflash_with_our_drafter_is_its_own_plain_decoding(zoo_ggufs, tmp_path):
    """llama.cpp's DFlash mode takes our converted drafter, drafts (its own statistics say so) and, greedy,
    gives exactly its own plain decoding's tokens, at batch 1 and 2 (two requests in flight)."""
    out, target, drafter = zoo_ggufs
    prompts = _prompts(out, 2)
    ar = ls.LlamaServerSystem("llamacpp-server-ar-q8_0", target, 1, 128, tmp_path)
    dflash = ls.LlamaServerSystem("llamacpp-dflash-q8_0", target, 1, 128, tmp_path, drafter,
                                  {"spec_type": "draft-dflash", "draft_max": 7})
    try:
        want = ar.run(prompts, 24, 1)
        assert [len(o) for o in want.outputs] == [24, 24] and want.stats is None
        got = dflash.run(prompts, 24, 1)
        assert got.outputs == want.outputs
        assert got.stats["draft_tokens_evaluated"] > 0 and got.stats["tokens_emitted"] == 48
        assert dflash.run(prompts, 24, 2).outputs == want.outputs and dflash.parallel == 2
    finally:
        ar.close()
        dflash.close()
    assert ar.server is None and dflash.server is None


def test_the_server_is_gone_after_close(zoo_ggufs, tmp_path):
    out, target, _ = zoo_ggufs
    s = ls.LlamaServerSystem("llamacpp-server-ar-q8_0", target, 1, 128, tmp_path)
    s.run(_prompts(out, 1), 4, 1)
    proc = s.server.proc
    s.close()
    assert proc.poll() is not None
    assert not os.path.exists(f"/proc/{proc.pid}/status") or "zombie" in open(f"/proc/{proc.pid}/status").read()


def test_a_worker_whose_parent_goes_away_closes_its_systems(monkeypatch):
    """A bench worker (retrace.bench.worker) closes its systems, a llama-server each, when its input ends (the
    parent died without a `close`), so no server outlives the bench."""
    import io

    from retrace.bench import lineup, worker
    from retrace.bench.systems import System

    class Held(System):
        name, closed = "llamacpp-server-ar-q4_k_m", 0

        def close(self):
            self.closed += 1

    held = Held()
    built = Built()
    built.systems.append(held)
    monkeypatch.setattr(lineup, "build_systems", lambda *a, **k: built)
    req = {"op": "build", "config": {"target": "t", "drafter": "d", "prompts": []}, "threads": 1, "max_seq_len": 64,
           "max_batch": 1, "group": "llamacpp", "batch_sizes": [1]}
    out = io.StringIO()
    worker._serve(io.StringIO(json.dumps(req) + "\n"), out)  # then end of input, no close
    assert json.loads(out.getvalue().splitlines()[0])["ok"] and held.closed == 1


def test_a_sampled_run_sends_every_request_its_sampling_and_seed(monkeypatch, tmp_path):
    """retrace.bench.decoding reaches llama-server: each /completion carries the run's temperature, top-p, top-k,
    min-p 0, the seed of its prompt and the others' sampler order; a greedy run sends temperature 0."""
    from retrace.bench.decoding import Decoding

    seen = tmp_path / "bodies.jsonl"
    fake_server(monkeypatch, tmp_path, post=f"""
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with open({str(seen)!r}, "a") as f:
            f.write(json.dumps(body) + "\\n")
        out = json.dumps({{"tokens": [7] * body["n_predict"], "timings": {{}}}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(out))); self.end_headers()
        self.wfile.write(out)""")
    for decoding in (Decoding(temperature=0.7, top_p=0.8, top_k=20, seed=5), Decoding()):
        system = ls.LlamaServerSystem("llamacpp-server-ar-q4_k_m", tmp_path / "m.gguf", 1, 64, tmp_path / "logs",
                                      decoding=decoding)
        try:
            out = system.run([[1, 2], [3, 4, 5]], 4, 1)
        finally:
            system.close()
        assert out.outputs == [[7] * 4, [7] * 4]
    bodies = [json.loads(line) for line in seen.read_text().splitlines()]
    sampled = [{k: b[k] for k in ("temperature", "top_p", "top_k", "min_p", "seed", "samplers")} for b in bodies[:2]]
    assert sampled == [{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "seed": s,
                        "samplers": ["top_k", "temperature", "top_p"]} for s in (5, 6)]
    assert all(b["temperature"] == 0.0 and b["top_k"] == 1 and "seed" not in b for b in bodies[2:])
    assert all(b["ignore_eos"] and b["n_predict"] == 4 and not b["cache_prompt"] for b in bodies)
