"""retrace-export triton (and build --triton-repo) and the --backend tensorrt-llm build hook."""

from __future__ import annotations

from pathlib import Path

import yaml  # noqa: F401  (pyyaml ships with transformers' dependencies)
from click.testing import CliRunner
from export_fixtures import pair_and_bundle
from rich.console import Console

from retrace.export import build as build_mod
from retrace.export.cli import main


def test_triton_command_writes_a_repository_atomically(tmp_path):
    built = pair_and_bundle()
    repo = tmp_path / "repo"
    args = ["triton", "--engine", str(built.bundle), "--out", str(repo), "--no-env", "--max-batch", "3",
            "--instances", "2", "--model-name", "rt"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    cfg = (repo / "rt" / "config.pbtxt").read_text()
    assert "decoupled: true" in cfg and 'backend: "python"' in cfg and "count: 2" in cfg
    assert (repo / "rt" / "1" / "model.py").is_file()
    assert (repo / "rt" / "bundle" / "manifest.json").is_file()
    # an existing repository is only replaced with --force, and a refusal leaves it untouched
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "--force" in again.output
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == before
    assert CliRunner().invoke(main, [*args, "--force"]).exit_code == 0
    assert not [p for p in tmp_path.iterdir() if p.name != "repo"], "temp directories left behind"


def test_triton_command_refuses_a_directory_that_is_not_a_bundle(tmp_path):
    res = CliRunner().invoke(main, ["triton", "--engine", str(tmp_path), "--out", str(tmp_path / "r"), "--no-env"])
    assert res.exit_code == 2 and "not an engine bundle" in res.output
    assert not (tmp_path / "r").exists()


def test_tensorrt_llm_hook_writes_the_dflash_deployment(tmp_path):
    built = pair_and_bundle()
    opts = build_mod.BuildOptions(target=built.target, drafter=built.drafter, out=tmp_path / "b", max_batch=4)
    staging = tmp_path / "staging"
    staging.mkdir()
    manifest = {"limits": {"block_size": 8, "max_seq_len": 160, "max_batch": 4}}
    ctx = build_mod.BuildContext(options=opts, staging=staging, manifest=manifest,
                                 reporter=build_mod.Reporter(Console(quiet=True), quiet=True))
    build_mod.tensorrt_llm_hook(ctx)
    out = staging / "tensorrt_llm"
    import yaml as _yaml

    spec = _yaml.safe_load((out / "extra_llm_api_options.yaml").read_text())["speculative_config"]
    assert spec["decoding_type"] == "DFlash" and spec["max_draft_len"] == 7
    assert (out / "target" / "model.safetensors").is_file() and not (out / "target").is_symlink()
    assert (out / "drafter" / "config.json").is_file()
    assert manifest["engines"]["tensorrt-llm"]["dir"] == "tensorrt_llm"
    assert any("conditioner" in n for n in manifest["engines"]["tensorrt-llm"]["notes"])


def test_tensorrt_llm_backend_needs_a_drafter(tmp_path):
    built = pair_and_bundle()
    res = CliRunner().invoke(main, ["build", "--target", str(built.target), "--out", str(tmp_path / "b"),
                                    "--backend", "tensorrt-llm"])
    assert res.exit_code == 2 and "needs --drafter" in res.output, res.output
    assert not Path(tmp_path / "b").exists()
