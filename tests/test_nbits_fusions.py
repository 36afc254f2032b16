"""The quantized bundle's graph fusions (retrace.export.nbits_fusions), each on its own: the fused graph's
outputs equal the unfused quantized graph's (logits within 1e-5 x max|logit|, the same greedy tokens), on
the target (and its tree inputs where it has them) and on the drafter (its GatedSuffixFusion inlined), and the node
counts change exactly as intended (q/k/v and gate/up: 5 MatMulNBits per layer become 2 plus 2 Splits;
each residual Add + RMSNormalization becomes one SkipSimplifiedLayerNormalization).
"""

from __future__ import annotations

import collections
import shutil

import numpy as np
import onnx
import pytest
import torch
from export_fixtures import pair_and_bundle

from retrace.export.nbits_fusions import fuse_quantized, fuse_skip_rms_norm, merge_parallel_nbits
from retrace.export.onnx_export import causal_mask, drafter_inputs, drafter_io, target_inputs, target_io
from retrace.export.onnx_parity import session
from retrace.export.quantize import WeightQuant, quantize_graph
from retrace.models.drafter import load_pair

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5  # x max|logit|: a fused kernel sums in another order, nothing more


@pytest.fixture(scope="module")
def unfused(tmp_path_factory, one_thread):
    """The session bundle's fp32 target and drafter graphs, int4-quantized without the fusions."""
    built = pair_and_bundle()
    root = tmp_path_factory.mktemp("nbits")
    out = {}
    for name in ("target", "drafter"):
        shutil.copytree(built.bundle / name, root / name)
        rec = quantize_graph(root / name / "model.onnx", WeightQuant("int4", 16, fuse=False))
        assert rec["fusions"] == {}
        out[name] = root / name / "model.onnx"
    target, drafter = load_pair(built.target, built.drafter)
    return out, target, drafter


def _fused(path, tmp_path, fusion):
    m = onnx.load(str(path))  # with its weights: the fusions read and write them
    counts = {fusion.__name__: fusion(m)} if fusion else fuse_quantized(m)
    dst = tmp_path / f"{fusion.__name__ if fusion else 'all'}.onnx"
    onnx.save_model(m, str(dst), save_as_external_data=True, location=dst.name + ".data")
    return dst, counts


def _ops(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node)


def _run(path, names, args, outputs):
    return session(path).run(outputs, {n: a.numpy() for n, a in zip(names, args, strict=True)})


def _target_feeds(target, tree: bool):
    L = target.config.num_hidden_layers
    args = target_inputs(target, 3, 5, 7, seed=11)
    if tree:  # a branching tree: node 2 and 3 both children of 1, 4 a child of 3
        mask = causal_mask(3, 5).clone()
        mask[:, 3, 2] = False
        mask[:, 4, 2] = False
        args = (*args, mask)
    return target_io(L, tree)[0], args


@pytest.mark.parametrize("fusion", [merge_parallel_nbits, fuse_skip_rms_norm, None])
def test_target_fusion_keeps_the_logits(unfused, tmp_path, fusion):
    paths, target, _ = unfused
    L = target.config.num_hidden_layers
    fused, counts = _fused(paths["target"], tmp_path, fusion)
    before, after = _ops(paths["target"]), _ops(fused)
    if fusion in (merge_parallel_nbits, None):
        assert counts["merge_parallel_nbits"] == 2 * L  # q/k/v and gate/up of every layer
        assert before["MatMulNBits"] - after["MatMulNBits"] == 3 * L
        assert after["Split"] - before["Split"] == 2 * L
    if fusion in (fuse_skip_rms_norm, None):
        assert counts["fuse_skip_rms_norm"] == 2 * L  # after attention, after the MLP (the final norm)
        assert after["SkipSimplifiedLayerNormalization"] == 2 * L
        assert before["Add"] - after["Add"] == 2 * L
        assert before["RMSNormalization"] - after["RMSNormalization"] == 2 * L
    has_tree = "tree_mask" in {i.name for i in session(paths["target"]).get_inputs()}
    for tree in (False, True) if has_tree else (False,):
        names, args = _target_feeds(target, tree)
        outs = ["logits", "taps", "new_key_0", "new_value_0"]
        ref, got = _run(paths["target"], names, args, outs), _run(fused, names, args, outs)
        scale = float(np.abs(ref[0]).max())
        assert np.abs(got[0] - ref[0]).max() <= TOL * scale
        assert (got[0].argmax(-1) == ref[0].argmax(-1)).all()
        for r, g in zip(ref[1:], got[1:], strict=True):  # taps and K/V: what the drafter and the cache read
            assert np.abs(g - r).max() <= TOL * max(1.0, float(np.abs(r).max()))


def test_drafter_fusion_keeps_its_logits(unfused, tmp_path):
    paths, _, drafter = unfused
    fused, counts = _fused(paths["drafter"], tmp_path, None)
    assert "GatedSuffixFusion" not in _ops(fused)  # inlined when quantized (retrace.export.inline_fusion)
    assert sum(counts.values()) > 0
    suffix = drafter.conditioner is not None
    L = drafter.config.layers.num_hidden_layers
    names = drafter_io(L, suffix)[0]
    args = drafter_inputs(drafter, 2, 3, 8, 6, suffix, seed=5)
    ref, got = _run(paths["drafter"], names, args, ["logits"])[0], _run(fused, names, args, ["logits"])[0]
    assert np.abs(got - ref).max() <= TOL * float(np.abs(ref).max())
    assert torch.equal(torch.from_numpy(got).argmax(-1), torch.from_numpy(ref).argmax(-1))


def test_shared_head_is_not_merged(unfused, tmp_path):
    """The LM head reads its own rows: never merged with another MatMulNBits (its bytes stay the ones the
    drafter shares)."""
    paths, _, _ = unfused
    fused, _ = _fused(paths["target"], tmp_path, merge_parallel_nbits)
    m = onnx.load(str(fused), load_external_data=False)
    assert any(n.input[1].endswith("lm_head.weight.T_Q4") for n in m.graph.node if n.op_type == "MatMulNBits")


def test_int8_target_fusions_keep_the_logits(tmp_path, one_thread):
    """The same fusions on an int8 graph (8-bit blocks concatenate along N the same way)."""
    built = pair_and_bundle()
    shutil.copytree(built.bundle / "target", tmp_path / "target")
    path = tmp_path / "target" / "model.onnx"
    quantize_graph(path, WeightQuant("int8", 16, fuse=False))
    target, _ = load_pair(built.target, built.drafter)
    fused, counts = _fused(path, tmp_path, None)
    L = target.config.num_hidden_layers
    assert counts == {"merge_parallel_nbits": 2 * L, "fuse_skip_rms_norm": 2 * L}
    names, args = _target_feeds(target, False)
    ref, got = _run(path, names, args, ["logits"])[0], _run(fused, names, args, ["logits"])[0]
    assert np.abs(got - ref).max() <= TOL * float(np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()
