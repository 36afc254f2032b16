"""retrace.export.tensorrt without TensorRT: optimisation profiles for given limits, their resolution
against real ONNX graphs, the GatedSuffixFusion rewrite per plugin mode, the one clear error when
tensorrt is missing, and the build sequence driven through a recording stand-in of the TensorRT API."""

from __future__ import annotations

import json
import sys
import types

import onnx
import pytest
from onnx import TensorProto, helper

from retrace.errors import MissingDependencyError, RetraceError
from retrace.export import tensorrt as te
from retrace.plugins import onnx_function as of
from retrace.plugins.errors import RetraceMissingDependency

LIMITS = {"max_batch": 4, "max_seq_len": 256, "block_size": 16, "max_prompt_len": 128}


def test_target_profiles_for_given_limits():
    p = te.optimisation_profiles(4, 256, 16, 128)["target"]
    assert list(p) == ["prefill", "verify", "decode"]
    pre, ver, dec = p["prefill"], p["verify"], p["decode"]
    assert pre["input_ids"] == ((1, 1), (2, 64), (4, 128))  # T up to the max prompt length
    assert pre["position_ids"] == pre["input_ids"]
    assert pre["past_len"] == ((1,), (2,), (4,))
    assert pre["past_key_{i}"] == ((1, -1, 0, -1), (2, -1, 0, -1), (4, -1, 0, -1))  # P = 0
    assert pre["logits_index"] == ((1, 1), (2, 1), (4, 1))
    assert ver["input_ids"] == ((1, 1), (2, 16), (4, 16))  # T = block_size
    # P up to max_seq_len, tuned for it: the backend binds the whole cache of a slot range (no prefix copy)
    assert ver["past_value_{i}"] == ((1, -1, 0, -1), (2, -1, 256, -1), (4, -1, 256, -1))
    assert ver["logits_index"] == ((1, 1), (2, 16), (4, 16))
    assert dec["input_ids"] == ((1, 1), (2, 1), (4, 1))  # T = 1
    assert dec["past_key_{i}"] == ver["past_key_{i}"]
    assert set(pre) == set(te.TARGET_INPUTS)


def test_drafter_profiles_for_given_limits():
    p = te.optimisation_profiles(4, 256, 16, 128)["drafter"]
    assert set(p["verify"]) == set(te.DRAFTER_INPUTS)
    assert p["prefill"]["ctx_taps"] == ((1, 1, -1), (2, 64, -1), (4, 128, -1))
    # tuned for a block of context, up to max_seq_len: the taps of every round since the last draft call
    assert p["verify"]["ctx_positions"] == ((1, 1), (2, 16), (4, 256))
    assert p["decode"]["ctx_positions"] == ((1, 1), (2, 1), (4, 1))
    for prof in te.PROFILES:  # the block: 2..B slots (the adaptive draft width), tuned for B
        assert p[prof]["block_ids"] == ((1, 2), (2, 16), (4, 16))  # narrower draft widths: blocks of 2..B
        assert p[prof]["memory"] == ((1, 2, -1), (2, 16, -1), (4, 16, -1))
        assert p[prof]["features"] == ((1, 2, -1), (2, 16, -1), (4, 16, -1))
        assert p[prof]["valid"] == p[prof]["corr_index"] == p[prof]["block_positions"] == p[prof]["block_ids"]
    assert p["prefill"]["past_key_{i}"][2] == (4, -1, 0, -1)
    assert p["decode"]["past_key_{i}"][2] == (4, -1, 256, -1)


def test_profiles_with_model_dims_and_defaults():
    dims = {"target": {"layers": 2, "Hkv": 2, "hd": 16}, "drafter": {"layers": 1, "Hkv": 2, "hd": 16, "kd": 128,
                                                                       "d": 64, "F": 3}}
    p = te.optimisation_profiles(1, 64, 8, dims=dims)
    assert [n for n in p["target"]["decode"] if n.startswith(("past_key", "past_value"))] == [
        "past_key_0", "past_key_1", "past_value_0", "past_value_1"]
    assert p["target"]["decode"]["past_key_1"] == ((1, 2, 0, 16), (1, 2, 64, 16), (1, 2, 64, 16))
    assert p["target"]["prefill"]["input_ids"][2] == (1, 64)  # max_prompt_len defaults to max_seq_len
    assert p["drafter"]["verify"]["features"] == ((1, 2, 3), (1, 8, 3), (1, 8, 3))
    for bad in [(0, 64, 8, 8), (1, 64, 1, 8), (1, 4, 8, 4), (1, 64, 8, 65)]:
        with pytest.raises(RetraceError):
            te.optimisation_profiles(*bad)


def _vi(name, elem, dims):
    return helper.make_tensor_value_info(name, elem, dims)


def _target_model(layers=2, hkv=2, hd=8):
    ins = [_vi("input_ids", TensorProto.INT64, ["N", "T"]), _vi("position_ids", TensorProto.INT64, ["N", "T"]),
           _vi("past_len", TensorProto.INT64, ["N"]), _vi("logits_index", TensorProto.INT64, ["N", "K"])]
    for i in range(layers):
        ins += [_vi(f"past_key_{i}", TensorProto.FLOAT, ["N", hkv, "P", hd]),
                _vi(f"past_value_{i}", TensorProto.FLOAT, ["N", hkv, "P", hd])]
    node = helper.make_node("Identity", ["input_ids"], ["logits"])
    graph = helper.make_graph([node], "target", ins, [_vi("logits", TensorProto.INT64, ["N", "T"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])


def _drafter_model(d=24, f=3, kd=48, hkv=2, hd=8):
    ins = [_vi("ctx_taps", TensorProto.FLOAT, ["N", "C", kd]), _vi("ctx_positions", TensorProto.INT64, ["N", "C"]),
           _vi("block_ids", TensorProto.INT64, ["N", "B"]), _vi("block_positions", TensorProto.INT64, ["N", "B"]),
           _vi("past_len", TensorProto.INT64, ["N"]), _vi("past_key_0", TensorProto.FLOAT, ["N", hkv, "P", hd]),
           _vi("past_value_0", TensorProto.FLOAT, ["N", hkv, "P", hd]), _vi("memory", TensorProto.FLOAT, ["N", "B", d]),
           _vi("features", TensorProto.FLOAT, ["N", "B", f]), _vi("valid", TensorProto.FLOAT, ["N", "B"]),
           _vi("corr_index", TensorProto.INT64, ["N", "B"])]
    inits = [helper.make_tensor(n, TensorProto.FLOAT, s, [0.0] * (s[0] * (s[1] if len(s) > 1 else 1)))
             for n, s in (("w_refine", [d, 2 * d]), ("w_gate", [d, 2 * d + f]), ("b_gate", [d]),
                          ("norm_weight", [d]), ("w_value", [d, d]))]
    nodes = [helper.make_node("Identity", ["memory"], ["x"]),
             of.make_node(["x", "memory", "memory", "features", "valid", "w_refine", "w_gate", "b_gate",
                           "norm_weight", "w_value"], ["hidden"], epsilon=1e-5, name="gsf0")]
    graph = helper.make_graph(nodes, "drafter", ins, [_vi("hidden", TensorProto.FLOAT, ["N", "B", d])], inits)
    return of.attach_function(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]))


def test_resolve_profile_fills_model_dims_from_the_graph():
    entries = te.optimisation_profiles(4, 256, 16, 128)["target"]["verify"]
    shapes = te.onnx_input_shapes(_target_model())
    assert shapes["past_key_1"] == [None, 2, None, 8]
    r = te.resolve_profile(entries, shapes)
    assert set(r) == set(shapes)
    assert r["past_key_1"] == ((1, 2, 0, 8), (2, 2, 256, 8), (4, 2, 256, 8))
    assert r["input_ids"] == ((1, 1), (2, 16), (4, 16))
    with pytest.raises(RetraceError, match="'extra'"):
        te.resolve_profile(entries, {**shapes, "extra": [None]})
    with pytest.raises(RetraceError, match="fixed to 7"):
        te.resolve_profile(entries, {**shapes, "input_ids": [None, 7]})  # T exported static
    with pytest.raises(RetraceError, match="no range"):
        te.resolve_profile(entries, {**shapes, "past_key_0": [None, None, None, 8]})


def test_prepare_aot_splits_fusion_into_plugin_pair():
    model = te.prepare_for_tensorrt(_drafter_model(), "aot")
    assert len(model.functions) == 0 and not of.fusion_nodes(model)
    refine, fuse = [n for n in model.graph.node if n.domain == "retrace"]
    assert (refine.op_type, fuse.op_type) == ("GatedSuffixRefine", "GatedSuffixFuse")
    assert list(refine.input) == ["memory", "memory", "w_refine"] and list(refine.output) == ["gsf0/refined"]
    assert list(fuse.input) == ["x", "gsf0/refined", "features", "valid", "w_gate", "b_gate", "norm_weight",
                                "w_value"]
    assert list(fuse.output) == ["hidden"]
    fa = {a.name: helper.get_attribute_value(a) for a in fuse.attribute}
    ra = {a.name: helper.get_attribute_value(a) for a in refine.attribute}
    assert fa == {"epsilon": pytest.approx(1e-5), "plugin_namespace": b"retrace", "plugin_version": b"1", "aot": 1}
    assert ra == {"plugin_namespace": b"retrace", "plugin_version": b"1", "aot": 1}


def test_prepare_jit_and_none():
    jit = te.prepare_for_tensorrt(_drafter_model(), "jit")
    (node,) = of.fusion_nodes(jit)
    assert len(jit.functions) == 0 and "aot" not in [a.name for a in node.attribute]
    none = te.prepare_for_tensorrt(_drafter_model(), "none")
    assert len(none.functions) == 1 and len(of.fusion_nodes(none)) == 1  # TensorRT inlines the body
    with pytest.raises(ValueError):
        te.prepare_for_tensorrt(_drafter_model(), "fast")


def _bundle(tmp_path, drafter=True, limits=LIMITS):
    (tmp_path / "target").mkdir(parents=True)
    onnx.save(_target_model(), str(tmp_path / "target" / "model.onnx"))
    if drafter:
        (tmp_path / "drafter").mkdir()
        onnx.save(_drafter_model(), str(tmp_path / "drafter" / "model.onnx"))
    (tmp_path / "manifest.json").write_text(json.dumps({"limits": limits}))
    return tmp_path


def test_plan_graphs_reads_bundle(tmp_path):
    plan = te.plan_graphs(_bundle(tmp_path))
    assert plan["limits"] == LIMITS
    assert set(plan["graphs"]) == {"target", "drafter"}
    d = plan["graphs"]["drafter"]
    assert d["has_plugin"] and d["profiles"]["decode"]["memory"] == ((1, 2, 24), (2, 16, 24), (4, 16, 24))
    assert d["profiles"]["prefill"]["ctx_taps"] == ((1, 1, 48), (2, 64, 48), (4, 128, 48))
    # explicit arguments override the manifest; file names are parameters
    (tmp_path / "target" / "model.onnx").rename(tmp_path / "target" / "t.onnx")
    plan = te.plan_graphs(tmp_path, max_batch=2, files={"target": "target/t.onnx"})
    assert plan["limits"]["max_batch"] == 2 and not plan["graphs"]["target"]["has_plugin"]


def test_plan_graphs_errors(tmp_path):
    with pytest.raises(RetraceError, match="max_batch"):
        te.plan_graphs(_bundle(tmp_path, limits={"max_seq_len": 64}))
    with pytest.raises(RetraceError, match="target ONNX graph not found"):
        te.plan_graphs(tmp_path, 1, 64, 8, files={"target": "nope.onnx"})
    only_target = te.plan_graphs(_bundle(tmp_path / "b", drafter=False))
    assert set(only_target["graphs"]) == {"target"}


def test_build_without_tensorrt_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(RetraceMissingDependency) as info:
        te.build_tensorrt(_bundle(tmp_path), tmp_path / "out")
    assert isinstance(info.value, MissingDependencyError)  # the CLIs print these as one line
    assert "pip install tensorrt" in str(info.value) and "NVIDIA GPU" in str(info.value)
    assert not (tmp_path / "out").exists()




def _fake_trt(log):
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.13.0"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            pass

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (tuple(lo), tuple(opt), tuple(hi))

    class Config:
        def __init__(self):
            self.profiles, self.flags = [], []

        def set_flag(self, f):
            self.flags.append(f)

        def add_optimization_profile(self, p):
            self.profiles.append(p)

        def set_memory_pool_limit(self, pool, size):
            log.append(("workspace", size))

    class Builder:
        def __init__(self, logger):
            pass

        def create_network(self, flags):
            return types.SimpleNamespace(flags=flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            log.append(("build", network.flags, config))
            return b"PLAN:%d" % len(log)

    class OnnxParser:
        def __init__(self, network, logger):
            self.num_errors = 0

        def parse(self, blob, path):
            log.append(("parse", onnx.load_from_string(blob), path))
            return True

    trt.Logger, trt.Builder, trt.OnnxParser = Logger, Builder, OnnxParser
    trt.NetworkDefinitionCreationFlag = types.SimpleNamespace(STRONGLY_TYPED=0)
    trt.MemoryPoolType = types.SimpleNamespace(WORKSPACE="ws")
    trt.BuilderFlag = types.SimpleNamespace(FP16="fp16", BF16="bf16")
    return trt


def test_build_sequence_with_recording_tensorrt(tmp_path, monkeypatch):
    log = []
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(log))
    from retrace.plugins import tensorrt_plugin

    monkeypatch.setattr(tensorrt_plugin, "register", lambda: log.append(("register",)))
    bundle = _bundle(tmp_path)
    written = te.build_tensorrt(bundle, tmp_path / "out", dtype="fp16", workspace_gib=1)
    assert set(written) == {"target", "drafter", "manifest"}
    assert written["target"].read_bytes().startswith(b"PLAN") and written["drafter"].name == "drafter.plan"
    assert not list((tmp_path / "out").glob(".*tmp*"))  # atomic writes leave no temporaries
    assert ("register",) in log and ("workspace", 1 << 30) in log
    parses = [e for e in log if e[0] == "parse"]
    assert [p[2] for p in parses] == [str(bundle / "target/model.onnx"), str(bundle / "drafter/model.onnx")]
    drafter_ops = [n.op_type for n in parses[1][1].graph.node]
    assert drafter_ops == ["Identity", "GatedSuffixRefine", "GatedSuffixFuse"]  # AOT split before parsing
    builds = [e for e in log if e[0] == "build"]
    for _, flags, config in builds:
        assert flags == 0 and config.flags == ["fp16"]  # weakly typed + FP16 for dtype="fp16"
        assert len(config.profiles) == 3
    target_cfg = builds[0][2]
    assert set(target_cfg.profiles[0].shapes) == set(te.onnx_input_shapes(_target_model()))
    assert target_cfg.profiles[2].shapes["input_ids"] == ((1, 1), (2, 1), (4, 1))
    manifest = json.loads(written["manifest"].read_text())
    assert manifest["limits"] == LIMITS and manifest["profiles"] == ["prefill", "verify", "decode"]
    assert manifest["graphs"]["drafter"]["shapes"]["verify"]["memory"] == [[1, 2, 24], [2, 16, 24], [4, 16, 24]]
    assert manifest["graphs"]["target"]["output_table"]["new_key"] == "new_key_{i}"
    # dtype "auto" builds strongly typed networks without precision flags
    log.clear()
    te.build_tensorrt(bundle, tmp_path / "out2", plugin="none")
    builds = [e for e in log if e[0] == "build"]
    assert all(flags == 1 and config.flags == [] for _, flags, config in builds)
    assert ("register",) not in log


def test_parser_version_chooses_the_attention_form(tmp_path, monkeypatch):
    """opset-23 Attention parses from TensorRT 10.14, RMSNormalization / RotaryEmbedding from 10.15
    (onnx-tensorrt's changelog): an older TensorRT is refused, before any export, naming the flag."""
    from retrace.export.build import BuildOptions, _tensorrt_precheck

    attention = helper.make_node("Attention", ["q", "k", "v"], ["y"])
    model = helper.make_model(helper.make_graph([attention, helper.make_node("Relu", ["y"], ["z"])], "g", [], []))
    assert te.parser_ops(model) == {"Attention": (10, 14)}
    te.check_parser((10, 14), te.parser_ops(model))
    with pytest.raises(RetraceError, match=r"TensorRT 10.13's ONNX parser cannot import the opset-23 Attention "
                                           r"\(TensorRT >= 10.14\).*--attention decomposed"):
        te.check_parser((10, 13), te.parser_ops(model))
    log = []
    for version, ok in (("10.13.0", False), ("10.14.1", False), ("10.15.0", True)):
        trt = _fake_trt(log)
        trt.__version__ = version
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        trt.Builder = object
        opts = BuildOptions(tmp_path, None, tmp_path / "b", backend="tensorrt")  # attention "native"
        if ok:
            _tensorrt_precheck(opts)
        else:
            with pytest.raises(RetraceError, match="RMSNormalization.*--attention decomposed"):
                _tensorrt_precheck(opts)
        _tensorrt_precheck(BuildOptions(tmp_path, None, tmp_path / "b", backend="tensorrt",
                                        attention="decomposed"))
    # build_tensorrt checks the graphs it parses, too (the decomposed test bundle has none of these ops)
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(log))
    bundle = _bundle(tmp_path / "x")
    native = onnx.load(str(bundle / "target/model.onnx"))
    native.graph.node.append(helper.make_node("RMSNormalization", ["logits"], ["unused"]))
    onnx.save(native, str(bundle / "target/model.onnx"))
    with pytest.raises(RetraceError, match="RMSNormalization"):
        te.build_tensorrt(bundle, tmp_path / "out", plugin="none")
    assert not (tmp_path / "out").exists()
