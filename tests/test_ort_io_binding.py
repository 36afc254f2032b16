"""retrace.runtime.ort_io_binding through ONNX Runtime's CPU provider: the binding calls the CUDA provider
makes (bind_input / bind_output by pointer, the tensor's own device, ONNX element types), here with
device "cpu". bf16 and fp16 bind and round-trip; a whole generate through the backend binds every input
and output that way, the caches whole as past and present (in place: the pointers are the caches'), and
decodes exactly the torch backend's tokens."""

from __future__ import annotations

import pytest
import torch
from export_fixtures import pair_and_bundle
from onnx import TensorProto, helper

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime import ort_io_binding as io
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

ort = pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("dtype,elem", [(torch.bfloat16, TensorProto.BFLOAT16), (torch.float16, TensorProto.FLOAT16)])
def test_half_types_bind_and_round_trip(dtype, elem):
    x = helper.make_tensor_value_info("x", elem, ["n"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n"])
    z = helper.make_tensor_value_info("z", elem, ["n"])
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT),
                               helper.make_node("Cast", ["y"], ["z"], to=elem)], "g", [x], [y, z])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    type_of = {i.name: i.type for i in (*sess.get_inputs(), *sess.get_outputs())}
    assert io.torch_dtype(type_of["x"]) == dtype and io.torch_dtype(type_of["y"]) == torch.float32
    src = torch.tensor([1.5, -2.25, 3.0e3, 0.1], dtype=dtype)
    y_out, z_out = torch.empty(4), torch.empty(4, dtype=dtype)
    io.run_bound(sess, {"x": src}, {"y": y_out, "z": z_out})
    assert torch.equal(y_out, src.float()) and torch.equal(z_out, src)


def test_session_device_follows_the_first_provider():
    assert io.session_device(["CPUExecutionProvider"]) == torch.device("cpu")
    assert io.session_device([("CPUExecutionProvider", {})]) == torch.device("cpu")
    assert io.session_device(["CUDAExecutionProvider"], device="cpu") == torch.device("cpu")
    if not torch.cuda.is_available():  # a CPU torch: host buffers by default, an explicit "cuda" refused
        assert io.session_device(["CUDAExecutionProvider", "CPUExecutionProvider"]) == torch.device("cpu")
        with pytest.raises(RetraceError, match="CUDA torch"):
            io.session_device(["CUDAExecutionProvider", "CPUExecutionProvider"], device="cuda")
    with pytest.raises(RetraceError, match="dense"):
        io.bind_input(None, "x", torch.zeros(4, 4).t())


class _RecordingBinding:
    def __init__(self, inner, log, graph):
        self.inner, self.log, self.graph = inner, log, graph

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def bind_input(self, *args):
        self.log.append(("input", *args, self.graph))
        self.inner.bind_input(*args)

    def bind_output(self, *args):
        self.log.append(("output", *args, self.graph))
        self.inner.bind_output(*args)


class _RecordingSession:
    """An InferenceSession whose IO bindings record every bind call (the only way data reaches the run)."""

    def __init__(self, inner, log, graph):
        self.inner, self.log, self.graph = inner, log, graph

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def io_binding(self):
        return _RecordingBinding(self.inner.io_binding(), self.log, self.graph)

    def run_with_iobinding(self, binding, *args):
        self.log.append(("run",))
        return self.inner.run_with_iobinding(binding.inner, *args)


def test_a_generate_binds_everything_in_place_and_is_the_torch_decode():
    built = pair_and_bundle()
    be = OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=2, threads=1, verify=False)
    assert be.kv_mode == "inplace" and be.device == torch.device("cpu")
    log = []
    be.tgraph.bound = io.BoundSession(_RecordingSession(be.tgraph.sess, log, "target"))
    be.dgraph.bound = io.BoundSession(_RecordingSession(be.dgraph.sess, log, "drafter"))
    prompts = [[5, 17, 3, 41, 8, 8, 12], [60, 2, 33, 9]]
    params = SamplingParams(max_new_tokens=12)
    ours = Runtime(be, verify_policy="fixed").generate(prompts, params, "retrace")
    ref = Runtime.from_dirs(built.target, built.drafter, max_batch=2, max_seq_len=be.max_seq_len,
                            verify_policy="fixed").generate(prompts, params, "retrace")
    assert [r.token_ids for r in ours] == [r.token_ids for r in ref]

    binds = [e for e in log if e[0] != "run"]
    assert binds and {e[2:4] for e in binds} == {("cpu", 0)}  # device type and id of every binding
    # an ONNX element type and a pointer (null only for an empty tensor: a first draft's past)
    assert all(isinstance(e[4], int) and isinstance(e[6], int) and (e[6] or 0 in e[5]) for e in binds)
    kv = be.tcache.kv
    lo, hi = kv.data_ptr(), kv.data_ptr() + kv.numel() * kv.element_size()
    target = [e for e in binds if e[-1] == "target"]
    present = [e for e in target if e[0] == "output" and e[1].startswith("present_")]
    past = [e for e in target if e[0] == "input" and e[1].startswith(("past_key_", "past_value_"))]
    assert present and all(lo <= e[6] < hi for e in present + past)  # the caches themselves, no staging copy
    pairs = {(e[1][len("present_"):], e[6]) for e in present}
    assert pairs <= {(e[1][len("past_"):], e[6]) for e in past}  # past and present share each buffer
    assert not [e for e in target if e[1].startswith("new_key_")]
    # the drafter's new K/V land in one staging buffer per call, its logits only for the block's B - 1 rows
    assert {e[5][1] for e in binds if e[-1] == "drafter" and e[1] == "logits"} <= {be.drafter_config.block_size - 1}
    # the caches are bound once per slot range, not at every call (BoundSession)
    runs = sum(e == ("run",) for e in log)
    assert len([e for e in past if e[1] == "past_key_0"]) <= 3 < runs


def _add_graph():
    a, b, c = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["n"]) for n in "abc")
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g", [a, b], [c])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_kept_binding_reads_each_runs_memory_and_rebinds_only_what_moved():
    log = []
    bound = io.BoundSession(_RecordingSession(_add_graph(), log, "add"))
    a, b, c = torch.ones(4), torch.full((4,), 2.0), torch.empty(4)
    bound.run({"a": a, "b": b}, {"c": c})
    assert torch.equal(c, torch.full((4,), 3.0)) and len(log) == 4  # 3 binds, 1 run
    a.fill_(10)  # written in place: the same tensors bind nothing, and the run reads the new values
    bound.run({"a": a, "b": b}, {"c": c})
    assert torch.equal(c, torch.full((4,), 12.0)) and len(log) == 5
    b2, c2 = torch.full((4,), 100.0), torch.empty(4)  # new memory: rebound
    bound.run({"a": a, "b": b2}, {"c": c2})
    assert torch.equal(c2, torch.full((4,), 110.0)) and [e[1] for e in log[5:7]] == ["b", "c"]
    a6, b6, c6 = torch.ones(6), torch.ones(6), torch.empty(6)  # a new shape
    bound.run({"a": a6, "b": b6}, {"c": c6})
    assert torch.equal(c6, torch.full((6,), 2.0))
    with pytest.raises(Exception):  # noqa: B017 - ONNX Runtime's own exception type
        bound.run({"a": torch.ones(6), "b": torch.ones(5)}, {"c": c6})
    before = len(log)
    bound.run({"a": a6, "b": b6}, {"c": c6})  # after a failed run everything is bound afresh
    assert torch.equal(c6, torch.full((6,), 2.0)) and len(log) - before == 4
