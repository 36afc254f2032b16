"""The ONNX Runtime workers' wait policy: bounded spinning, stopped after each run, by default."""

import numpy as np
import pytest

from retrace.errors import RetraceError
from retrace.runtime.ort_spinning import DEFAULT_SPIN_US, spinning_entries


def test_default_spins_bounded_and_stops_after_each_run():
    assert spinning_entries({}) == {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1",
                                    "session.intra_op.spin_duration_us": str(DEFAULT_SPIN_US)}


def test_environment_turns_it_off_or_unbounds_it():
    assert spinning_entries({"RETRACE_ORT_SPINNING": "0"}) == {"session.intra_op.allow_spinning": "0"}
    unbounded = spinning_entries({"RETRACE_ORT_SPIN_US": "0"})
    assert "session.intra_op.spin_duration_us" not in unbounded and unbounded["session.force_spinning_stop"] == "1"
    assert spinning_entries({"RETRACE_ORT_SPIN_US": " 200 "})["session.intra_op.spin_duration_us"] == "200"


@pytest.mark.parametrize("env, named", [({"RETRACE_ORT_SPINNING": "maybe"}, "RETRACE_ORT_SPINNING"),
                                        ({"RETRACE_ORT_SPIN_US": "-5"}, "RETRACE_ORT_SPIN_US"),
                                        ({"RETRACE_ORT_SPIN_US": "1.5"}, "RETRACE_ORT_SPIN_US")])
def test_bad_values_are_named(env, named):
    with pytest.raises(RetraceError, match=named):
        spinning_entries(env)


def test_sessions_carry_the_policy_and_accept_it(monkeypatch, tmp_path):
    """The entries reach every session the backend makes, and ONNX Runtime accepts them (it rejects bad ones
    when the session is created)."""
    ort = pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from retrace.runtime.onnxruntime_backend import _session_options

    monkeypatch.delenv("RETRACE_ORT_SPINNING", raising=False)  # the suite blocks by default (conftest)
    monkeypatch.setenv("RETRACE_ORT_SPIN_US", "75")
    so = _session_options(2, None)
    assert so.get_session_config_entry("session.intra_op.spin_duration_us") == "75"
    assert so.get_session_config_entry("session.force_spinning_stop") == "1"
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "relu.onnx"
    onnx.save(model, str(path))
    out = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(
        None, {"x": np.array([-1, 2, -3, 4], dtype=np.float32)})[0]
    assert out.tolist() == [0, 2, 0, 4]
    assert _session_options(2, {"session.intra_op.allow_spinning": "0"}).get_session_config_entry(
        "session.intra_op.allow_spinning") == "0"  # a caller's entry wins
