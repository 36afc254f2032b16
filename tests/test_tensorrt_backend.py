"""retrace.runtime.tensorrt_backend without TensorRT or a GPU: the one clear error, the profile choice,
and the binding / cache plumbing driven through a stand-in engine that computes on CPU memory (it
reads and writes the tensors at the addresses the backend binds, like TensorRT does on the GPU)."""

from __future__ import annotations

import ctypes
import json
import math
import sys
import types

import pytest
import torch

from retrace.errors import MissingDependencyError, RetraceError
from retrace.export import tensorrt as te
from retrace.plugins.errors import RetraceMissingDependency
from retrace.runtime import tensorrt_backend as tb


def test_missing_tensorrt_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(RetraceMissingDependency) as info:
        tb.TensorRTBackend.from_bundle(tmp_path)
    assert isinstance(info.value, MissingDependencyError)
    msg = str(info.value)
    assert "pip install tensorrt" in msg and "a Linux machine with an NVIDIA GPU" in msg
    assert "\n" not in msg and info.value.__cause__ is None
    from retrace.runtime.api import _load_backend_class

    assert _load_backend_class("tensorrt") is tb.TensorRTBackend  # imports without tensorrt


def _resolved(limits=(4, 256, 16, 128), layers=2, hkv=2, hd=3):
    shapes = {"input_ids": [None, None], "position_ids": [None, None], "past_len": [None],
              "logits_index": [None, None]}
    for i in range(layers):
        shapes[f"past_key_{i}"] = shapes[f"past_value_{i}"] = [None, hkv, None, hd]
    prof = te.optimisation_profiles(*limits)["target"]
    return shapes, {p: te.resolve_profile(prof[p], shapes) for p in te.PROFILES}


def test_pick_profile():
    _, resolved = _resolved()
    table = [resolved[p] for p in te.PROFILES]

    def call(n, t, p, k=1):
        return {"input_ids": (n, t), "position_ids": (n, t), "past_len": (n,), "logits_index": (n, k),
                "past_key_0": (n, 2, p, 3)}

    assert tb.pick_profile(table, call(1, 40, 0)) == 0  # prefill
    assert tb.pick_profile(table, call(2, 5, 0)) == 0  # short prompt: prefill's opt is nearer
    assert tb.pick_profile(table, call(2, 16, 77, k=16)) == 1  # verify
    assert tb.pick_profile(table, call(3, 1, 200)) == 2  # decode (verify fits too, decode is tuned for it)
    with pytest.raises(RetraceError, match="no TensorRT optimisation profile"):
        tb.pick_profile(table, call(5, 1, 10))  # batch above max_batch
    with pytest.raises(RetraceError):
        tb.pick_profile(table, call(1, 40, 10))  # a long chunk after a prefix: no profile


# ---- a stand-in TensorRT that computes on the bound CPU memory ----

V, KD, D = 5, 4, 6


def _at(ptr: int, shape, dtype) -> torch.Tensor:
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=dtype).view(shape)


def _fake_trt(calls):
    trt = types.ModuleType("tensorrt")
    trt.__version__ = "10.13.0"
    trt.Builder = object
    for name in ("float32", "float16", "bfloat16", "int64", "int32", "int8", "bool"):
        setattr(trt, name, name)

    class Context:
        def __init__(self):
            self.shapes, self.ptrs = {}, {}

        def set_optimization_profile_async(self, index, stream):
            calls.append(("profile", index))

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)

        def set_tensor_address(self, name, ptr):
            self.ptrs[name] = ptr

        def get_tensor_shape(self, name):
            hkv, hd = self.shapes["past_key_0"][1], self.shapes["past_key_0"][3]
            if "block_ids" in self.shapes:  # drafter
                n, b = self.shapes["block_ids"]
                c = self.shapes["ctx_positions"][1]
                return {"hidden": (n, b, D), "logits": (n, b - 1, V)}.get(name, (n, hkv, c, hd))
            n, t = self.shapes["input_ids"]
            k = self.shapes["logits_index"][1]
            return {"logits": (n, k, V), "taps": (n, t, KD)}.get(name, (n, hkv, t, hd))

        def execute_async_v3(self, stream):
            s, p = self.shapes, self.ptrs
            past = _at(p["past_key_0"], s["past_key_0"], torch.float16).clone()
            drafter = "block_ids" in s
            pos_name = "ctx_positions" if drafter else "position_ids"
            pos = _at(p[pos_name], s[pos_name], torch.int64)
            calls.append(("run", s["block_ids" if drafter else "input_ids"], s["past_key_0"][2], past))
            logits = _at(p["logits"], self.get_tensor_shape("logits"), torch.float32)
            if drafter:
                ids = _at(p["block_ids"], s["block_ids"], torch.int64)
                memory = _at(p["memory"], s["memory"], torch.float16)
                valid = _at(p["valid"], s["valid"], torch.float16)
                hidden = _at(p["hidden"], self.get_tensor_shape("hidden"), torch.float16)
                hidden[:] = memory + valid[..., None]
                logits[:] = ids[:, 1:].float()[..., None] + torch.arange(V)
            else:
                ids = _at(p["input_ids"], s["input_ids"], torch.int64)
                lidx = _at(p["logits_index"], s["logits_index"], torch.int64)
                logits[:] = torch.gather(ids, 1, lidx).float()[..., None] + torch.arange(V)
                _at(p["taps"], self.get_tensor_shape("taps"), torch.float32)[:] = pos.float()[..., None]
            layers = sum(1 for n in p if n.startswith("new_key_"))
            for i in range(layers):
                kv = pos.to(torch.float16)[:, None, :, None] + 100 * i
                shape = self.get_tensor_shape("new_key_0")
                _at(p[f"new_key_{i}"], shape, torch.float16)[:] = kv
                _at(p[f"new_value_{i}"], shape, torch.float16)[:] = -kv
            return True

    class Engine:
        def get_tensor_dtype(self, name):
            if name in ("input_ids", "position_ids", "past_len", "logits_index", "ctx_positions", "block_ids",
                        "block_positions", "corr_index"):
                return trt.int64
            return trt.float32 if name in ("logits", "taps") else trt.float16

        def create_execution_context(self):
            return Context()

    class Runtime:
        def __init__(self, logger):
            pass

        def deserialize_cuda_engine(self, blob):
            assert blob == b"PLAN"
            return Engine()  # the target and the drafter differ only by the inputs they are given

    trt.Runtime = Runtime
    trt.Logger = type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None})
    return trt


def _drafter_resolved(limits=(4, 256, 16, 128), hkv=2, hd=3):
    shapes = {"ctx_taps": [None, None, KD], "ctx_positions": [None, None], "block_ids": [None, None],
              "block_positions": [None, None], "past_len": [None], "past_key_0": [None, hkv, None, hd],
              "past_value_0": [None, hkv, None, hd], "memory": [None, None, D], "features": [None, None, 3],
              "valid": [None, None], "corr_index": [None, None]}
    prof = te.optimisation_profiles(*limits)["drafter"]
    return shapes, {p: te.resolve_profile(prof[p], shapes) for p in te.PROFILES}


def _graph_entry(shapes, resolved, outputs, table):
    return {"plan": "x.plan", "inputs": list(shapes), "outputs": outputs, "output_table": table,
            "shapes": {p: {n: [list(x) for x in v] for n, v in resolved[p].items()} for p in te.PROFILES}}


def _engine_dir(tmp_path, drafter=False):
    (tmp_path / "x.plan").write_bytes(b"PLAN")
    outputs = ["logits", "taps"] + [f"new_{kv}_{i}" for kv in ("key", "value") for i in range(2)]
    graphs = {"target": _graph_entry(*_resolved(), outputs, te.TARGET_OUTPUTS)}
    if drafter:
        graphs["drafter"] = _graph_entry(*_drafter_resolved(), ["hidden", "logits", "new_key_0", "new_value_0"],
                                         te.DRAFTER_OUTPUTS)
    manifest = {"limits": dict(zip(("max_batch", "max_seq_len", "block_size", "max_prompt_len"), (4, 256, 16, 128),
                                   strict=True)),
                "plugin": "none", "profiles": list(te.PROFILES), "graphs": graphs}
    (tmp_path / "tensorrt.json").write_text(json.dumps(manifest))
    return tmp_path


def test_target_calls_bind_profiles_and_caches(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(calls))
    be = tb.TensorRTBackend(_engine_dir(tmp_path), target_config=None, device="cpu")
    assert (be.max_batch, be.max_seq_len, be.block_size, be.has_conditioner) == (4, 256, 16, False)
    assert be.caches["target"].k[1].shape == (4, 2, 256, 3)

    # prefill 3 tokens into slot 1
    logits, taps = be.target(torch.tensor([1]), torch.tensor([[7, 8, 9]]), torch.tensor([[0, 1, 2]]),
                             torch.tensor([[2]]))
    assert calls[0] == ("profile", 0) and calls[1][1:3] == ((1, 3), 0)
    assert torch.equal(logits, (9 + torch.arange(V, dtype=torch.float32)).view(1, 1, V))
    assert torch.equal(taps[0, :, 0], torch.tensor([0.0, 1.0, 2.0]))
    k1 = be.caches["target"].k[1]
    assert torch.equal(k1[1, :, :3, 0], torch.tensor([[100.0, 101, 102]] * 2, dtype=torch.float16))
    assert torch.equal(be.caches["target"].v[0][1, 0, :3, 0], -torch.tensor([0.0, 1, 2], dtype=torch.float16))
    assert not k1[0].any()  # other slots untouched

    # decode one token: the slot's whole cache is bound as the past (P = max_seq_len, a view: no copy)
    calls.clear()
    be.target(torch.tensor([1]), torch.tensor([[10]]), torch.tensor([[3]]), torch.tensor([[0]]))
    assert calls[0] == ("profile", 2)
    _, ids_shape, p_len, past = calls[1]
    assert ids_shape == (1, 1) and p_len == 256
    assert torch.equal(past[0, 0, :3, 0], torch.tensor([0.0, 1, 2], dtype=torch.float16))
    assert be.engines["target"].context.ptrs["past_key_0"] == be.caches["target"].k[0][1].data_ptr()

    # a batch of two slots verifying 4 tokens at different positions: P = max(past_len)
    calls.clear()
    be.target(torch.tensor([0, 1]), torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]),
              torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]))
    assert calls[0] == ("profile", 1)
    assert calls[1][1:3] == ((2, 4), 256)
    assert torch.equal(k1[0, 0, :4, 0], torch.tensor([100.0, 101, 102, 103], dtype=torch.float16))
    assert torch.equal(k1[1, 0, :8, 0], torch.tensor([100.0, 101, 102, 103, 104, 105, 106, 107],
                                                     dtype=torch.float16))
    # scattered slots: their first max(past_len) positions gathered (P = 8), not the whole caches
    calls.clear()
    be.target(torch.tensor([0, 3]), torch.tensor([[1], [2]]), torch.tensor([[4], [8]]), torch.tensor([[0], [0]]))
    _, _, p_len, past = calls[1]
    assert p_len == 8 and torch.equal(past[0, 0, :4, 0], torch.tensor([0.0, 1, 2, 3], dtype=torch.float16))
    assert k1[3, 0, 8, 0] == 108 and k1[0, 0, 4, 0] == 104


def test_draft_calls_feed_suffix_or_identity(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(calls))
    be = tb.TensorRTBackend(_engine_dir(tmp_path, drafter=True), target_config=None, device="cpu")
    assert be.has_conditioner and be.caches["drafter"].k[0].shape == (4, 2, 256, 3)
    b = 16
    block_ids = torch.arange(b).repeat(2, 1)
    block_pos = torch.arange(b).repeat(2, 1) + 5
    # first round: 5 prompt taps as context, no memory -> valid 0 everywhere (plain DFlash)
    hidden, logits = be.draft(torch.tensor([2, 3]), torch.zeros(2, 5, KD), torch.arange(5).repeat(2, 1), block_ids,
                              block_pos, None)
    assert calls[0] == ("profile", 0) and calls[1][1:3] == ((2, b), 0)
    assert hidden.shape == (2, b, D) and hidden.dtype == torch.float32 and not hidden.any()
    assert torch.equal(logits[0, 0], 1 + torch.arange(V, dtype=torch.float32))
    assert torch.equal(be.caches["drafter"].k[0][3, 1, :5, 0], torch.arange(5, dtype=torch.float16))
    # next round: memory for the slots with valid == 1 reaches the engine
    from retrace.models.drafter import SuffixInputs

    valid = torch.zeros(2, b)
    valid[:, 1:4] = 1
    suffix = SuffixInputs(memory=torch.full((2, b, D), 2.0), features=torch.zeros(2, b, 3), valid=valid,
                          corr_index=torch.zeros(2, b, dtype=torch.int64))
    calls.clear()
    hidden, _ = be.draft(torch.tensor([2, 3]), torch.zeros(2, 3, KD), torch.tensor([[5, 6, 7], [5, 6, 7]]),
                         block_ids, block_pos + 3, suffix)
    assert calls[0] == ("profile", 1) and calls[1][2] == 256  # verify-sized context, the whole past bound
    assert torch.equal(hidden[:, :, 0], 2.0 + valid)
    assert torch.equal(be.caches["drafter"].k[0][2, 0, :8, 0], torch.arange(8, dtype=torch.float16))


def test_one_stream_reused_outputs_and_host_copies(monkeypatch, tmp_path):
    """Every device op of a call (uploads, the run, the cache write, downloads) is issued inside the
    backend's stream context; outputs land in reused buffers (no allocation per call) and the loop gets
    host copies that a later call does not overwrite."""
    calls = []
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(calls))
    be = tb.TensorRTBackend(_engine_dir(tmp_path), target_config=None, device="cpu")
    inside = []

    class Recording:
        def __enter__(self):
            calls.append("enter")
            inside.append(True)

        def __exit__(self, *exc):
            calls.append("exit")
            inside.pop()

    monkeypatch.setattr(be, "_on_stream", Recording)
    cache_write = be.caches["target"].write

    def write(*args):
        calls.append(("write", bool(inside)))
        cache_write(*args)

    monkeypatch.setattr(be.caches["target"], "write", write)
    first, _ = be.target(torch.tensor([0]), torch.tensor([[7, 8]]), torch.tensor([[0, 1]]), torch.tensor([[1]]))
    ptrs = dict(be.engines["target"].context.ptrs)
    second, _ = be.target(torch.tensor([0]), torch.tensor([[9]]), torch.tensor([[2]]), torch.tensor([[0]]))
    assert [c if isinstance(c, str) else c[0] for c in calls] == ["enter", "profile", "run", "write", "exit"] * 2
    assert all(c[1] for c in calls if isinstance(c, tuple) and c[0] == "write")
    assert ptrs["logits"] == be.engines["target"].context.ptrs["logits"]  # the same output buffer
    assert ptrs["new_key_0"] == be.engines["target"].context.ptrs["new_key_0"]
    assert first[0, 0, 0] == 8 and second[0, 0, 0] == 9  # the first result survived the second call


def test_from_bundle_reads_the_configs_from_the_manifest(monkeypatch, tmp_path):
    """`retrace-export build --backend tensorrt` bundles keep only ONNX files in target/ and drafter/: the
    backend takes the configs from the manifest, as the ONNX Runtime backend does."""
    from export_fixtures import pair_and_bundle

    from retrace.engines.bundle import Bundle
    from retrace.runtime.bundle_configs import bundle_configs

    built = pair_and_bundle()
    assert not (built.bundle / "target" / "config.json").exists()
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt([]))
    be = tb.TensorRTBackend.from_bundle(built.bundle, engine_dir=_engine_dir(tmp_path, drafter=True), device="cpu",
                                        verify=False)
    target, drafter = bundle_configs(Bundle.open(built.bundle, verify_hashes=False))
    assert be.target_config == target and be.drafter_config == drafter and drafter is not None
