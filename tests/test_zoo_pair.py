"""`retrace zoo tiny --size test`: layout, manifest, a pair that decodes losslessly, cache hit on a rerun."""

from __future__ import annotations

import json
import time

import pytest
from click.testing import CliRunner

from retrace.cli import main


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("zoo") / "tiny"
    res = CliRunner().invoke(main, ["zoo", "tiny", "--out", str(out), "--size", "test", "--seed", "0", "--quiet",
                                    "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert "built" in res.output
    return out


def test_layout_and_manifest(zoo_dir):
    for f in ("target/config.json", "target/model.safetensors", "target/tokenizer.json", "drafter/config.json",
              "drafter/model.safetensors", "drafter/retrace_config.json", "drafter/retrace.safetensors",
              "prompts/code.jsonl", "prompts/docs.jsonl", "manifest.json"):
        assert (zoo_dir / f).is_file(), f
    assert not (zoo_dir / "drafter" / "train_state").exists()
    assert not list(zoo_dir.parent.glob(".tiny.tmp-*"))  # the temporary build dir is gone
    man = json.loads((zoo_dir / "manifest.json").read_text())
    assert man["seed"] == 0 and man["size"] == "test"
    assert {"torch", "transformers", "tokenizers", "python", "retrace"} <= set(man["versions"])
    m = man["metrics"]
    assert m["target_ppl"] > 1
    assert m["drafter_train_loss"] is not None
    for T in ("T0", "T1"):
        t = m["tau"][T]
        assert t["dflash"] >= 1.0 and t["retrace"] >= 1.0
        assert {"mean_diff", "se", "n"} <= set(t["paired"])
    assert m["lossless_check"]["greedy_retrace_equals_target"] is True
    assert {"target_s", "drafter_s", "conditioner_s", "eval_s", "total_s"} <= set(man["timings"])
    assert isinstance(man["sample"]["completion"], str)


def test_pair_generates_losslessly(zoo_dir):
    outs = {}
    for mode in ("ar", "dflash", "retrace"):
        res = CliRunner().invoke(main, ["generate", "--target", str(zoo_dir / "target"), "--drafter",
                                        str(zoo_dir / "drafter"), "--prompts-file", str(zoo_dir / "prompts" / "code.jsonl"),
                                        "--mode", mode, "--max-new-tokens", "24", "--json", "--threads", "1"])
        assert res.exit_code == 0, res.output
        outs[mode] = [o["token_ids"] for o in json.loads(res.output)["outputs"]]
    assert outs["dflash"] == outs["ar"]
    assert outs["retrace"] == outs["ar"]


def test_second_run_is_a_cache_hit(zoo_dir):
    before = (zoo_dir / "manifest.json").read_text()
    t0 = time.perf_counter()
    res = CliRunner().invoke(main, ["zoo", "tiny", "--out", str(zoo_dir), "--size", "test", "--seed", "0", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "cache hit" in res.output
    assert time.perf_counter() - t0 < 10
    assert (zoo_dir / "manifest.json").read_text() == before
