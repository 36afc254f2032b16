"""`retrace zoo tiny --size test`: layout, manifest, a pair that decodes losslessly, cache hit on a rerun."""

from __future__ import annotations

import json
from pathlib import Path

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
    modes = {f.relative_to(zoo_dir).as_posix(): f.stat().st_mode & 0o777 for f in zoo_dir.rglob("*") if f.is_file()}
    assert len(set(modes.values())) == 1, modes  # model.safetensors / config.json were 0600, the rest 0644
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
                                        str(zoo_dir / "drafter"), "--prompts-file",
                                        str(zoo_dir / "prompts" / "code.jsonl"),
                                        "--mode", mode, "--max-new-tokens", "24", "--json", "--threads", "1"])
        assert res.exit_code == 0, res.output
        outs[mode] = [o["token_ids"] for o in json.loads(res.output)["outputs"]]
    assert outs["dflash"] == outs["ar"]
    assert outs["retrace"] == outs["ar"]


def test_second_run_is_a_cache_hit(zoo_dir, monkeypatch):
    from retrace.train import numerics, zoo

    def no_build(*_a, **_k):
        raise AssertionError("a cache hit must not build (nor spawn the portable child)")

    monkeypatch.setattr(zoo, "_build", no_build)
    monkeypatch.setattr(numerics, "run_portable", no_build)
    before = (zoo_dir / "manifest.json").read_text()
    mtimes = {p: p.stat().st_mtime_ns for p in zoo_dir.rglob("*.safetensors")}
    res = CliRunner().invoke(main, ["zoo", "tiny", "--out", str(zoo_dir), "--size", "test", "--seed", "0", "--quiet"])
    assert res.exit_code == 0, res.output
    assert "cache hit" in res.output
    assert (zoo_dir / "manifest.json").read_text() == before
    assert {p: p.stat().st_mtime_ns for p in zoo_dir.rglob("*.safetensors")} == mtimes


def _digests(root):
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.suffix in (".safetensors", ".jsonl") or p.name == "tokenizer.json"}


def test_portable_build_is_bit_identical_across_thread_counts(zoo_dir, tmp_path):
    """The zoo builds under portable numerics (MKL and ATen on their AVX2 paths, fp32, eager, deterministic
    algorithms): a second build with another thread count gives the same bytes and the same metrics."""
    man = json.loads((zoo_dir / "manifest.json").read_text())
    assert man["numerics"]["mode"] == "portable" and man["numerics"]["cpu_capability"] == "AVX2"
    assert man["numerics"]["deterministic_algorithms"] is True
    again = tmp_path / "again"
    res = CliRunner().invoke(main, ["zoo", "tiny", "--out", str(again), "--size", "test", "--seed", "0", "--quiet",
                                    "--threads", "2"])
    assert res.exit_code == 0, res.output
    assert _digests(again) == _digests(zoo_dir) and len(_digests(zoo_dir)) >= 6
    assert _untimed(json.loads((again / "manifest.json").read_text())["metrics"]) == _untimed(man["metrics"])


def _untimed(d):
    if isinstance(d, dict):
        return {k: _untimed(v) for k, v in d.items() if k not in ("wall_s", "seconds")}
    return [_untimed(v) for v in d] if isinstance(d, list) else d


def test_a_failure_after_the_target_stage_keeps_it_for_the_next_run(tmp_path, monkeypatch, zoo_target_stage):
    """The drafter stage fails: nothing is installed at --out, the finished target stage waits beside it,
    and the next run trains only the later stages (the target trainer would fail if called) around that very
    target stage, byte for byte; the stash is gone once the zoo is installed. The first run's target stage
    comes from the session's (conftest.zoo_target_stage, copied in before the build's own cache check)."""
    import shutil

    from retrace.train import dflash, zoo, zoo_target

    out = tmp_path / "tiny"
    real_dflash, real_stage = dflash.train_dflash, zoo_target.build_target_stage

    def boom(*_a, **_k):
        raise RuntimeError("the drafter stage failed")

    def session_stage(out_dir, *a, **k):
        for sub in ("target", "prompts", "data"):
            shutil.copytree(zoo_target_stage[0] / sub, Path(out_dir) / sub)
        return real_stage(out_dir, *a, **k)

    monkeypatch.setattr(zoo_target, "build_target_stage", session_stage)
    monkeypatch.setattr(dflash, "train_dflash", boom)
    with pytest.raises(RuntimeError, match="drafter stage failed"):
        zoo.build_zoo(out, size="test", seed=0, progress=False, threads=1)
    stash = zoo.target_stash(out)
    assert not out.exists() and zoo_target.cached_metrics(stash, "test", 0) is not None
    assert not [p for p in tmp_path.iterdir() if ".retrace-" in p.name]  # no temp sibling left

    kept = _digests(stash)
    monkeypatch.setattr(dflash, "train_dflash", real_dflash)
    monkeypatch.setattr(zoo_target, "build_target_stage", real_stage)
    monkeypatch.setattr(zoo_target, "_build", lambda *a, **k: pytest.fail("the target stage was trained again"))
    man = zoo.build_zoo(out, size="test", seed=0, progress=False, threads=1)
    assert man["cached"] is False and not stash.exists()
    assert man["metrics"]["lossless_check"]["greedy_retrace_equals_target"]
    built = _digests(out)
    assert {k: built[k] for k in kept} == kept and any(k.startswith("drafter/") for k in built)
