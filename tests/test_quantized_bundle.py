"""int4 weight-only bundles (`retrace-export build --weights int4`, retrace.export.quantize): every linear
layer and the LM head of both graphs run as ONNX Runtime MatMulNBits, the manifest says so, and speculative
decoding stays lossless relative to the deployed (quantized) target: dflash / retrace greedy outputs equal
the bundle's own `ar` output token for token (batch 1 and ragged batches, accepted and rejected drafts,
trees, prompt lookup, the LM head in a session of its own), and sampled outputs follow the quantized
target's own distribution (chi-square against the exact joint computed from the bundle's target graph).
"""

from __future__ import annotations

import itertools
import json

import onnx
import pytest
import torch
from click.testing import CliRunner
from export_fixtures import cli_build
from runtime_fixtures import OracleDrafter, write_pair
from test_runtime_sampling import ALPHA, chi_square

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.nbits_probe import probe_rule
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.row_invariance import RowWidths, rows_matching_decodes, stricter

pytestmark = pytest.mark.usefixtures("one_thread")
V, BLOCK, MAX_BATCH, MAX_SEQ, MAX_NEW = 16, 8, 8, 128, 40


@pytest.fixture(scope="module")
def qbundle(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("int4")
    target, drafter = write_pair(root, vocab=V, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48,
                                 block_size=BLOCK, conditioner="random", seed=7)
    bundle = root / "bundle"
    cli_build(target, drafter, bundle, MAX_BATCH, MAX_SEQ, "--tree-mask", "--weights", "int4",
              "--weight-block-size", "16", "--head-block-size", "64", "--quiet")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in (5, 1, 9, 3, 12)]
    own = Runtime.from_bundle(bundle, threads=1).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW + BLOCK + 2),
                                                          "ar")
    return bundle, prompts, [r.token_ids for r in own]


def _runtime(bundle, seqs=None, **kw) -> Runtime:
    be_kw = {k: kw.pop(k) for k in ("lm_head_session", "max_batch") if k in kw}
    be = OnnxRuntimeBackend.from_bundle(bundle, threads=1, **be_kw)
    return Runtime(OracleDrafter(be, seqs, seed=2) if seqs else be, verify_policy=kw.pop("verify_policy", "fixed"),
                   **kw)


def test_manifest_records_the_quantization(qbundle):
    bundle = qbundle[0]
    m = json.loads((bundle / "manifest.json").read_text())
    q = m["quantization"]
    assert (m["weights"], q["bits"], q["block_size"], q["lm_head_block_size"], q["accuracy_level"],
            q["symmetric"]) == ("int4", 4, 16, 64, 4, True)
    for name in ("target", "drafter"):
        proto = onnx.load(str(bundle / name / "model.onnx"), load_external_data=False)
        nbits = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
        assert sorted(n.name for n in nbits) == q["graphs"][name]["nodes"]
        # every linear layer and the LM head: no float MatMul with a constant weight is left
        inits = {i.name for i in proto.graph.initializer}
        assert not [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
        assert q["graphs"][name]["lm_head"].endswith("lm_head.weight.T")
        blocks = {n.name: {a.name: a.i for a in n.attribute}["block_size"] for n in nbits}
        assert blocks.pop("lm_head_matmul_Q4") == 64 and set(blocks.values()) == {16}  # the head at its own block
        assert m["graphs"][name]["ops"]["MatMulNBits"] == len(nbits)
        fused = q["graphs"][name]["fusions"]  # retrace.export.nbits_fusions ran on both graphs
        assert m["graphs"][name]["ops"].get("SkipSimplifiedLayerNormalization", 0) == fused["fuse_skip_rms_norm"]
    assert q["graphs"]["target"]["fusions"] == {"merge_parallel_nbits": 4, "fuse_skip_rms_norm": 4}  # 2 layers
    proto = onnx.load(str(bundle / "drafter" / "model.onnx"), load_external_data=False)
    # the fusion inlined (retrace.export.inline_fusion) and its three linear layers quantized like the rest
    assert [n.op_type for n in proto.graph.node].count("GatedSuffixFusion") == 0 and not proto.functions
    inlined = q["graphs"]["drafter"]["inlined_fusion_matmuls"]
    assert inlined == ["gated_suffix_fusion_gate", "gated_suffix_fusion_refine", "gated_suffix_fusion_value"]
    assert {f"{n}_Q4" for n in inlined} <= set(q["graphs"]["drafter"]["nodes"])
    assert q["graphs"]["target"]["inlined_fusion_matmuls"] == [] and m["graphs"]["drafter"]["custom_nodes"] == 0
    # the drafter's quantized LM head is the target's, byte for byte: one mapped copy for both sessions
    assert m["graphs"]["drafter"]["shared_initializers"] == {
        "shared_target.model.embed_tokens.weight": "target.model.embed_tokens.weight",
        "shared_target.lm_head.weight.T_Q4": "target.lm_head.weight.T_Q4",
        "shared_target.lm_head.weight.T_scales": "target.lm_head.weight.T_scales"}
    a = q["agreement_with_fp32"]
    assert a["tokens"] == 128 and 0 < a["top1_agreement"] <= 1 and 0 < a["max_logit_error"] < a["max_abs_logit"]
    assert m["parity"]["target"]["max_scaled_logits_diff"] < 1e-4  # fp32 graphs checked before quantizing


@pytest.mark.parametrize("mode", ["dflash", "retrace"])
def test_greedy_equals_the_bundles_own_ar(qbundle, mode):
    """Random drafter (mostly rejected) at batch 1 and 5 with the adaptive policy, and an oracle drafter
    (every acceptance length, ragged batches, slots reused: 5 requests through 4 rows) with the fixed one."""
    bundle, prompts, own = qbundle
    want = [o[:MAX_NEW] for o in own]
    params = SamplingParams(max_new_tokens=MAX_NEW)
    for batch in (1, 5):
        res = Runtime.from_bundle(bundle, threads=1).generate(prompts[:batch], params, mode)
        assert [r.token_ids for r in res] == want[:batch], (mode, batch)
    seqs = {tuple(p): p + o for p, o in zip(prompts, own, strict=True)}
    rt_rows = _runtime(bundle, seqs, max_batch=4)
    res = rt_rows.generate(prompts, params, mode)
    assert [r.token_ids for r in res] == want
    stats = rt_rows.run_stats()
    assert stats["tau"] > 1.5 and all(n > 0 for n in stats["accepted_hist"]), stats["accepted_hist"]


def test_verify_rows_are_bit_identical_to_the_decode_steps(qbundle):
    """retrace.runtime.row_invariance: every row of a T-token call (T = 2..9, odd and even) carries the
    same logits, bit for bit, as the one-token decode step of `ar` at that position, so greedy speculative
    decoding cannot leave `ar` at a near tie; in the LM head session too. The rules are this CPU's, probed
    (runtime/nbits_probe.py): the linear layers' block (16) is row-invariant on the CPUs measured, the head's
    (64) needs an even number of rows (AVX-512) or two (AVX2); without the padding rows differ."""
    head = probe_rule(32, 4, 64, 4, 1)  # K: the pair's hidden size
    body = stricter(*(probe_rule(k, 4, 16, 4, 1) for k in (32, 48)))  # hidden = heads x head_dim, intermediate
    assert head in ("two", "pairs")
    for kw in ({}, {"lm_head_session": True}):
        be = OnnxRuntimeBackend.from_bundle(qbundle[0], threads=1, **kw)
        assert be.inplace.pad and be.widths == RowWidths(tokens=body, rows=head)
        got = rows_matching_decodes(be)
        assert got == {w: w for w in got}, (kw, got)
    got = rows_matching_decodes(OnnxRuntimeBackend.from_bundle(qbundle[0], threads=1, row_invariant=False))
    assert got != {w: w for w in got}, got


def test_trees_prompt_lookup_and_the_lm_head_session(qbundle):
    bundle, prompts, own = qbundle
    want = [o[:MAX_NEW] for o in own]
    params = SamplingParams(max_new_tokens=MAX_NEW)
    seqs = {tuple(p): p + o for p, o in zip(prompts, own, strict=True)}
    rt = _runtime(bundle, seqs, tree_budget=12)
    assert [r.token_ids for r in rt.generate(prompts, params, "retrace")] == want
    assert rt.run_stats()["tau"] > 1.5
    rt = Runtime.from_bundle(bundle, threads=1, prompt_lookup=PromptLookup(max_rows=4))
    assert [r.token_ids for r in rt.generate(prompts, params, "retrace")] == want
    # the quantized head cut off both graphs into one MatMulNBits session (forced: it is tiny here)
    rt = _runtime(bundle, seqs, lm_head_session=True)
    assert rt.backend.inner.head is not None and rt.backend.inner.tgraph.rows
    assert [r.token_ids for r in rt.generate(prompts, params, "dflash")] == want
    ar = Runtime(OnnxRuntimeBackend.from_bundle(bundle, threads=1,
                                                lm_head_session=True)).generate(prompts, params, "ar")
    assert [r.token_ids for r in ar] == want


def test_the_int4_head_stays_in_each_graph_by_default(qbundle, monkeypatch):
    """A MatMulNBits head, however large, stays in the target and drafter graphs (one session run per call);
    a float head of that size would get the LM head session (retrace.runtime.onnxruntime_backend)."""
    import retrace.runtime.onnxruntime_backend as orb

    monkeypatch.setattr(orb, "LM_HEAD_SESSION_MIN_BYTES", 0)  # every head counts as large
    be = OnnxRuntimeBackend.from_bundle(qbundle[0], threads=1)
    assert be.head is None and not be.tgraph.rows and not be.dgraph.rows
    assert "logits" in be.tgraph.outputs and "logits" in be.dgraph.outputs


def test_the_layout_fold_keeps_the_int4_targets_calls(qbundle, monkeypatch):
    """The in-place graph without the layout Transposes and with the rotary inside GroupQueryAttention
    (retrace.runtime.kv_inplace_layout; its cos/sin caches indexed by position_ids) against the same graph
    with both: the same logits (1e-5 x max|logit|), argmax and taps call by call (ragged prefill, batched
    verify, a draft tree's verify: its nodes at their depths), equal K/V; no Transpose, no RotaryEmbedding."""
    from runtime_fixtures import call_both

    import retrace.runtime.onnxruntime_backend as orb

    bundle = qbundle[0]
    new = OnnxRuntimeBackend.from_bundle(bundle, threads=1, max_batch=3)
    real = orb.to_inplace_kv
    monkeypatch.setattr(orb, "to_inplace_kv", lambda *a, **k: real(*a, **k, fold_layout=False))
    ref = OnnxRuntimeBackend.from_bundle(bundle, threads=1, max_batch=3)
    c = new.target_config.layers
    ops = {}
    for fold in (True, False):
        m = onnx.load(str(bundle / "target" / "model.onnx"), load_external_data=False)
        real(m, c.num_attention_heads, c.num_key_value_heads, c.head_dim, fold_layout=fold, max_positions=MAX_SEQ)
        ops[fold] = [n.op_type for n in m.graph.node]
    L = c.num_hidden_layers
    assert ops[True].count("Transpose") == 0 and ops[False].count("Transpose") == 8 * L
    assert ops[True].count("RotaryEmbedding") == 0 and ops[False].count("RotaryEmbedding") == 2 * L
    # per layer 8 Reshapes -> 4 (q and k: their view and one to [N, T, H*hd]; v and the output: none), plus
    # the two that shape the cos/sin caches
    assert ops[False].count("Reshape") - ops[True].count("Reshape") == 4 * L - 2
    g = torch.Generator().manual_seed(5)
    for s, n in ((0, 9), (1, 4), (2, 6)):
        call_both(ref, new, torch.tensor([s]), torch.randint(0, V, (1, n), generator=g), torch.arange(n)[None],
                  torch.tensor([[n - 1]]))
    slots, past = torch.tensor([0, 1]), torch.tensor([9, 4])
    call_both(ref, new, slots, torch.randint(0, V, (2, 3), generator=g), past[:, None] + torch.arange(3),
              torch.arange(3).expand(2, 3).contiguous())
    tree = torch.ones(4, 4, dtype=torch.bool).tril()
    tree[2, 1] = tree[3, 1] = False  # nodes 1 and 2 both children of 0, 3 a child of 2
    call_both(ref, new, torch.tensor([2]), torch.randint(0, V, (1, 4), generator=g), torch.tensor([[6, 7, 7, 8]]),
              torch.arange(4)[None], tree[None])
    # the entries written (past them: a pad row's, retrace.runtime.row_invariance)
    for slot, filled in ((0, 12), (1, 7), (2, 10)):
        assert torch.equal(ref.tcache.kv[:, slot, :, :filled], new.tcache.kv[:, slot, :, :filled])


def test_sampling_follows_the_quantized_targets_distribution(qbundle):
    """retrace-mode sampling (T=1) on the int4 bundle: tokens 2-3 follow the exact joint computed from the
    bundle's own target graph (alpha 0.01), so acceptance uses the deployed target's probabilities."""
    bundle, _, _ = qbundle
    prompt, n = [3, 1, 4, 1, 5], 3000
    be = OnnxRuntimeBackend.from_bundle(bundle, threads=1)
    prefixes = [prompt + list(t) for t in itertools.product(range(V), repeat=2)]  # [V^2] prompt + t1 t2
    probs = []
    for i in range(0, len(prefixes), MAX_BATCH):
        ids = torch.tensor(prefixes[i:i + MAX_BATCH])
        N, T = ids.shape
        logits, _ = be.target(torch.arange(N), ids, torch.arange(T).expand(N, T),
                              torch.tensor([[T - 3, T - 2, T - 1]] * N))
        probs.append(logits.double().softmax(-1))
    probs = torch.cat(probs).view(V, V, 3, V)  # [t1, t2, position, next]
    joint = probs[0, 0, 0][:, None, None] * probs[:, 0, 1][:, :, None] * probs[:, :, 2]  # P(t1, t2, t3)
    tail = {k: float(joint.sum(0)[k]) for k in itertools.product(range(V), repeat=2)}
    rt = Runtime(be, verify_policy="fixed")
    sched = rt.scheduler()
    reqs = [sched.add(prompt, SamplingParams(max_new_tokens=3, temperature=1.0, seed=i), "retrace") for i in range(n)]
    while sched.has_work:
        sched.step()
    p_value, df, _ = chi_square([tuple(r.output_ids[1:3]) for r in reqs], tail)
    assert p_value > ALPHA, f"chi-square p={p_value:.2e} (df {df})"
    assert rt.run_stats()["tau"] > 1.0


def test_bad_quantization_options_are_refused(tmp_path):
    from retrace.export.cli import main

    cases = [(["--weights", "int4", "--weight-block-size", "24"], "power of two"),
             (["--weights", "int4", "--head-block-size", "8"], "--head-block-size must be a power of two"),
             (["--weight-block-size", "32"], "need --weights int4 or int8"),
             (["--weights", "w8a8", "--accuracy-level", "4"], "not w8a8"),
             (["--weights", "int8", "--dtype", "float16"], "--dtype float32")]
    for extra, msg in cases:
        res = CliRunner().invoke(main, ["build", "--target", str(tmp_path), "--out", str(tmp_path / "b"), *extra])
        assert res.exit_code != 0 and msg in res.output, (extra, res.output)
        assert not (tmp_path / "b").exists()
    with pytest.raises(RetraceError, match="accuracy-level"):
        from retrace.export.quantize import WeightQuant

        WeightQuant("int4", accuracy_level=5)


def test_int8_graphs_of_the_session_bundle_decode_like_their_own_ar(tmp_path):
    """quantize_graph at int8 on a copy of the session's fp32 bundle (no new export): every mode, with the
    LM head in the graphs or in its own session, gives the int8 target's own greedy tokens."""
    from export_fixtures import copy_bundle

    from retrace.engines.bundle import write_manifest
    from retrace.export.quantize import WeightQuant, quantize_graph
    from retrace.runtime.shared_weights import shared_pairs

    bundle = copy_bundle(tmp_path / "int8")
    m = json.loads((bundle / "manifest.json").read_text())
    for name in ("target", "drafter"):
        assert quantize_graph(bundle / name / "model.onnx", WeightQuant("int8", 32))["lm_head"]
    m["graphs"]["drafter"]["shared_initializers"] = shared_pairs(bundle / "target" / "model.onnx",
                                                                 bundle / "drafter" / "model.onnx")
    assert "shared_target.lm_head.weight.T_Q8" in m["graphs"]["drafter"]["shared_initializers"]
    m.pop("files")
    write_manifest(bundle, m)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (5, 9, 3)]
    params = SamplingParams(max_new_tokens=24)
    want = [r.token_ids for r in Runtime.from_bundle(bundle, threads=1).generate(prompts, params, "ar")]
    for mode, head in (("dflash", None), ("retrace", None), ("retrace", True), ("ar", True)):
        rt = Runtime.from_bundle(bundle, threads=1, lm_head_session=head)
        assert [r.token_ids for r in rt.generate(prompts, params, mode)] == want, (mode, head)


def test_w8a8_graphs_are_row_invariant_and_decode_like_their_own_ar(tmp_path):
    """retrace.export.w8a8 on a copy of the session's fp32 bundle: the target's linear layers and LM head as
    integer matmuls (the drafter keeps its float head), no padding rule (the integer sums are exact in any
    row count: every verify row equals its decode step bit for bit) and every mode gives the w8a8 target's
    own greedy tokens, at batch 1 and 3."""
    from export_fixtures import copy_bundle

    from retrace.engines.bundle import write_manifest
    from retrace.export.quantize import WeightQuant, quantize_graph
    from retrace.runtime.shared_weights import shared_pairs

    bundle = copy_bundle(tmp_path / "w8a8")
    m = json.loads((bundle / "manifest.json").read_text())
    q = WeightQuant("w8a8")
    rec = {name: quantize_graph(bundle / name / "model.onnx", q, lm_head=name == "target")
           for name in ("target", "drafter")}
    assert rec["target"]["lm_head"].endswith("lm_head.weight.T") and rec["drafter"]["lm_head"] is None
    for name in ("target", "drafter"):
        proto = onnx.load(str(bundle / name / "model.onnx"), load_external_data=False)
        inits = {i.name for i in proto.graph.initializer}
        ints = [n for n in proto.graph.node if n.op_type == "MatMulInteger"]
        assert 0 < len(ints) < len(rec[name]["nodes"])  # q/k/v and gate/up merged (retrace.export.w8a8)
        assert not [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in inits]
    m["weights"], m["quantization"] = "w8a8", q.manifest()
    # this pair's head is untied: the target's float head is gone, the drafter's own copy stays unshared
    m["graphs"]["drafter"]["shared_initializers"] = shared_pairs(bundle / "target" / "model.onnx",
                                                                 bundle / "drafter" / "model.onnx")
    m.pop("files")
    write_manifest(bundle, m)
    be = OnnxRuntimeBackend.from_bundle(bundle, threads=1)
    assert be.widths == RowWidths(tokens="any", rows="any")
    got = rows_matching_decodes(be)
    assert got == {w: w for w in got}, got
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 90, (n,), generator=g).tolist() for n in (6, 2, 11)]
    params = SamplingParams(max_new_tokens=24)
    want = [r.token_ids for r in Runtime.from_bundle(bundle, threads=1).generate(prompts, params, "ar")]
    for mode, batch in itertools.product(("dflash", "retrace"), (1, 3)):
        rt = Runtime.from_bundle(bundle, threads=1)
        assert [r.token_ids for r in rt.generate(prompts[:batch], params, mode)] == want[:batch], (mode, batch)


def test_row_rules_are_probed_on_this_cpu(monkeypatch):
    """runtime/nbits_probe.classify names the weakest padding under which a kernel's rows agree; a kernel that
    no padding fixes is reported (a warning naming the way out) and padded as pairs."""
    from retrace.runtime import nbits_probe, row_invariance

    x = torch.arange(24.0).reshape(6, 4).numpy()
    alone = x + 1e-3  # what a one-row kernel computes differently

    def widths(change):  # {M: the first M rows as one M-row call computes them}
        return {m: change(m, x[:m].copy()) for m in range(1, 7)}

    def odd_last(m, y):
        y[-1] = alone[m - 1] if m % 2 else y[-1]
        return y

    def everything(m, y):
        return y + m * 1e-3

    assert nbits_probe.classify(widths(lambda m, y: y)) == "any"
    assert nbits_probe.classify(widths(lambda m, y: alone[:1] if m == 1 else y)) == "two"
    assert nbits_probe.classify(widths(odd_last)) == "pairs"
    assert nbits_probe.classify(widths(everything)) is None
    # the real kernel: float weights need nothing; int4 at block 16 agrees at every width on the CPUs measured
    assert row_invariance.nbits_rule(None, None) == "any"
    assert nbits_probe.probe_rule(64, 4, 16, 4, 1) == "any"
    monkeypatch.setattr(nbits_probe, "probe_rule", lambda *a: None)
    with pytest.warns(RuntimeWarning, match="--weight-block-size 16"):
        assert row_invariance.nbits_rule(256, 4, 4, (64,)) == "pairs"


def test_a_block_32_bundle_is_row_invariant_on_this_cpu(tmp_path):
    """Block 32 agrees at every width on an AVX-512 Xeon and not on an AVX2 EPYC (a one-row call differs):
    the fixed table this probe replaced left such a bundle unpadded there, and no verify row matched its
    decode step. Probed, every row matches on whichever CPU runs this."""
    from helpers import write_target

    target = write_target(tmp_path / "target", vocab=V, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64)
    cli_build(target, None, tmp_path / "b", 2, 32, "--weights", "int4", "--weight-block-size", "32", "--quiet")
    got = rows_matching_decodes(OnnxRuntimeBackend.from_bundle(tmp_path / "b", threads=1, max_batch=2))
    assert got == {w: w for w in got}, got


def test_a_one_row_backend_needs_no_attention_pad_where_the_body_pads(tmp_path):
    """Block 64 needs two rows (AVX2) or pairs (AVX-512) on the CPUs measured, so a backend of one row pads
    every one-token call to two tokens and its attention never takes the one-token path: the in-place graph's
    pad row (200 Slice / Concat nodes at the 0.6B shape, 5% of the int4 decode step) is left out, and every
    verify row still equals its decode step. Wider backends keep it (a batch of one-token rows is not padded)."""
    from helpers import write_target

    target = write_target(tmp_path / "target", vocab=V, hidden=64, layers=1, heads=2, kv_heads=1, intermediate=64)
    cli_build(target, None, tmp_path / "b", 2, 32, "--weights", "int4", "--weight-block-size", "64", "--quiet")
    one = OnnxRuntimeBackend.from_bundle(tmp_path / "b", threads=1, max_batch=1)
    assert one.widths.tokens in ("two", "pairs") and not one.inplace.pad
    got = rows_matching_decodes(one)
    assert got == {w: w for w in got}, got
    two = OnnxRuntimeBackend.from_bundle(tmp_path / "b", threads=1, max_batch=2)
    assert two.inplace.pad and two.widths.tokens == one.widths.tokens
