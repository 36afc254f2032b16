"""`retrace-export build`: the bundle it writes (manifest, hashes, tokenizer, limits), input checks,
atomicity (errors and Ctrl-C leave nothing behind), and --force semantics.

The session bundle (tests/export_fixtures.py) is the one real build. Tests that build again replace the
two export stages with copies of the session bundle's graphs (`fast_exports`): every other stage (input
checks, model loading, onnx.checker, the ORT-vs-torch parity check, tokenizer, hashing, the rename) runs
for real.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from export_fixtures import BLOCK, MAX_BATCH, MAX_SEQ, copy_bundle, pair_and_bundle

from retrace.engines import Bundle, read_manifest
from retrace.export import build as build_mod
from retrace.export.cli import main
from retrace.export.onnx_export import census


@pytest.fixture(scope="module")
def built():
    return pair_and_bundle()


def _copy_graph(name: str):
    def fake(model, out_dir: Path, attention: str, cache_dir=None):
        src = pair_and_bundle().bundle / name
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            shutil.copy2(f, out_dir / f.name)
        proto = onnx.load(str(out_dir / "model.onnx"), load_external_data=False)
        return census(proto, name, out_dir / "model.onnx", out_dir / "model.onnx.data",
                      [i.name for i in proto.graph.input], [o.name for o in proto.graph.output], attention)
    return fake


@pytest.fixture
def fast_exports(monkeypatch, built):
    monkeypatch.setattr(build_mod, "export_target_graph", _copy_graph("target"))
    monkeypatch.setattr(build_mod, "export_drafter_graph", _copy_graph("drafter"))


def cli_build(built, out, *extra):
    return CliRunner().invoke(main, ["build", "--target", str(built.target), "--drafter", str(built.drafter),
                                     "--out", str(out), *map(str, extra)])


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# -- the bundle -------------------------------------------------------------------------------------------------
def test_bundle_layout_and_manifest(built):
    b = built.bundle
    m = read_manifest(b)
    assert m["backend"] == "onnxruntime" and m["dtype"] == "float32"
    assert m["limits"] == {"max_batch": MAX_BATCH, "max_seq_len": MAX_SEQ, "block_size": BLOCK}
    assert set(m["files"]) == {"target/model.onnx", "target/model.onnx.data", "drafter/model.onnx",
                               "drafter/model.onnx.data", "tokenizer/tokenizer.json"}
    Bundle.open(b)  # every sha256 matches
    models = m["models"]
    tcfg = json.loads((built.target / "config.json").read_text())
    assert models["target"]["config"] == tcfg
    assert models["target"]["tap_layers"] == models["drafter"]["config"]["dflash_config"]["target_layer_ids"]
    assert models["drafter"]["config"]["block_size"] == BLOCK
    assert models["conditioner"]["config"]["format"] == "retrace-conditioner"
    assert models["target"]["eos_token_ids"] == []
    assert (b / "tokenizer" / "tokenizer.json").read_bytes() == (built.target / "tokenizer.json").read_bytes()
    assert m["graphs"]["drafter"]["custom_nodes"] == 1 and m["graphs"]["target"]["opset"] == 23
    for g in ("target", "drafter"):
        assert m["parity"][g]["max_scaled_logits_diff"] < 1e-4
    assert m["build"]["versions"]["onnxruntime"] and m["retrace_version"]


def test_build_output_shows_stages_and_summary(built):
    out = built.build_output
    for stage in ("check inputs", "export target graph", "export drafter graph", "check graphs",
                  "parity: target", "parity: drafter", "hash files", "move into place"):
        assert stage in out, stage
    assert "retrace::GatedSuffixFusion" in out and "max |Δlogits|" in out
    assert "model.onnx.data" in out and "built in" in out and "retrace generate --engine" in out
    assert not leftovers(built.bundle.parent, "bundle")


def test_eos_ids_come_from_generation_config(built, tmp_path, fast_exports):
    from runtime_fixtures import copy_with_eos

    target = copy_with_eos(built.target, tmp_path / "target", eos=7)
    out = tmp_path / "b"
    res = CliRunner().invoke(main, ["build", "--target", str(target), "--drafter", str(built.drafter), "--out",
                                    str(out), "-q"])
    assert res.exit_code == 0, res.output
    m = read_manifest(out)
    assert m["models"]["target"]["eos_token_ids"] == [7]
    from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

    assert OnnxRuntimeBackend.from_bundle(out).target_config.eos_token_ids == (7,)


# -- input checks (fail fast, before any export) ---------------------------------------------------------------
@pytest.mark.parametrize("args,msg", [
    (["--block-size", "99"], "must be in 2..8"),
    (["--max-seq-len", "100000"], "exceeds the target's max_position_embeddings"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
])
def test_bad_options_are_one_line_errors(built, tmp_path, args, msg):
    res = cli_build(built, tmp_path / "b", *args)
    assert res.exit_code == 2 and res.output.strip().splitlines()[-1].startswith("error:") and msg in res.output
    assert not (tmp_path / "b").exists() and not leftovers(tmp_path, "b")


def test_tensorrt_backend_without_tensorrt_fails_fast(built, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError
    res = cli_build(built, tmp_path / "b", "--backend", "tensorrt")
    assert res.exit_code == 3 and "pip install tensorrt" in res.output, res.output
    assert "export target graph" not in res.output  # refused before any export
    assert not (tmp_path / "b").exists() and not leftovers(tmp_path, "b")


def test_missing_or_mismatched_inputs(built, tmp_path):
    res = CliRunner().invoke(main, ["build", "--target", str(tmp_path / "nope"), "--drafter", str(built.drafter),
                                    "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "target directory not found" in res.output
    other = tmp_path / "drafter"
    shutil.copytree(built.drafter, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["hidden_size"] = 32
    (other / "config.json").write_text(json.dumps(cfg))
    res = CliRunner().invoke(main, ["build", "--target", str(built.target), "--drafter", str(other),
                                    "--out", str(tmp_path / "b")])
    assert res.exit_code == 2 and "does not fit the target" in res.output
    assert not (tmp_path / "b").exists()


# -- atomicity ----------------------------------------------------------------------------------------------
def _interrupt_in_drafter_export(monkeypatch):
    def boom(model, out_dir: Path, attention: str, cache_dir=None):
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "model.onnx.data").write_bytes(b"\0" * 1000)  # a half-written graph
        raise KeyboardInterrupt

    monkeypatch.setattr(build_mod, "export_drafter_graph", boom)


def test_ctrl_c_mid_build_leaves_nothing(built, tmp_path, monkeypatch, fast_exports):
    _interrupt_in_drafter_export(monkeypatch)
    out = tmp_path / "sub" / "b"
    with pytest.raises(KeyboardInterrupt):
        build_mod.build_bundle(build_mod.BuildOptions(built.target, built.drafter, out))
    assert not out.exists() and not leftovers(out.parent, "b")
    res = cli_build(built, out)  # the CLI: exit 130 and a message, still nothing left
    assert res.exit_code == 130 and "interrupted" in res.output
    assert not out.exists() and not leftovers(out.parent, "b")


def test_ctrl_c_during_force_rebuild_keeps_the_old_bundle(built, tmp_path, monkeypatch, fast_exports):
    out = copy_bundle(tmp_path / "b")
    before = (out / "manifest.json").read_bytes()
    _interrupt_in_drafter_export(monkeypatch)
    res = cli_build(built, out, "--force")
    assert res.exit_code == 130
    assert (out / "manifest.json").read_bytes() == before and not leftovers(tmp_path, "b")
    Bundle.open(out)


def test_failed_parity_check_fails_the_build_cleanly(built, tmp_path, fast_exports):
    out = tmp_path / "b"
    res = cli_build(built, out, "--tolerance", "1e-12")
    assert res.exit_code == 2
    assert "parity check failed" in res.output and "tolerance 1e-12" in res.output
    assert not out.exists() and not leftovers(tmp_path, "b")


def test_stale_temp_dirs_of_killed_builds_are_removed(built, tmp_path, fast_exports):
    dead = tmp_path / ".b.building-999999999-abcd"  # no such PID
    dead.mkdir()
    (dead / "junk").write_text("x")
    alive = tmp_path / f".b.building-{os.getppid()}-abcd"  # a live process: maybe another build, kept
    alive.mkdir()
    res = cli_build(built, tmp_path / "b", "-q")
    assert res.exit_code == 0, res.output
    assert not dead.exists() and alive.exists()


# -- --force ------------------------------------------------------------------------------------------------
def test_existing_bundle_needs_force(built, tmp_path, fast_exports):
    out = copy_bundle(tmp_path / "b")
    before = (out / "manifest.json").read_bytes()
    res = cli_build(built, out)
    assert res.exit_code == 2 and "already exists; pass --force" in res.output
    assert (out / "manifest.json").read_bytes() == before
    res = cli_build(built, out, "--force", "--max-batch", 2, "-q")
    assert res.exit_code == 0, res.output
    m = read_manifest(out)
    assert m["limits"]["max_batch"] == 2 and (out / "manifest.json").read_bytes() != before
    Bundle.open(out)
    assert not leftovers(tmp_path, "b")


def test_force_never_deletes_something_that_is_not_a_bundle(built, tmp_path, fast_exports):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    res = cli_build(built, precious, "--force")
    assert res.exit_code == 2 and "not an engine bundle" in res.output
    assert (precious / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert cli_build(built, a_file, "--force").exit_code == 2 and a_file.read_text() == "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_build(built, empty, "-q").exit_code == 0 and Bundle.open(empty)  # an empty directory is free


# -- float16, target only ---------------------------------------------------------------------------------
def test_float16_target_only_bundle(built, tmp_path):
    """No --drafter: a target-only (ar) bundle; --dtype float16: fp16 graph I/O and weights, parity
    within the fp16 tolerance, and the runtime decodes with it (speculative modes are refused)."""
    from retrace.errors import RetraceError
    from retrace.runtime import Runtime, SamplingParams

    out = tmp_path / "b16"
    res = CliRunner().invoke(main, ["build", "--target", str(built.target), "--out", str(out), "--dtype", "float16",
                                    "--max-seq-len", "64"])
    assert res.exit_code == 0, res.output
    assert "modes: ar)" in res.output
    m = read_manifest(out)
    assert m["dtype"] == "float16" and m["models"]["drafter"] is None and set(m["graphs"]) == {"target"}
    assert m["limits"]["block_size"] is None
    assert 0 < m["parity"]["target"]["max_scaled_logits_diff"] < 3e-2
    g = onnx.load(str(out / "target" / "model.onnx"), load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in g.graph.input}
    outs = {o.name: o.type.tensor_type.elem_type for o in g.graph.output}
    assert types["past_key_0"] == onnx.TensorProto.FLOAT16 and outs["logits"] == onnx.TensorProto.FLOAT
    rt = Runtime.from_bundle(out, threads=1)
    r = rt.generate([[3, 1, 4, 1, 5]], SamplingParams(max_new_tokens=16), "ar")[0]
    assert len(r.token_ids) == 16 and all(0 <= t < 96 for t in r.token_ids)
    with pytest.raises(RetraceError, match="needs a drafter"):
        rt.generate([[1, 2]], SamplingParams(max_new_tokens=4), "dflash")
    res = CliRunner().invoke(main, ["inspect", str(out)])
    assert res.exit_code == 0 and "drafter: none" in res.output and "past_len" in res.output


# -- DFlash only ------------------------------------------------------------------------------------------
def test_no_conditioner_gives_a_plain_dflash_bundle(built, tmp_path, monkeypatch):
    """--no-conditioner (or a drafter without one): the drafter graph has no suffix inputs, no custom node
    and no function (any ONNX runtime runs it); the bundle decodes dflash exactly, retrace is refused."""
    from export_fixtures import MAX_BATCH
    from runtime_fixtures import hf_greedy, load_hf_target

    from retrace.errors import RetraceError
    from retrace.export.onnx_export import drafter_io
    from retrace.plugins import onnx_function as of
    from retrace.runtime import Runtime, SamplingParams

    monkeypatch.setattr(build_mod, "export_target_graph", _copy_graph("target"))  # the drafter export is real
    out = tmp_path / "dflash"
    res = cli_build(built, out, "--no-conditioner", "--max-batch", MAX_BATCH, "--max-seq-len", 96)
    assert res.exit_code == 0, res.output
    assert "0 retrace::GatedSuffixFusion" in res.output and "modes: ar, dflash)" in res.output
    m = read_manifest(out)
    assert m["models"]["conditioner"] is None and m["graphs"]["drafter"]["custom_nodes"] == 0
    assert set(m["parity"]["drafter"]["cases"]) == {"first_round", "dflash"}
    proto = onnx.load(str(out / "drafter" / "model.onnx"), load_external_data=False)
    assert [i.name for i in proto.graph.input] == drafter_io(1, suffix=False)[0]
    assert not of.fusion_nodes(proto) and not proto.functions
    assert not any(o.domain == "retrace" for o in proto.opset_import)
    rt = Runtime.from_bundle(out, threads=1)
    prompt = [5, 17, 2, 40, 9]
    got = rt.generate([prompt], SamplingParams(max_new_tokens=40), "dflash")[0].token_ids
    assert got == hf_greedy(load_hf_target(built.target), prompt, 40)
    with pytest.raises(RetraceError, match="needs a ReTrace conditioner"):
        rt.generate([prompt], SamplingParams(max_new_tokens=4), "retrace")
