"""Bad command-line values and bad files give one clear `error:` line and exit 2, never a traceback, a
segfault or a hang: non-finite numbers, huge seeds, thread counts beyond the machine, undecodable text,
malformed config values, a file given as a directory; the build's parity check fails on NaN."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

from retrace.cli import main
from retrace.cli_checks import machine_threads


def one_line_error(res, needle: str) -> None:
    assert res.exit_code == 2, res.output
    err = res.output.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and "Traceback" not in err, err
    assert needle in err, err


@pytest.fixture
def pair(tiny_pair):
    return tiny_pair()


def gen(pair, *extra, prompt=("--prompt-ids", "1,2,3")):
    return CliRunner().invoke(main, ["generate", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir),
                                     *prompt, "--max-new-tokens", "2", *map(str, extra)])


@pytest.mark.parametrize(("extra", "needle"), [
    (("--temperature", "nan"), "--temperature must be a finite number"),
    (("--temperature", "inf"), "--temperature must be a finite number"),
    (("--seed", str(2**70)), "--seed"),
    (("--threads", str(machine_threads() * 4 + 1)), "CPU cores available"),
    (("--block-size", "0"), "--block-size must be positive"),
    (("--max-seq-len", "100000"), "exceeds the target's max_position_embeddings"),
])
def test_generate_refuses_bad_numbers(pair, extra, needle):
    one_line_error(gen(pair, *extra), needle)


def test_generate_refuses_text_that_is_not_unicode(pair, tmp_path):
    one_line_error(gen(pair, prompt=("--prompt", "abc\udcff")), "--prompt is not valid UTF-8 text")
    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"prompt": "x\\ud800y"}\n')
    one_line_error(gen(pair, prompt=("--prompts-file", str(lone))), "not valid Unicode text")
    raw = tmp_path / "raw.jsonl"
    raw.write_bytes(b'{"prompt": "\xff\xfe"}\n')
    one_line_error(gen(pair, prompt=("--prompts-file", str(raw))), "not UTF-8 text")


@pytest.mark.parametrize("value", [-5, 2048.5, "8", True])
def test_bad_vocab_size_is_reported_against_the_targets_config(pair, value):
    cfg_path = pair.target_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] = value
    cfg_path.write_text(json.dumps(cfg))
    res = CliRunner().invoke(main, ["generate", "--target", str(pair.target_dir), "--mode", "ar",
                                    "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    one_line_error(res, f"{cfg_path}: vocab_size={value!r} must be a positive integer")


def test_a_file_given_as_a_directory_says_so(pair):
    res = CliRunner().invoke(main, ["generate", "--target", str(pair.target_dir / "config.json"), "--mode", "ar",
                                    "--prompt-ids", "1,2"])
    one_line_error(res, "is a file; the target directory is a directory")


def test_training_refuses_threads_beyond_the_machine(pair, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    res = CliRunner().invoke(main, ["train", "dflash", "--target", str(pair.target_dir), "--data", str(data),
                                    "--out", str(tmp_path / "o"), "--threads", "100000", "--quiet"])
    one_line_error(res, "--threads 100000 must be in 1..")


def test_parity_check_fails_on_non_finite_values_and_tolerances():
    from retrace.export.onnx_parity import ParityError, check

    ok = {"prefill": {"logits": 1e-6, "hidden": 1e-6, "kv": 0.0, "scale": 3.0}}
    assert check(ok, 1e-4, "target") == pytest.approx(1e-6 / 3.0)  # scaled by max(1, max|logit|)
    for bad in ({"logits": math.nan}, {"scale": math.nan}, {"kv": math.inf}):
        with pytest.raises(ParityError, match="non-finite"):
            check({"prefill": ok["prefill"] | bad}, 1e-4, "target")
    for tol in (math.nan, -1.0, math.inf):
        with pytest.raises(ParityError, match="tolerance must be a finite number"):
            check(ok, tol, "target")


@pytest.mark.parametrize(("extra", "needle"), [
    (("--tolerance", "nan"), "--tolerance must be a finite number"),
    (("--tolerance", "-1"), "--tolerance must be a finite number"),
    (("--block-size", "0"), "--block-size 0 must be in 2.."),
])
def test_build_refuses_bad_values_before_exporting(pair, tmp_path, extra, needle):
    from retrace.export.cli import main as export_main

    res = CliRunner().invoke(export_main, ["build", "--target", str(pair.target_dir), "--drafter",
                                           str(pair.drafter_dir), "--out", str(tmp_path / "b"), "-q", *extra])
    one_line_error(res, needle)
    assert not (tmp_path / "b").exists()


def test_integer_weights_in_a_float_checkpoint_are_refused(pair):
    from safetensors.torch import load_file, save_file

    path = next(pair.target_dir.glob("*.safetensors"))
    tensors = load_file(str(path))
    name = next(k for k in tensors if k.endswith("norm.weight"))
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, str(path), metadata={"format": "pt"})
    res = CliRunner().invoke(main, ["generate", "--target", str(pair.target_dir), "--mode", "ar",
                                    "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    one_line_error(res, "non-floating-point weights")
    assert name in res.output


def test_generate_temperature_below_the_floor_is_greedy(pair):
    tiny = gen(pair, "--temperature", "1e-38", "--json", "--mode", "dflash", "--max-new-tokens", "6")
    greedy = gen(pair, "--json", "--mode", "dflash", "--max-new-tokens", "6")
    assert tiny.exit_code == 0 and greedy.exit_code == 0, tiny.output
    out = [json.loads(r.output.strip().splitlines()[-1])["outputs"] for r in (tiny, greedy)]
    assert out[0][0]["token_ids"] == out[1][0]["token_ids"]


def test_prompts_file_huge_line_refused_by_its_length(pair, tmp_path, monkeypatch):
    from retrace.runtime.tokenizer import TextCodec

    calls = []
    monkeypatch.setattr(TextCodec, "encode", lambda self, text: calls.append(text) or [])
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 1_000_001}) + "\n")
    one_line_error(gen(pair, prompt=("--prompts-file", str(long))), "long.jsonl:1: the prompt has 1000001 characters")
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"prompt": "' + "t1x " * 3_500_000 + '"}\n')  # 14 MB on one line
    one_line_error(gen(pair, prompt=("--prompts-file", str(huge))), "huge.jsonl:1: a line of 14000014 characters")
    assert calls == []  # refused before anything was tokenized


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_serve_refuses_bad_drain_timeout(pair, value):
    res = CliRunner().invoke(main, ["serve", "--target", str(pair.target_dir), "--drain-timeout", value])
    one_line_error(res, "--drain-timeout must be a finite number >= 0")
