"""The bench's precision axis (retrace.bench.precision): `--weights` parsing, the systems' names at each
precision, the quantized bundle the bench builds into its cache, and a missing llama.cpp that becomes a
row saying how to install it instead of a failure."""

from __future__ import annotations

import json
import sys

import pytest

from retrace.bench import precision
from retrace.bench.config import BenchConfig
from retrace.bench.lineup import Built, _retrace_names
from retrace.errors import RetraceError


def test_weights_parse_suffixes_and_gguf_types():
    assert precision.parse("fp32, int4,int4:256,int4") == ("fp32", "int4", "int4:256")
    assert [precision.suffix(w) for w in ("fp32", "int8", "int4:256")] == ["", "-int8", "-int4b256"]
    assert [precision.llamacpp_type(w) for w in ("fp32", "int8", "int4:32")] == [None, "Q8_0", "Q4_K_M"]
    # w8a8: ours only (retrace.export.w8a8), compared with the int8 peers; no block
    assert precision.parse("w8a8,int8") == ("w8a8", "int8") and precision.suffix("w8a8") == "-w8a8"
    assert precision.llamacpp_type("w8a8") is None
    assert [precision.width_of(n) for n in ("retrace-onnxruntime-ar-w8a8", "ortgenai-ar-int8", "llamacpp-ar-q8_0",
                                            "ortgenai-ar-int4b256", "ortgenai-ar")] == ["int8"] * 3 + ["int4", "fp32"]
    assert precision.of_name("retrace-onnxruntime-retrace-lookup-first-w8a8") == "-w8a8"
    for bad in ("int3", "fp32:64", "int4:x", "", "w8a8:64"):
        with pytest.raises(RetraceError, match="--weights"):
            precision.parse(bad)


def test_quantized_systems_are_named_by_precision():
    cfg = BenchConfig(target="t", drafter="d", prompts=[], systems=("*-int4",), prompt_lookup=True)
    names = [n for n, _, _ in _retrace_names("onnxruntime", cfg, "-int4")]
    assert names == ["retrace-onnxruntime-ar-int4", "retrace-onnxruntime-dflash-int4",
                     "retrace-onnxruntime-retrace-int4", "retrace-onnxruntime-dflash-fixed-int4",
                     "retrace-onnxruntime-retrace-fixed-int4", "retrace-onnxruntime-dflash-lookup-int4",
                     "retrace-onnxruntime-retrace-lookup-int4",
                     "retrace-onnxruntime-dflash-lookup-first-int4",
                     "retrace-onnxruntime-retrace-lookup-first-int4"]
    assert _retrace_names("onnxruntime", cfg) == []  # the fp32 names do not match *-int4


def test_missing_llama_cpp_is_a_row_with_the_install_command(monkeypatch, tmp_path):
    from retrace.bench.llamacpp_peers import add_llamacpp_systems

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    built = Built()
    cfg = BenchConfig(target=str(tmp_path), drafter=str(tmp_path), prompts=[], weights=("fp32", "int4", "int8"))
    add_llamacpp_systems(built, cfg, tmp_path, 2, [], lambda msg: None)
    assert not built.systems
    assert [s["name"] for s in built.skipped] == ["llamacpp-ar-q4_k_m", "llamacpp-ngram-q4_k_m",
                                                  "llamacpp-ar-q8_0", "llamacpp-ngram-q8_0"]
    assert all("pip install llama-cpp-python" in s["reason"] for s in built.skipped)


def test_the_bench_builds_a_quantized_bundle_into_its_cache(monkeypatch, tmp_path):
    """build_ort_bundle at int4:64 runs `retrace-export build --weights int4 --weight-block-size 64` into a
    cache entry of its own (the fp32 entry keeps its key), and --drafter-weights int8 one of its own too."""
    from retrace.bench import builds

    seen = []
    monkeypatch.setattr(builds, "_run", lambda cmd, what, log: seen.append(cmd) or 0.0)
    monkeypatch.setattr(builds, "exporter_available", lambda: None)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text(json.dumps({}))
    q, _ = builds.build_ort_bundle(tmp_path / "t", tmp_path / "t", tmp_path / "cache", 4, 512, "int4:64")
    f, _ = builds.build_ort_bundle(tmp_path / "t", tmp_path / "t", tmp_path / "cache", 4, 512)
    d, _ = builds.build_ort_bundle(tmp_path / "t", tmp_path / "t", tmp_path / "cache", 4, 512, "fp32", "int8")
    assert len({q, f, d}) == 3
    assert seen[0][-4:] == ["--weights", "int4", "--weight-block-size", "64"] and "--weights" not in seen[1]
    assert seen[2][-2:] == ["--drafter-weights", "int8"] and "--weights" not in seen[2]
    for cmd in seen:  # every bundle of the pair reuses its one export
        assert cmd[cmd.index("--export-cache") + 1] == str(tmp_path / "cache" / "exports")
