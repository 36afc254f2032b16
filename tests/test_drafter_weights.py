"""`retrace-export build --drafter-weights`: the drafter at its own precision beside the target's. A draft
only decides what is proposed, never what is committed, so every mode stays the bundle's own `ar` output
token for token; the manifest says which graph runs at which precision (`quantization`: the target's,
`drafter_quantization`: the drafter's own), and the target's graph is the one --weights asked for.
"""

from __future__ import annotations

import json

import onnx
import pytest
import torch
from click.testing import CliRunner
from export_fixtures import cli_build
from runtime_fixtures import write_pair

from retrace.runtime import Runtime, SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
V, BLOCK, MAX_BATCH, MAX_SEQ = 16, 8, 4, 96


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return write_pair(root, vocab=V, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48, block_size=BLOCK,
                      conditioner="random", seed=11)


def _ops(bundle, name: str) -> set[str]:
    return {n.op_type for n in onnx.load(str(bundle / name / "model.onnx"), load_external_data=False).graph.node}


def _lossless(bundle) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in (6, 1, 10)]
    params = SamplingParams(max_new_tokens=30)
    want = [r.token_ids for r in Runtime.from_bundle(bundle, threads=1).generate(prompts, params, "ar")]
    for mode, batch in (("dflash", 1), ("retrace", 1), ("retrace", 3)):
        rt = Runtime.from_bundle(bundle, threads=1, verify_policy="fixed")
        got = rt.generate(prompts[:batch], params, mode)
        assert [r.token_ids for r in got] == want[:batch], (mode, batch)
        assert rt.run_stats()["rounds"] > 0
    return want


def test_an_int8_drafter_beside_an_fp32_target(pair, tmp_path):
    target, drafter = pair
    cli_build(target, drafter, tmp_path / "fp32", MAX_BATCH, MAX_SEQ, "--quiet")
    out = cli_build(target, drafter, tmp_path / "d8", MAX_BATCH, MAX_SEQ, "--drafter-weights", "int8", "--quiet")
    assert "drafter weights int8 (block 128" in out
    m = json.loads((tmp_path / "d8" / "manifest.json").read_text())
    assert "quantization" not in m and m.get("weights", "fp32") == "fp32" and m["drafter_weights"] == "int8"
    dq = m["drafter_quantization"]
    assert (dq["weights"], dq["block_size"], dq["accuracy_level"]) == ("int8", 128, 4)
    assert list(dq["graphs"]) == ["drafter"] and "agreement_with_fp32" not in dq
    assert dq["graphs"]["drafter"]["lm_head"]  # its head quantized too: its own packed copy, not shared
    assert "shared_target.lm_head.weight" not in m["graphs"]["drafter"]["shared_initializers"]
    assert "MatMulNBits" in _ops(tmp_path / "d8", "drafter") and "GatedSuffixFusion" not in _ops(tmp_path / "d8",
                                                                                                   "drafter")
    assert "MatMulNBits" not in _ops(tmp_path / "d8", "target")
    # the target graph is the fp32 one, parity-checked against torch: the same tokens as the fp32 bundle's
    assert _lossless(tmp_path / "d8") == _lossless(tmp_path / "fp32")


def test_an_fp32_drafter_beside_an_int4_target(pair, tmp_path):
    target, drafter = pair
    cli_build(target, drafter, tmp_path / "b", MAX_BATCH, MAX_SEQ, "--weights", "int4", "--weight-block-size", "16",
              "--drafter-weights", "fp32", "--quiet")
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert (m["weights"], m["drafter_weights"]) == ("int4", "fp32") and "drafter_quantization" not in m
    assert list(m["quantization"]["graphs"]) == ["target"] and m["quantization"]["agreement_with_fp32"]
    assert "MatMulNBits" in _ops(tmp_path / "b", "target")
    assert "MatMulNBits" not in _ops(tmp_path / "b", "drafter") and "GatedSuffixFusion" in _ops(tmp_path / "b",
                                                                                                 "drafter")
    _lossless(tmp_path / "b")


def test_bad_drafter_weights_are_refused(pair, tmp_path):
    from retrace.export.cli import main

    target, drafter = pair
    cases = [([], "--drafter-weights needs --drafter"),
             (["--drafter", str(drafter), "--dtype", "float16"], "--drafter-weights int8 builds ONNX Runtime"),
             (["--drafter", str(drafter), "--backend", "tensorrt"], "--drafter-weights int8 builds ONNX Runtime")]
    for extra, msg in cases:
        res = CliRunner().invoke(main, ["build", "--target", str(target), "--out", str(tmp_path / "b"),
                                        "--drafter-weights", "int8", *extra])
        assert res.exit_code != 0 and msg in res.output, (extra, res.output)
        assert not (tmp_path / "b").exists()
