"""The manifest itself is covered by a bundle's verification: a manifest edited to point at a graph outside
the bundle, to drop the `files` entry of a tampered weights file, or to change any field, is refused by
loading (Bundle.open) and by `retrace-export inspect` (exit 1), not only warned about."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from retrace.engines.bundle import Bundle, BundleError, manifest_digest, write_manifest
from retrace.export.cli import main as export_main


def graph_bundle(root: Path) -> Path:
    for g in ("target", "drafter"):
        (root / g).mkdir(parents=True)
        (root / g / "model.onnx").write_bytes(f"{g} graph".encode() * 10)
        (root / g / "model.onnx.data").write_bytes(bytes(range(256)) * 4)
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    write_manifest(root, {
        "backend": "onnxruntime", "dtype": "float32",
        "limits": {"max_batch": 2, "max_seq_len": 64, "block_size": 4},
        "models": {"target": {"config": {"vocab_size": 128}}, "drafter": None, "conditioner": None},
        "graphs": {g: {"path": f"{g}/model.onnx", "data": f"{g}/model.onnx.data"} for g in ("target", "drafter")},
        "tokenizer": {"dir": "tokenizer", "files": ["tokenizer.json"]},
    })
    return root


def edit(root: Path, fn, rehash: bool = True) -> None:
    """Change the manifest as an attacker would: with manifest_sha256 recomputed (rehash) or left stale."""
    m = json.loads((root / "manifest.json").read_text())
    fn(m)
    if rehash:
        m["manifest_sha256"] = manifest_digest(m)
    (root / "manifest.json").write_text(json.dumps(m))


def refused(root: Path, needle: str) -> None:
    with pytest.raises(BundleError, match=needle):
        Bundle.open(root)
    with pytest.raises(BundleError, match=needle):
        Bundle.open(root, verify_hashes=False)  # the quick check covers the manifest too
    res = CliRunner().invoke(export_main, ["inspect", str(root)])
    assert res.exit_code == 1 and "not verified" in res.output, res.output


def test_an_intact_bundle_loads_and_inspects_clean(tmp_path):
    b = graph_bundle(tmp_path / "b")
    assert Bundle.open(b).graph_path("target") == b / "target" / "model.onnx"
    res = CliRunner().invoke(export_main, ["inspect", str(b)])
    assert res.exit_code == 0 and "all files match" in res.output and "warning" not in res.output


@pytest.mark.parametrize("where", ["absolute", "dotdot", "symlink"])
def test_graph_path_outside_the_bundle_is_refused(tmp_path, where):
    b = graph_bundle(tmp_path / "b")
    evil = tmp_path / "evil.onnx"
    evil.write_bytes(b"tampered graph")
    if where == "absolute":
        edit(b, lambda m: m["graphs"]["target"].update(path=str(evil)))
    elif where == "dotdot":
        edit(b, lambda m: m["graphs"]["target"].update(path="../evil.onnx"))
    else:  # a listed file replaced by a symlink to a file outside (same size and hash: only the path tells)
        (tmp_path / "outside.onnx").write_bytes((b / "target" / "model.onnx").read_bytes())
        (b / "target" / "model.onnx").unlink()
        os.symlink(tmp_path / "outside.onnx", b / "target" / "model.onnx")
    refused(b, "outside the bundle|not a path inside")


@pytest.mark.parametrize("how", ["drop_entry", "empty_files"])
def test_tampered_data_file_without_a_files_entry_is_refused(tmp_path, how):
    b = graph_bundle(tmp_path / "b")
    (b / "target" / "model.onnx.data").write_bytes(b"\xff" * 1024)
    if how == "drop_entry":
        edit(b, lambda m: m["files"].pop("target/model.onnx.data"))
    else:
        edit(b, lambda m: m.update(files={}))
    refused(b, "has no files entry")


def test_data_entry_removed_from_the_graph_too_is_still_refused(tmp_path):
    b = graph_bundle(tmp_path / "b")  # the data file sits beside the graph: it must be listed anyway
    edit(b, lambda m: (m["files"].pop("target/model.onnx.data"), m["graphs"]["target"].update(data=None)))
    refused(b, "has no files entry")


def test_any_edit_of_the_manifest_is_detected(tmp_path):
    b = graph_bundle(tmp_path / "b")
    edit(b, lambda m: m["limits"].update(max_batch=4), rehash=False)
    refused(b, "edited after the build")


def test_a_file_not_in_the_manifest_is_refused(tmp_path):
    b = graph_bundle(tmp_path / "b")
    (b / "target" / "extra.onnx").write_bytes(b"x")
    refused(b, "not in the manifest")


def test_manifest_without_self_hash_still_gets_every_structural_check(tmp_path):
    b = graph_bundle(tmp_path / "b")  # as built before manifest_sha256 existed
    edit(b, lambda m: m.pop("manifest_sha256"), rehash=False)
    assert Bundle.open(b)
    res = CliRunner().invoke(export_main, ["inspect", str(b)])
    assert res.exit_code == 0 and "no manifest_sha256" in res.output
    edit(b, lambda m: m["graphs"]["target"].update(path="/etc/passwd"), rehash=False)
    refused(b, "not a path inside")


@pytest.mark.parametrize(("change", "needle"), [
    (lambda m: m["limits"].update(max_batch="eight"), "limits.max_batch must be a positive integer"),
    (lambda m: m["limits"].update(max_batch=-3), "limits.max_batch must be a positive integer"),
    (lambda m: m["limits"].update(max_seq_len=2.5), "limits.max_seq_len must be a positive integer"),
    (lambda m: m["models"]["target"].pop("config"), "models.target.config"),
    (lambda m: m["tokenizer"].update(dir="/tmp"), "tokenizer.dir"),
])
def test_malformed_manifest_fields_are_clear_errors(tmp_path, change, needle):
    b = graph_bundle(tmp_path / "b")
    edit(b, change)
    refused(b, needle)


def test_the_owner_marker_is_not_bundle_content(tmp_path):
    from retrace.output_dir import write_marker

    b = graph_bundle(tmp_path / "b")
    write_marker(b, "engine-bundle")
    assert Bundle.open(b)
    assert CliRunner().invoke(export_main, ["inspect", str(b)]).exit_code == 0


def test_a_tokenizer_symlink_out_of_the_target_is_never_copied_into_a_bundle(tiny_pair, tmp_path):
    """merges.txt -> /etc/passwd (any file outside the target directory) is refused by `retrace-export build`
    at its input checks, naming the link; a link to a file inside the directory is fine."""
    from retrace.export.build import tokenizer_files

    target = tiny_pair(layers=2).target_dir
    (target / "tokenizer.json").write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    (target / "merges.txt").symlink_to(secret)
    out = tmp_path / "bundle"
    res = CliRunner().invoke(export_main, ["build", "--target", str(target), "--out", str(out), "-q"])
    assert res.exit_code == 2, res.output
    assert f"{target / 'merges.txt'} is a symbolic link to {secret}, outside the target directory" in res.output
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    (target / "merges.txt").unlink()
    (target / "real-merges.txt").write_text("#version: 0.2\n")
    (target / "merges.txt").symlink_to("real-merges.txt")
    assert tokenizer_files(target) == ["tokenizer.json", "merges.txt"]


def test_a_bundle_file_linking_out_of_the_bundle_is_refused_also_by_triton(tmp_path):
    """Even a bundle whose manifest an attacker re-hashed over such a link does not load and is not copied
    into a Triton repository."""
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    root = graph_bundle(tmp_path / "b")
    (root / "tokenizer" / "merges.txt").symlink_to(secret)
    m = json.loads((root / "manifest.json").read_text())
    m["tokenizer"]["files"].append("merges.txt")
    write_manifest(root, m)  # every file (the link's target's bytes) hashed in, the manifest re-hashed
    assert "tokenizer/merges.txt" in json.loads((root / "manifest.json").read_text())["files"]
    refused(root, "outside|not a path inside")
    res = CliRunner().invoke(export_main, ["triton", "--engine", str(root), "--out", str(tmp_path / "repo"),
                                           "--no-env"])
    assert res.exit_code == 2 and not (tmp_path / "repo").exists(), res.output
