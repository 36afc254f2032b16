"""`retrace generate` contract (click's CliRunner): JSON shape, prompt sources, one-line user errors."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from runtime_fixtures import words, write_pair

from retrace.cli import main
from retrace.runtime import Runtime, SamplingParams

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("cli")
    target, drafter = write_pair(root, vocab=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48,
                                 block_size=4, conditioner="random", seed=3)
    bare = root / "target-no-tokenizer"
    shutil.copytree(target, bare)
    (bare / "tokenizer.json").unlink()
    plain = root / "drafter-no-conditioner"
    shutil.copytree(drafter, plain)
    for f in ("retrace_config.json", "retrace.safetensors"):
        (plain / f).unlink()
    return {"target": target, "drafter": drafter, "bare": bare, "plain": plain, "root": root}


def run(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def ok_json(result) -> dict:
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


def test_json_shape_with_text_prompt(dirs):
    prompt = words([5, 9, 2])
    res = run("--target", dirs["target"], "--drafter", dirs["drafter"], "--prompt", prompt, "--max-new-tokens", 12,
              "--json")
    out = ok_json(res)
    assert set(out) >= {"outputs", "stats"}
    (o,) = out["outputs"]
    assert (isinstance(o["token_ids"], list) and len(o["token_ids"]) == 12
            and all(isinstance(t, int) for t in o["token_ids"]))
    assert o["text"] == words(o["token_ids"])
    st = out["stats"]
    assert {"tau", "rounds", "tokens_per_s"} <= set(st)
    assert st["tau"] >= 1 and st["rounds"] >= 1 and st["tokens_per_s"] > 0 and st["tokens"] == 12
    # the same as the Python API (greedy default)
    rt = Runtime.from_dirs(dirs["target"], dirs["drafter"])
    assert rt.generate([prompt], SamplingParams(max_new_tokens=12), "retrace")[0].token_ids == o["token_ids"]


def test_prompt_ids_without_tokenizer(dirs):
    out = ok_json(run("--target", dirs["bare"], "--drafter", dirs["drafter"], "--prompt-ids", "5,9,2",
                      "--max-new-tokens", 12, "--mode", "dflash", "--json"))
    (o,) = out["outputs"]
    assert o["text"] is None and len(o["token_ids"]) == 12
    with_text = ok_json(run("--target", dirs["target"], "--drafter", dirs["drafter"], "--prompt-ids", "5,9,2",
                            "--max-new-tokens", 12, "--mode", "ar", "--json"))
    assert with_text["outputs"][0]["token_ids"] == o["token_ids"]  # dflash == ar, tokenizer or not


def test_text_prompt_without_tokenizer_is_a_user_error(dirs):
    res = run("--target", dirs["bare"], "--drafter", dirs["drafter"], "--prompt", "hello", "--json")
    assert_user_error(res, "tokenizer")


def test_prompts_file_runs_as_one_batch(dirs, tmp_path):
    lines = [{"prompt": words([1, 2, 3])}, {"prompt_ids": [7]}, {"prompt": words([4] * 9)},
             {"prompt_ids": [3, 3, 8, 1]}]
    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    out = ok_json(run("--target", dirs["target"], "--drafter", dirs["drafter"], "--prompts-file", f,
                      "--max-new-tokens", 10, "--json"))
    assert len(out["outputs"]) == 4
    assert out["stats"]["max_batch_seen"] == 4
    rt = Runtime.from_dirs(dirs["target"], dirs["drafter"])
    for x, o in zip(lines, out["outputs"], strict=True):  # in order, each equal to its own run
        alone = rt.generate([x.get("prompt") or x.get("prompt_ids")], SamplingParams(max_new_tokens=10), "ar")[0]
        assert o["token_ids"] == alone.token_ids


def test_sampling_flags_and_stop(dirs):
    base = ("--target", dirs["target"], "--drafter", dirs["drafter"], "--prompt-ids", "5,9,2", "--json")
    # seeded samples repeat when K does: the fixed policy (the adaptive one's K follows timings)
    seeded = ("--temperature", 0.8, "--top-p", 0.9, "--top-k", 20, "--seed", 1, "--max-new-tokens", 16)
    a = ok_json(run(*base, *seeded, "--verify-policy", "fixed"))
    b = ok_json(run(*base, *seeded, "--verify-policy", "fixed"))
    assert a["outputs"][0]["token_ids"] == b["outputs"][0]["token_ids"]  # seeded
    assert a["stats"]["verify_policy"] == "fixed" and a["stats"]["verify_hist"][-1] == a["stats"]["rounds"]
    greedy = ok_json(run(*base, "--max-new-tokens", 16))["outputs"][0]
    stop = words(greedy["token_ids"][3:5])
    stopped = ok_json(run(*base, "--max-new-tokens", 16, "--stop", stop))["outputs"][0]
    assert stopped["finish_reason"] == "stop" and stop not in stopped["text"]
    assert greedy["text"].startswith(stopped["text"]) and len(stopped["token_ids"]) <= 5


def test_human_output(dirs):
    res = run("--target", dirs["target"], "--drafter", dirs["drafter"], "--prompt-ids", "5,9,2",
              "--max-new-tokens", 8)
    assert res.exit_code == 0, res.output
    assert "--- output 0" in res.stdout and "tok/s" in res.stderr


def assert_user_error(result, needle: str) -> None:
    """Exit code != 0 through the user-error path: one 'error: ...' line on stderr, no traceback."""
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), f"crashed: {result.exception!r}"
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert "Traceback" not in result.output
    assert needle.lower() in err.lower(), err


@pytest.mark.parametrize("extra,needle", [
    (("--mode", "turbo"), "unknown mode"),
    (("--max-new-tokens", -4), "max_new_tokens"),
    (("--max-new-tokens", 0), "max_new_tokens"),
    (("--temperature", -0.5), "temperature"),
    (("--top-p", 0), "top_p"),
    (("--top-p", 1.5), "top_p"),
    (("--top-k", -1), "top_k"),
    (("--max-seq-len", 16), "max length"),
    (("--block-size", 9), "block size"),
], ids=["mode", "neg-max-tokens", "zero-max-tokens", "neg-temperature", "top-p-0", "top-p-1.5", "neg-top-k",
        "prompt-too-long", "block-too-big"])
def test_bad_arguments(dirs, extra, needle):
    res = run("--target", dirs["target"], "--drafter", dirs["drafter"], "--prompt-ids", ",".join(["3"] * 12),
              "--max-new-tokens", 8, *extra)
    assert_user_error(res, needle)


def test_missing_files(dirs, tmp_path):
    base = ("--prompt-ids", "1,2")
    assert_user_error(run("--target", tmp_path / "nope", "--drafter", dirs["drafter"], *base), "nope")
    assert_user_error(run("--target", dirs["target"], "--drafter", tmp_path / "nodrafter", *base), "nodrafter")
    assert_user_error(run("--target", dirs["target"], "--drafter", dirs["drafter"], "--prompts-file",
                          tmp_path / "none.jsonl"), "none.jsonl")
    broken = tmp_path / "broken"
    shutil.copytree(dirs["target"], broken)
    (broken / "model.safetensors").unlink()
    assert_user_error(run("--target", broken, "--drafter", dirs["drafter"], *base), "broken")


def test_other_user_errors(dirs, tmp_path):
    t, d = ("--target", dirs["target"]), ("--drafter", dirs["drafter"])
    assert_user_error(run(*t, *d, "--prompt-ids", "1,x"), "prompt-ids")
    assert_user_error(run(*t, *d, "--prompt-ids", f"1,{VOCAB + 5}"), "token ids")
    assert_user_error(run(*t, *d), "exactly one")
    assert_user_error(run(*t, *d, "--prompt", "a", "--prompt-ids", "1"), "exactly one")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "t1x"}\n{"text": 3}\n')
    assert_user_error(run(*t, *d, "--prompts-file", bad), "bad.jsonl:2")
    assert_user_error(run(*t, "--drafter", dirs["plain"], "--prompt-ids", "1", "--mode", "retrace"), "conditioner")
    assert_user_error(run(*t, "--prompt-ids", "1", "--mode", "dflash"), "drafter")
    ok_json(run(*t, "--prompt-ids", "1", "--mode", "ar", "--max-new-tokens", 4, "--json"))  # ar needs no drafter
