"""The engine bundle format (retrace.engines): manifest, sha256 of every file, verification, refusals.

Fast: synthetic bundles, no export. The ONNX Runtime backend's refusals are checked on the session's real
bundle (tests/export_fixtures.py) at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from retrace.engines import (
    FORMAT,
    FORMAT_VERSION,
    Bundle,
    BundleError,
    check_files,
    read_manifest,
    write_manifest,
)
from retrace.errors import RetraceError
from retrace.export.cli import main as export_main


def fake_bundle(root: Path) -> Path:
    (root / "target").mkdir(parents=True)
    (root / "target" / "model.onnx").write_bytes(b"graph" * 100)
    (root / "target" / "model.onnx.data").write_bytes(bytes(range(256)) * 64)
    (root / "tokenizer").mkdir()
    (root / "tokenizer" / "tokenizer.json").write_text("{}")
    write_manifest(root, {"backend": "onnxruntime", "dtype": "float32",
                          "limits": {"max_batch": 2, "max_seq_len": 64, "block_size": 4}})
    return root


def test_manifest_lists_and_hashes_every_file(tmp_path):
    b = fake_bundle(tmp_path / "b")
    m = read_manifest(b)
    assert m["format"] == FORMAT and m["format_version"] == FORMAT_VERSION
    assert sorted(m["files"]) == ["target/model.onnx", "target/model.onnx.data", "tokenizer/tokenizer.json"]
    import hashlib

    data = (b / "target" / "model.onnx.data").read_bytes()
    assert m["files"]["target/model.onnx.data"] == {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    assert all(c.status == "ok" for c in check_files(b, m))
    assert Bundle.open(b).limits == {"max_batch": 2, "max_seq_len": 64, "block_size": 4}


@pytest.mark.parametrize("change", ["flip", "truncate", "delete"])
def test_tampered_file_is_detected(tmp_path, change):
    b = fake_bundle(tmp_path / "b")
    f = b / "target" / "model.onnx.data"
    data = bytearray(f.read_bytes())
    if change == "flip":  # same size: only the hash can tell
        data[1000] ^= 0xFF
        f.write_bytes(bytes(data))
    elif change == "truncate":
        f.write_bytes(bytes(data[:-1]))
    else:
        f.unlink()
    with pytest.raises(BundleError, match="target/model.onnx.data"):
        Bundle.open(b)
    status = {c.path: c.status for c in check_files(b, read_manifest(b))}
    assert status["target/model.onnx.data"] == {"flip": "sha256", "truncate": "size", "delete": "missing"}[change]
    if change == "flip":  # the opt-out (sizes only) does not hash, so it loads
        Bundle.open(b, verify_hashes=False)
    else:  # ... but still catches what sizes show
        with pytest.raises(BundleError):
            Bundle.open(b, verify_hashes=False)


def test_large_files_verify_piece_by_piece(tmp_path, monkeypatch):
    """Files over bundle.PIECE bytes also record per-piece sha256 (verified in parallel on load); every
    byte is still covered, and the whole-file sha256 stays in the manifest."""
    import hashlib

    from retrace.engines import bundle as bundle_mod

    monkeypatch.setattr(bundle_mod, "PIECE", 4096)
    b = fake_bundle(tmp_path / "b")  # model.onnx.data: 16384 bytes -> 4 pieces
    entry = read_manifest(b)["files"]["target/model.onnx.data"]
    data = (b / "target" / "model.onnx.data").read_bytes()
    assert entry["chunk_size"] == 4096 and len(entry["chunks"]) == 4
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert entry["chunks"][2] == hashlib.sha256(data[8192:12288]).hexdigest()
    assert "chunks" not in read_manifest(b)["files"]["target/model.onnx"]  # 500 bytes: whole file only
    Bundle.open(b)
    raw = bytearray(data)
    raw[-1] ^= 1  # the last byte of the last piece
    (b / "target" / "model.onnx.data").write_bytes(bytes(raw))
    with pytest.raises(BundleError, match=r"model.onnx.data sha256 \(piece 3"):
        Bundle.open(b)


def test_unknown_format_version_and_non_bundles_are_refused(tmp_path):
    b = fake_bundle(tmp_path / "b")
    m = json.loads((b / "manifest.json").read_text())
    (b / "manifest.json").write_text(json.dumps({**m, "format_version": 99}))
    with pytest.raises(BundleError, match="format version 99 is not supported"):
        Bundle.open(b)
    (b / "manifest.json").write_text(json.dumps({**m, "format": "something-else"}))
    with pytest.raises(BundleError, match="not a retrace engine bundle"):
        read_manifest(b)
    (b / "manifest.json").write_text("{not json")
    with pytest.raises(BundleError, match="not valid JSON"):
        read_manifest(b)
    with pytest.raises(BundleError, match="no manifest.json"):
        read_manifest(tmp_path)
    with pytest.raises(BundleError, match="not found"):
        read_manifest(tmp_path / "nope")


def test_manifest_paths_cannot_escape_the_bundle(tmp_path):
    b = fake_bundle(tmp_path / "b")
    (tmp_path / "outside").write_text("x")
    m = json.loads((b / "manifest.json").read_text())
    m["files"]["../outside"] = {"sha256": "0" * 64, "size": 1}
    (b / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="outside"):
        Bundle.open(b)


def test_inspect_prints_manifest_and_verifies(tmp_path):
    b = fake_bundle(tmp_path / "b")
    res = CliRunner().invoke(export_main, ["inspect", str(b)])
    assert res.exit_code == 0, res.output
    assert "target/model.onnx.data" in res.output and "ok" in res.output and "all files match" in res.output
    js = CliRunner().invoke(export_main, ["inspect", str(b), "--json"])
    assert js.exit_code == 0
    parsed = json.loads(js.stdout)
    assert parsed["limits"]["block_size"] == 4 and set(parsed["verification"].values()) == {"ok"}
    # an extra file is an error too (the bundle is exactly what its manifest lists), as is a changed one
    (b / "stray.txt").write_text("hi")
    res = CliRunner().invoke(export_main, ["inspect", str(b)])
    assert res.exit_code == 1 and "not in the manifest: stray.txt" in res.output
    (b / "stray.txt").unlink()
    f = b / "tokenizer" / "tokenizer.json"
    f.write_text("{ }")  # different content, different size
    res = CliRunner().invoke(export_main, ["inspect", str(b)])
    assert res.exit_code == 1 and "tokenizer/tokenizer.json (size)" in res.output
    f.write_text("[]")  # same size, different content
    assert CliRunner().invoke(export_main, ["inspect", str(b), "--quick"]).exit_code == 0
    res = CliRunner().invoke(export_main, ["inspect", str(b)])
    assert res.exit_code == 1 and "tokenizer/tokenizer.json (sha256)" in res.output


def test_inspect_of_a_non_bundle_is_a_one_line_error(tmp_path):
    res = CliRunner().invoke(export_main, ["inspect", str(tmp_path)])
    assert res.exit_code == 2 and res.output.startswith("error:") and "no manifest.json" in res.output


# -- the ONNX Runtime backend refuses what the format refuses -------------------------------------------------
def test_ort_backend_refuses_tampered_or_unknown_bundles(tmp_path):
    from export_fixtures import copy_bundle

    from retrace.runtime import Runtime
    from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = copy_bundle(tmp_path / "b")
    data = b / "drafter" / "model.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one bit of one weight
    data.write_bytes(bytes(raw))
    with pytest.raises(RetraceError, match="does not match its manifest.*drafter/model.onnx.data"):
        OnnxRuntimeBackend.from_bundle(b)
    with pytest.raises(RetraceError, match="does not match its manifest"):
        Runtime.from_bundle(b)
    be = OnnxRuntimeBackend.from_bundle(b, verify=False)  # opt-out: loads (sizes still checked)
    assert be.drafter_config is not None
    m = json.loads((b / "manifest.json").read_text())
    (b / "manifest.json").write_text(json.dumps({**m, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(RetraceError, match="format version"):
        OnnxRuntimeBackend.from_bundle(b, verify=False)
