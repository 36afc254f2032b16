"""The trained zoo that ships: its files match the release record, the record names the code's own recipe,
`retrace zoo tiny` installs it hash-checked (then hits its cache), and a changed, missing or extra file is
refused with its name and nothing installed."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from retrace.cli import main
from retrace.engines.bundle import manifest_digest
from retrace.output_dir import OutputDirError
from retrace.train import zoo_release
from retrace.train.zoo_release import ZooReleaseError

ROOT = zoo_release.release_dir("small", 0)


@pytest.fixture(scope="module")
def rel():
    r = zoo_release.shipped("small", 0)
    assert r is not None, f"no shipped zoo at {ROOT}"
    return r


def test_shipped_files_match_the_release_record(rel):
    assert zoo_release.problems(ROOT / "zoo", rel) == []
    assert {"target/model.safetensors", "drafter/model.safetensors", "drafter/retrace.safetensors",
            "target/tokenizer.json", "prompts/code.jsonl", "manifest.json"} <= set(rel["files"])
    assert set(rel["reproducible"]) <= set(rel["files"]) and "manifest.json" not in rel["reproducible"]
    assert sum(f["size"] for f in rel["files"].values()) < 40 << 20  # the repository stays small


def test_shipped_zoo_was_built_by_the_recipe_on_this_checkout(rel):
    code = zoo_release.recipe("small", 0)
    assert rel["recipe_sha256"] == manifest_digest(code), (
        "the zoo recipe changed (retrace/train/zoo.py PRESETS, the target stage, prompts) but the shipped zoo "
        f"was built by the old one: run `make zoo-release` and commit retrace/train/shipped/. Differs: "
        f"{sorted(k for k in code if code[k] != rel['recipe'].get(k))}")
    man = json.loads((ROOT / "zoo" / "manifest.json").read_text())
    assert (man["size"], man["seed"], man["key"]["numerics"]) == ("small", 0, "portable")
    assert man["metrics"]["lossless_check"]["greedy_retrace_equals_target"] is True


def test_zoo_tiny_installs_the_shipped_pair_then_hits_its_cache(tmp_path, rel):
    out = tmp_path / "zoo"
    r1 = CliRunner().invoke(main, ["zoo", "tiny", "--out", str(out), "--quiet"])
    assert r1.exit_code == 0, r1.output
    assert "installed the shipped zoo" in r1.output and "T0: tau dflash" in r1.output
    assert zoo_release.problems(out, rel) == []
    (out / "draft-ar").mkdir()  # `retrace zoo draft-ar` output beside it stays a cache hit
    (out / "draft-ar" / "config.json").write_text("{}")
    r2 = CliRunner().invoke(main, ["zoo", "tiny", "--out", str(out), "--quiet"])
    assert r2.exit_code == 0 and "cache hit" in r2.output, r2.output
    # an edited installed file is not a cache hit: the shipped bytes come back
    (out / "drafter" / "config.json").write_text("{}")
    r3 = CliRunner().invoke(main, ["zoo", "tiny", "--out", str(out), "--quiet"])
    assert r3.exit_code == 0 and "installed the shipped zoo" in r3.output, r3.output
    assert zoo_release.problems(out, rel) == []


def test_installed_pair_decodes_losslessly(tmp_path):
    out = tmp_path / "zoo"
    zoo_release.install(out, progress=False)
    outs = {}
    for mode in ("ar", "retrace"):
        res = CliRunner().invoke(main, ["generate", "--target", str(out / "target"), "--drafter", str(out / "drafter"),
                                        "--prompt", "def parse_args(argv):", "--prompt", "import os\n", "--mode", mode,
                                        "--max-new-tokens", "24", "--json", "--threads", "1"])
        assert res.exit_code == 0, res.output
        outs[mode] = [o["token_ids"] for o in json.loads(res.output)["outputs"]]
    assert outs["retrace"] == outs["ar"]


@pytest.fixture
def release_copy(tmp_path):
    dst = tmp_path / "release"
    shutil.copytree(ROOT, dst)
    return dst


@pytest.mark.parametrize("damage, named", [
    ("flip", "drafter/model.safetensors"),
    ("remove", "target/tokenizer.json"),
    ("extra", "target/extra.bin"),
])
def test_install_refuses_a_changed_release_naming_the_file(tmp_path, release_copy, damage, named):
    p = release_copy / "zoo" / named
    if damage == "flip":
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 1
        p.write_bytes(bytes(data))
    elif damage == "remove":
        p.unlink()
    else:
        p.write_bytes(b"x")
    out = tmp_path / "zoo"
    with pytest.raises(ZooReleaseError, match=named.replace(".", r"\.")):
        zoo_release.install(out, root=release_copy, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".zoo.*"))  # nothing half-written


def test_install_refuses_an_edited_release_record(tmp_path, release_copy):
    rec = json.loads((release_copy / "release.json").read_text())
    rec["files"]["target/model.safetensors"]["sha256"] = "0" * 64
    (release_copy / "release.json").write_text(json.dumps(rec))
    with pytest.raises(ZooReleaseError, match="edited after it was written"):
        zoo_release.install(tmp_path / "zoo", root=release_copy, progress=False)


def test_install_keeps_a_zoo_of_another_seed_without_force(tmp_path, rel):
    out = tmp_path / "zoo"
    zoo_release.install(out, progress=False)
    man = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps(dict(man, seed=1)))
    with pytest.raises(OutputDirError, match="seed 1"):
        zoo_release.install(out, progress=False)
    assert json.loads((out / "manifest.json").read_text())["seed"] == 1  # untouched
    zoo_release.install(out, force=True, progress=False)
    assert zoo_release.problems(out, rel) == []


def _man(pooled, eval_settings=None):
    tau = {T: {"dflash": p, "retrace": p, "dflash_pooled": p, "retrace_pooled": p} for T, p in pooled.items()}
    return {"size": "small", "seed": 0, "key": {"preset": {"eval": eval_settings or {"n_prompts": 128}}},
            "eval_prompts": {"n": 128}, "metrics": {"tau": tau, "eval": {}}}


def test_the_baseline_record_compares_pooled_tau_on_the_same_prompts_only():
    rec = zoo_release.baseline_record(_man({"T0": 3.0, "T1": 1.5}), _man({"T0": 2.0, "T1": 1.25}), "legacy")
    assert rec["recipe"] == "legacy" and rec["tau"]["T0"]["dflash_pooled"] == 2.0
    assert rec["pooled_tau_ratio"] == {"T0": {"dflash_pooled": 1.5, "retrace_pooled": 1.5},
                                       "T1": {"dflash_pooled": 1.2, "retrace_pooled": 1.2}}
    with pytest.raises(ZooReleaseError, match="other prompts or settings"):
        zoo_release.baseline_record(_man({"T0": 3.0}), _man({"T0": 2.0}, {"n_prompts": 64}), "legacy")
