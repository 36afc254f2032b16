"""The export cache (retrace/export/export_cache.py): a rebuild of an exported pair reuses its graphs without
tracing, gives the same bundle files, and still runs the parity check that catches a wrong cached graph; the key
changes with anything that changes the graph (a weight, a tap layer, the settings, the example inputs)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_fixtures import MAX_BATCH, MAX_SEQ, pair_and_bundle
from onnx import numpy_helper

from retrace.engines import read_manifest
from retrace.export import build as build_mod
from retrace.export import export_cache, onnx_export
from retrace.export.onnx_parity import ParityError
from retrace.models.drafter import load_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def _run_cache() -> Path:
    """The run's cache (tests/conftest.py points $RETRACE_EXPORT_CACHE at it): the session bundle's exports."""
    return Path(os.environ[export_cache.ENV])


def _no_trace(monkeypatch):
    def traced(*args, **kwargs):
        raise AssertionError("the export traced the model: the cache missed")

    monkeypatch.setattr(onnx_export, "_trace", traced)


def _build(out: Path, cache: Path):
    built = pair_and_bundle()
    opts = build_mod.BuildOptions(built.target, built.drafter, out, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ,
                                  force=True, export_cache=cache)
    return build_mod.build_bundle(opts)


def _graph_hashes(bundle: Path) -> dict:
    files = read_manifest(bundle)["files"]
    return {k: v for k, v in files.items() if k.startswith(("target/", "drafter/"))}


def test_a_rebuild_of_an_exported_pair_traces_nothing_and_writes_the_same_graphs(tmp_path, monkeypatch):
    session = pair_and_bundle()  # built through the run's cache
    _no_trace(monkeypatch)
    result = _build(tmp_path / "again", _run_cache())
    assert _graph_hashes(result.out) == _graph_hashes(session.bundle)
    assert result.manifest["parity"]["target"]["max_scaled_logits_diff"] <= result.manifest["parity"]["tolerance"]


def test_a_wrong_cached_graph_fails_the_parity_check(tmp_path, monkeypatch):
    pair_and_bundle()
    cache = tmp_path / "cache"
    shutil.copytree(_run_cache(), cache)
    for graph in cache.glob("*/model.onnx"):  # every cached graph's weights scaled by 1.01
        model = onnx.load(str(graph))
        for init in model.graph.initializer:
            w = numpy_helper.to_array(init)
            if w.dtype == np.float32 and w.size > 1:
                init.CopyFrom(numpy_helper.from_array(w * np.float32(1.01), init.name))
        (graph.parent / onnx_export.DATA_FILE).unlink()
        onnx.save(model, str(graph), save_as_external_data=True, location=onnx_export.DATA_FILE)
    _no_trace(monkeypatch)
    with pytest.raises(ParityError, match="target graph parity"):
        _build(tmp_path / "b", cache)
    assert not (tmp_path / "b").exists()


@pytest.fixture(scope="module")
def pair():
    built = pair_and_bundle()
    return built, load_pair(built.target, built.drafter, draft_vocab=False)


def _key(target, tree_mask=False, attention="native", seed=0):
    e = onnx_export.EXAMPLE
    args = onnx_export.target_inputs(target, e["N"], e["T"], e["P"], e["K"], seed=seed)
    return export_cache.graph_key(onnx_export.TargetGraph(target, tree_mask), args, {"attention": attention})


def test_the_key_follows_weights_attributes_settings_and_inputs(pair):
    built, (target, _) = pair
    key = _key(target)
    assert _key(load_pair(built.target, built.drafter, draft_vocab=False)[0]) == key  # a fresh load: the same
    assert _key(target, tree_mask=True) != key
    assert _key(target, attention="decomposed") != key
    assert _key(target, seed=1) != key
    taps = target.tap_layers
    target.tap_layers = tuple(t + 1 for t in taps)
    try:
        assert _key(target) != key
    finally:
        target.tap_layers = taps
    w = target.lm_head.weight
    with torch.no_grad():
        w[0, 0] += 1e-6
        try:
            assert _key(target) != key
        finally:
            w[0, 0] -= 1e-6


def test_store_keeps_the_first_entry_and_restore_copies(tmp_path):
    src = tmp_path / "export"
    src.mkdir()
    (src / "model.onnx").write_bytes(b"graph")
    (src / "model.onnx.data").write_bytes(b"weights")
    cache = tmp_path / "cache"
    assert not export_cache.restore(cache, "k", tmp_path / "out")
    export_cache.store(cache, "k", src, [src / "model.onnx", src / "model.onnx.data"])
    (src / "model.onnx").write_bytes(b"other")
    export_cache.store(cache, "k", src, [src / "model.onnx"])  # an entry already there stays
    assert export_cache.restore(cache, "k", tmp_path / "out")
    assert (tmp_path / "out" / "model.onnx").read_bytes() == b"graph"
    assert (tmp_path / "out" / "model.onnx.data").read_bytes() == b"weights"
    (tmp_path / "out" / "model.onnx.data").write_bytes(b"rewritten")  # a copy, not the entry itself
    assert (cache / "k" / "model.onnx.data").read_bytes() == b"weights"
    assert [p.name for p in cache.iterdir()] == ["k"]  # no temporary directory left
