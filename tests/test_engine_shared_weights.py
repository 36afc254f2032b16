"""One copy of the shared weights in the ONNX Runtime backend: the drafter graph's copy of the target's
embedding / LM head is never read; both sessions run on one read-only mapping of the target's tensors
(retrace.runtime.shared_weights), with outputs bit-identical to each session loading its own copy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from export_fixtures import BLOCK, copy_bundle, pair_and_bundle

from retrace.engines.bundle import BundleError
from retrace.models.drafter import SuffixInputs
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

pytestmark = pytest.mark.usefixtures("one_thread")


def _manifest(bundle: Path) -> dict:
    return json.loads((bundle / "manifest.json").read_text())


def _save_manifest(bundle: Path, m: dict) -> None:
    """An edited manifest with its self-hash renewed, as an older or a hand-made bundle would carry it."""
    from retrace.engines.bundle import manifest_digest

    m["manifest_sha256"] = manifest_digest(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def _calls(be: OnnxRuntimeBackend, seed: int = 0) -> list[torch.Tensor]:
    """Prefill, a ReTrace draft (suffix memory in use) and a verify at slot 0: every output tensor."""
    g = torch.Generator().manual_seed(seed)
    dc, vocab, d = be.drafter_config, be.target_config.vocab_size, be.drafter_config.hidden_size
    slots, P = torch.tensor([0]), 11
    pos = torch.arange(P).unsqueeze(0)
    logits, taps = be.target(slots, torch.randint(0, vocab, (1, P), generator=g), pos, torch.tensor([[P - 1]]))
    block_ids = torch.full((1, BLOCK), dc.mask_token_id)
    block_ids[0, 0] = 3
    valid = torch.ones(1, BLOCK)
    valid[0, 0] = 0
    suffix = SuffixInputs(torch.randn(1, BLOCK, d, generator=g) * valid[..., None],
                          torch.rand(1, BLOCK, be._num_features, generator=g) * valid[..., None], valid,
                          torch.randint(0, P, (1, BLOCK), generator=g))
    hidden, draft_logits = be.draft(slots, taps, pos, block_ids, P - 1 + torch.arange(BLOCK).unsqueeze(0), suffix)
    verify = be.target(slots, draft_logits[:, :, :vocab - 1].argmax(-1)[:, :BLOCK], P + torch.arange(BLOCK - 1)
                       .unsqueeze(0), torch.arange(BLOCK - 1).unsqueeze(0))
    return [logits, taps, hidden, draft_logits, *verify]


def _drafter_copy(bundle: Path, name: str) -> tuple[Path, int, int]:
    """(data file, offset, length) of the drafter graph's own copy of a shared initializer."""
    graph = bundle / "drafter" / "model.onnx"
    init = next(i for i in onnx.load(str(graph), load_external_data=False).graph.initializer if i.name == name)
    ext = {e.key: e.value for e in init.external_data}
    return graph.parent / ext["location"], int(ext.get("offset", 0)), int(ext["length"])


def test_build_records_the_shared_embedding_and_lm_head():
    m = _manifest(pair_and_bundle().bundle)
    pairs = m["graphs"]["drafter"]["shared_initializers"]
    # the tiny target is untied: embedding and LM head are two tensors, both shared
    assert pairs == {"shared_target.model.embed_tokens.weight": "target.model.embed_tokens.weight",
                     "shared_target.lm_head.weight": "target.lm_head.weight"}
    for name in ("target", "drafter"):
        proto = onnx.load(str(pair_and_bundle().bundle / name / "model.onnx"), load_external_data=False)
        head = next(i.name for i in proto.graph.initializer if i.name.endswith("lm_head.weight"))
        # the LM head is the A operand of its MatMul (ONNX Runtime prepacks only B: a prepacked weight would
        # get a private copy per session), and there is no transposed copy of it
        users = [(n.op_type, list(n.input).index(head)) for n in proto.graph.node if head in n.input]
        assert users == [("MatMul", 0)], users
        assert not [i.name for i in proto.graph.initializer if "lm_head" in i.name and i.name != head]


def test_both_sessions_get_one_mapping_of_the_targets_tensors():
    be = OnnxRuntimeBackend.from_bundle(pair_and_bundle().bundle, threads=1)
    pairs = _manifest(pair_and_bundle().bundle)["graphs"]["drafter"]["shared_initializers"]
    assert be.shared is not None and be.shared.drafter.keys() == pairs.keys()
    for d_name, t_name in pairs.items():
        assert be.shared.drafter[d_name] is be.shared.target[t_name]  # one OrtValue under both names
        arr = be.shared.arrays[t_name]
        assert isinstance(arr, np.memmap) and not arr.flags.writeable
        assert Path(arr.filename).resolve() == (pair_and_bundle().bundle / "target" / "model.onnx.data").resolve()
        assert be.shared.drafter[d_name].data_ptr() == arr.ctypes.data  # no copy on the way into ORT


def test_outputs_bit_identical_to_each_session_loading_its_own_copy():
    bundle = pair_and_bundle().bundle
    shared = _calls(OnnxRuntimeBackend.from_bundle(bundle, threads=1))
    own = OnnxRuntimeBackend.from_bundle(bundle, threads=1, share_weights=False)
    assert own.shared is None
    for a, b in zip(shared, _calls(own), strict=True):
        assert torch.equal(a, b)


def test_drafter_never_reads_its_own_copy(tmp_path):
    """Zero the drafter file's copies (same size, so a size-only check passes): with sharing the outputs
    do not change; loading the copies (share_weights=False) shows they were really zeroed."""
    bundle = copy_bundle(tmp_path / "b")
    want = _calls(OnnxRuntimeBackend.from_bundle(bundle, threads=1))
    for name in _manifest(bundle)["graphs"]["drafter"]["shared_initializers"]:
        path, offset, length = _drafter_copy(bundle, name)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes(length))
    got = _calls(OnnxRuntimeBackend.from_bundle(bundle, threads=1, verify=False))
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    broken = _calls(OnnxRuntimeBackend.from_bundle(bundle, threads=1, verify=False, share_weights=False))
    assert not torch.equal(broken[3], want[3])  # draft logits from a zero LM head


def test_bundle_without_the_table_loads_its_own_copies(tmp_path):
    """Bundles built before the table existed: same format version, each session loads its own copy."""
    bundle = copy_bundle(tmp_path / "b")
    m = _manifest(bundle)
    del m["graphs"]["drafter"]["shared_initializers"]
    _save_manifest(bundle, m)
    be = OnnxRuntimeBackend.from_bundle(bundle, threads=1)
    assert be.shared is None
    for a, b in zip(_calls(be), _calls(OnnxRuntimeBackend.from_bundle(pair_and_bundle().bundle, threads=1)),
                    strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pairs, match", [
    ({"shared_target.lm_head.weight": "target.no_such.weight"}, "do not both hold it"),
    ({"shared_target.lm_head.weight": "target.model.norm.weight"}, "one shape and dtype"),
    (["shared_target.lm_head.weight"], "must map drafter initializer names"),
])
def test_a_broken_table_is_refused_clearly(tmp_path, pairs, match):
    bundle = copy_bundle(tmp_path / "b")
    m = _manifest(bundle)
    m["graphs"]["drafter"]["shared_initializers"] = pairs
    _save_manifest(bundle, m)
    with pytest.raises(BundleError, match=match):
        OnnxRuntimeBackend.from_bundle(bundle, threads=1)


def test_one_lm_head_session_serves_both_graphs():
    """Forced on (the tiny table is under the size that turns it on by default): both graphs are cut
    before their LM head (they output its rows) and one session, the only one that prepacks the table,
    scores the rows of both (retrace.runtime.lm_head_split); outputs as with the head inside each graph."""
    bundle = pair_and_bundle().bundle
    be = OnnxRuntimeBackend.from_bundle(bundle, threads=1, lm_head_session=True)
    assert be.head is not None
    for g in (be.tgraph, be.dgraph):
        outs = [o.name for o in g.sess.get_outputs()]
        assert "logits" not in outs and g.rows in outs
    assert [i.name for i in be.head.sess.get_inputs()] == ["rows"]
    inside = OnnxRuntimeBackend.from_bundle(bundle, threads=1)  # by default for a small table
    assert inside.head is None and inside.tgraph.rows is None and inside.dgraph.rows is None
    for a, b in zip(_calls(be), _calls(inside), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_lm_head_is_one_prepacked_gemm_in_a_graph_that_keeps_it():
    from retrace.runtime.lm_head_split import rewrite_head

    for name in ("target", "drafter"):
        head = rewrite_head(pair_and_bundle().bundle / name / "model.onnx", cut=False)
        proto = onnx.load_from_string(head.model)
        users = [(n.op_type, list(n.input).index(head.weight), n.attribute[0].i) for n in proto.graph.node
                 if head.weight in n.input and n.op_type != "Gather"]
        assert users == [("Gemm", 1, 1)]  # B operand, transB=1: prepacked, over the [V, d] table as stored


def test_a_graph_without_the_exported_lm_head_is_used_as_it_is(tmp_path):
    from onnx import TensorProto, helper, numpy_helper

    from retrace.runtime.lm_head_split import rewrite_head

    w = numpy_helper.from_array(np.zeros((8, 4), np.float32), "W")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "W"], ["logits"], transB=1)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 8])], [w])
    onnx.save(helper.make_model(graph), str(tmp_path / "m.onnx"))
    assert rewrite_head(tmp_path / "m.onnx", cut=True) is None and rewrite_head(tmp_path / "m.onnx", cut=False) is None


def test_a_drafter_lm_head_of_its_own_keeps_it_in_each_graph(tmp_path):
    """Only an LM head the drafter shares with the target moves to the one head session."""
    bundle = copy_bundle(tmp_path / "b")
    m = _manifest(bundle)
    del m["graphs"]["drafter"]["shared_initializers"]["shared_target.lm_head.weight"]
    _save_manifest(bundle, m)
    be = OnnxRuntimeBackend.from_bundle(bundle, threads=1, verify=False, lm_head_session=True)
    assert be.head is None and be.shared is not None and be.tgraph.rows is None and be.dgraph.rows is None
    for a, b in zip(_calls(be), _calls(OnnxRuntimeBackend.from_bundle(pair_and_bundle().bundle, threads=1)),
                    strict=True):
        assert torch.equal(a, b)
