"""retrace.digest, the one file-hashing module: what it computes, and that the keys built on it are the
values the seven copies it replaced computed (bench build caches, training and inflate keys, the bundle
manifest's piece digests), so no cache or recorded key changes meaning. The pinned hex strings below were
computed on these exact files by the code before it moved here."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from retrace.digest import dir_digest, sha256_file, sha256_named_files, sha256_pieces, sha256_range
from retrace.train.datasets_io import data_sha

WEIGHTS = bytes(range(256)) * 40  # 10240 bytes: two whole 4096-byte pieces and a short one


@pytest.fixture
def tree(tmp_path) -> Path:
    a, b, data = tmp_path / "a", tmp_path / "b", tmp_path / "data"
    (a / "sub").mkdir(parents=True)
    b.mkdir()
    (data / "d").mkdir(parents=True)
    (a / "config.json").write_text('{"a": 1}\n')
    (a / "model.safetensors").write_bytes(WEIGHTS)
    (a / "notes.txt").write_text("not hashed\n")  # neither JSON nor weights: left out of dir_digest
    (a / "sub" / "x.json").write_text("{}")  # not directly in the directory: left out
    (b / "x.json").write_text('{"b": 2}')
    (data / "train.jsonl").write_text('{"prompt": "hi"}\n')
    (data / "d" / "part-0.parquet").write_bytes(b"PAR1" * 100)
    return tmp_path


def test_one_file_and_its_pieces_are_sha256_of_their_bytes(tree):
    w = tree / "a" / "model.safetensors"
    assert sha256_file(w) == hashlib.sha256(WEIGHTS).hexdigest()
    whole, pieces = sha256_pieces(w, 4096)
    assert whole == sha256_file(w)
    assert pieces == [hashlib.sha256(WEIGHTS[i:i + 4096]).hexdigest() for i in range(0, len(WEIGHTS), 4096)]
    assert sha256_range(w, 8192, 2048) == pieces[2]
    assert sha256_range(w, 100, 0) == hashlib.sha256(b"").hexdigest()
    assert sha256_pieces(w, len(WEIGHTS))[1] == [whole]


def test_named_files_hash_prefix_then_name_and_bytes_in_order(tree):
    a = tree / "a"
    files = [("config.json", a / "config.json"), ("model.safetensors", a / "model.safetensors")]
    expect = hashlib.sha256(b"v1" + b"config.json" + b'{"a": 1}\n' + b"model.safetensors" + WEIGHTS).hexdigest()
    assert sha256_named_files(files, prefix="v1") == expect
    assert sha256_named_files(reversed(files), prefix="v1") != expect  # the order is part of the key


def test_keys_are_the_values_the_replaced_copies_computed(tree):
    a, b, data = tree / "a", tree / "b", tree / "data"
    assert dir_digest(a, b, extra="v1") == "2ac5c1316b5368e4"  # bench/builds.dir_digest
    assert dir_digest(a) == "a85757647d32bb8f"
    assert sha256_file(a / "model.safetensors")[:16] == "e96760a87768717b"  # train/dflash.file_sha
    assert data_sha(data) == "1d9ccfbf3519c91d"  # a data directory: relative names and bytes
    assert data_sha(data / "train.jsonl") == "bc7743aab8be0fd4"
    named = [(p.name, p) for p in (a / "config.json", a / "model.safetensors", b / "x.json")]
    assert sha256_named_files(named) == (  # train/inflate_zoo's source key
        "bf72fc84d04f3fc813cd10e51beafcf383e24cfce8cb46b48536becc41d24556")


# modules that hash in-memory strings or JSON (never a file's bytes): a new module hashing files uses
# retrace.digest instead of an eighth copy
HASHES_STRINGS = {"retrace/engines/bundle.py", "retrace/train/common.py", "retrace/train/corpus.py",
                  "retrace/gpucheck/site_corpus.py", "retrace/export/triton/env.py", "retrace/bench/envs.py",
                  "retrace/export/export_cache.py"}  # tensors in memory


def test_only_digest_hashes_files():
    root = Path(__file__).resolve().parent.parent
    users = {p.relative_to(root).as_posix() for p in (root / "retrace").rglob("*.py") if "hashlib" in p.read_text()}
    assert users - HASHES_STRINGS == {"retrace/digest.py"}, (
        "a new module uses hashlib: hash files with retrace.digest (or, for strings, add it to HASHES_STRINGS)")
