"""Weight-only int4 / int8 bundles: the exported graphs' linear layers as ONNX Runtime MatMulNBits (and
w8a8 bundles: integer matmuls with per-row int8 activations, retrace.export.w8a8).

`retrace-export build --weights int4|int8` runs this after the fp32 graphs passed their parity check
against torch. ONNX Runtime's own quantizer (`onnxruntime.quantization.matmul_nbits_quantizer`, round-to-
nearest, symmetric blocks of `block_size` along K, the scales in the graph's float type) replaces every
MatMul whose B operand is a constant 2-D initializer by a `com.microsoft.MatMulNBits` node. Activations
stay float; `accuracy_level` 4 lets the CPU kernel quantize them to int8 per block on the fly
(VNNI / AMX integer dot products: the fastest CPU form, what onnxruntime-genai's builder uses).

The LM head is exported as the A operand of its MatMul (retrace.models.layers.lm_head), which the
quantizer does not touch; `quantize_lm_head` first turns it into MatMul(rows, W^T) so that it is
quantized too: at the Qwen3-0.6B shape the [151936, 1024] head is a quarter of a decode step's weight
bytes. The tied embedding table stays float (its Gather reads only the rows of the step's tokens from the
memory-mapped data file, so quantizing it saves disk, not resident memory or time). The drafter's copy of
the head quantizes to the same bytes as the target's (`shared_target.<name>.T_Q4` beside `target.<name>
.T_Q4`), so retrace.runtime.shared_weights still maps one copy for both sessions and, for a large head,
retrace.runtime.lm_head_split runs it in one session of its own (retrace.runtime.lm_head_nbits).
The drafter's GatedSuffixFusion node is inlined first (retrace.export.inline_fusion: ONNX Runtime, the only
backend of a quantized bundle, inlines it at load anyway), so its three linear layers are quantized too.
Then retrace.export.nbits_fusions merges the parallel MatMulNBits (q/k/v, gate/up) and fuses each residual
Add + RMSNormalization into ONNX Runtime's SkipSimplifiedLayerNormalization (`fuse=False`: without them).

`--drafter-weights` quantizes the drafter at a precision of its own (its kind's default block and accuracy
level; `fp32` keeps it float beside a quantized target): a draft only proposes, so its numerics move
acceptance and the draft call's cost, never the output. Its head is then its own packed copy (the target's
is at another precision), of which the runtime reads only the draft vocabulary's rows. The manifest's
`quantization` section describes the target (and the drafter when both share one precision),
`drafter_quantization` a drafter at its own.

`agreement` measures the quantized graph against the fp32 model on held-out random prompts (top-1
agreement and max |logit error|): recorded in the manifest as information, not a gate. Speculative
decoding stays exact relative to the quantized target itself (its own greedy decode), which is what the
runtime's tests check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from retrace.errors import RetraceError
from retrace.export.inline_fusion import inline_gated_suffix_fusion
from retrace.export.nbits_fusions import fuse_quantized

WEIGHTS = ("fp32", "int8", "int4", "w8a8")
BITS = {"int4": 4, "int8": 8, "w8a8": 8}
# int4: block 256 of K, the step onnxruntime-genai is fastest at (issue 25): ours at 256 costs 0.77x the CPU of
# ours at 128 and is no slower than its 256, with no measurable loss of top-1 agreement with fp32 on the trained
# zoo (90.8% at 256, 90.0% at 128, 91.1% at 32; docs/quantization.md). int8: 128 (not measured). Block 32 would
# be row-invariant without padding (retrace.runtime.row_invariance) but its decode step measured 1.7x block 256's
# at the Qwen3-0.6B shape. The LM head takes the same block unless --head-block-size says otherwise.
DEFAULT_BLOCK = {"int4": 256, "int8": 128}
DEFAULT_ACCURACY_LEVEL = 4  # int8 activations in the CPU kernel (MatMulNBits accuracy_level)
ACCURACY_LEVELS = (0, 1, 2, 3, 4)
HEAD_NODE = "lm_head_matmul"  # the LM head's MatMul after quantize_lm_head


class QuantizeError(RetraceError):
    """Bad quantization options or a graph the quantizer cannot handle."""


@dataclass(frozen=True)
class WeightQuant:
    """What --weights / --weight-block-size / --accuracy-level asked for (fp32: nothing to do)."""

    weights: str = "fp32"
    block_size: int | None = None
    accuracy_level: int | None = None
    head_block_size: int | None = None  # the LM head's block (default: block_size's)
    lm_head: bool = True
    fuse: bool = True  # retrace.export.nbits_fusions after quantizing

    def __post_init__(self):
        if self.weights not in WEIGHTS:
            raise QuantizeError(f"unknown --weights {self.weights!r} (choose from {', '.join(WEIGHTS)})")
        if self.weights in ("fp32", "w8a8"):
            if (self.block_size, self.accuracy_level, self.head_block_size) != (None, None, None):
                raise QuantizeError("--weight-block-size, --head-block-size and --accuracy-level need --weights "
                                    f"int4 or int8 (not {self.weights}: no blocks, integer matmuls)")
            return
        for option, b in (("--weight-block-size", self.block), ("--head-block-size", self.head_block)):
            if b < 16 or b & (b - 1):
                raise QuantizeError(f"{option} must be a power of two >= 16, got {b}")
        if self.level not in ACCURACY_LEVELS:
            raise QuantizeError(f"--accuracy-level must be one of {ACCURACY_LEVELS}, got {self.level}")

    @property
    def quantized(self) -> bool:
        return self.weights != "fp32"

    @property
    def bits(self) -> int:
        return BITS[self.weights]

    @property
    def block(self) -> int:
        return self.block_size if self.block_size is not None else DEFAULT_BLOCK.get(self.weights, 0)

    @property
    def head_block(self) -> int:
        return self.head_block_size if self.head_block_size is not None else self.block

    @property
    def level(self) -> int:
        return DEFAULT_ACCURACY_LEVEL if self.accuracy_level is None else self.accuracy_level

    @property
    def row_scaled(self) -> bool:
        """w8a8: per-row int8 activations and per-column int8 weights, integer matmuls (retrace.export.w8a8)."""
        return self.weights == "w8a8"

    def manifest(self) -> dict:
        if self.row_scaled:
            return {"weights": self.weights, "bits": 8, "activations": "int8, symmetric per row, dynamic",
                    "symmetric": True, "lm_head": self.lm_head, "fused": self.fuse,
                    "quantizer": "retrace.export.w8a8 (per output column, round to nearest; MatMulInteger)"}
        return {"weights": self.weights, "bits": self.bits, "block_size": self.block,
                "lm_head_block_size": self.head_block if self.lm_head else None,
                "accuracy_level": self.level, "symmetric": True, "lm_head": self.lm_head, "fused": self.fuse,
                "quantizer": "onnxruntime.quantization.matmul_nbits_quantizer (DEFAULT, RTN)"}


def quantize_lm_head(model, base_dir: Path) -> str | None:
    """Rewrite the exported LM head of `model` (loaded without its external data; changed in place, its
    data loaded from `base_dir` on return) as MatMul(rows, W^T), W^T a new initializer `<W>.T`, so the
    quantizer takes it; returns W's name, or None without that head. The rewrite works on the graph alone: a
    model with its weights can pass protobuf's 2 GiB limit (the Qwen3-0.6B-shape target does)."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_model

    from retrace.runtime.graph_prune import prune
    from retrace.runtime.lm_head_split import rewrite_head

    head = rewrite_head(Path(), cut=False, model=model)  # Gemm(rows, W, transB=1) -> Reshape -> logits
    if head.weight:
        model.CopyFrom(onnx.ModelProto.FromString(head.model))
    load_external_data_for_model(model, str(base_dir))
    if not head.weight:
        return None
    g = model.graph
    gemm = next(n for n in g.node if n.op_type == "Gemm" and n.name == "lm_head_gemm")
    w = next(i for i in g.initializer if i.name == head.weight)
    wt = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(w).T), head.weight + ".T")
    g.initializer.append(wt)
    at = list(g.node).index(gemm)
    g.node.remove(gemm)
    g.node.insert(at,
                  onnx.helper.make_node("MatMul", [gemm.input[0], wt.name], list(gemm.output), name=HEAD_NODE))
    prune(g)
    return head.weight


def quantize_graph(path: Path, q: WeightQuant, lm_head: bool = True) -> dict:
    """Quantize the graph at `path` (+ its external data) in place; returns its manifest record. lm_head:
    this graph's LM head too (where q says so; a w8a8 drafter keeps its float head, which the runtime cuts
    off and slices to the draft vocabulary)."""
    import onnx

    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    if q.lm_head and lm_head:
        head = quantize_lm_head(model, path.parent)  # loads the weights too: the quantizer reads them
    else:
        from onnx.external_data_helper import load_external_data_for_model

        head = None
        load_external_data_for_model(model, str(path.parent))
    inlined = inline_gated_suffix_fusion(model)  # the drafter's fusion: its three layers quantized too
    before = {n.name for n in model.graph.node if n.op_type == "MatMul"}
    if q.row_scaled:
        from retrace.export.w8a8 import convert

        out, nodes = model, sorted(convert(model))  # q/k/v and gate/up merged by convert itself
        left = sorted(before - set(nodes))
        fusions = fuse_quantized(out) if q.fuse and nodes else {}  # residual + RMSNorm (no MatMulNBits here)
    else:
        out, nodes, left, fusions = _matmul_nbits(model, q, head is not None, before)
    if not nodes:
        raise QuantizeError(f"{path}: the quantizer found no MatMul with a constant weight to quantize")
    data = path.with_name(path.name + ".data")
    tmp = path.with_name(path.name + ".quantizing")
    _save(out, tmp, data.name + ".quantizing")
    # the new data file first, then the graph naming it (nothing half-written under the final names)
    os.chmod(data.with_name(data.name + ".quantizing"), path.stat().st_mode & 0o777)  # onnx writes it 0600
    os.replace(data.with_name(data.name + ".quantizing"), data)
    relocate_external(tmp, data.name)
    os.replace(tmp, path)
    return {"nodes": nodes, "float_matmuls": left, "lm_head": f"{head}.T" if head else None,
            "fusions": fusions, "inlined_fusion_matmuls": inlined, "data_bytes": data.stat().st_size}


def _matmul_nbits(model, q: WeightQuant, head: bool, before: set[str]):
    """ONNX Runtime's MatMulNBits quantizer over `model` (the LM head at its own block where it differs), then
    the fusions -> (model, MatMulNBits nodes, MatMuls left float, fusions)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        MatMulNBitsQuantizer,
    )

    def run(m, block: int, **which):
        config = DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=True, accuracy_level=q.level,
                                              bits=q.bits)
        quantizer = MatMulNBitsQuantizer(m, bits=q.bits, block_size=block, is_symmetric=True,
                                         accuracy_level=q.level, algo_config=config, **which)
        quantizer.process()
        return quantizer.model.model

    split = head and q.head_block != q.block
    if split:  # the head at its own block first, then every other linear layer
        model = run(model, q.head_block, nodes_to_exclude=sorted(before - {HEAD_NODE}))
    out = run(model, q.block, nodes_to_exclude=[HEAD_NODE] if split else None)
    nodes = sorted(n.name for n in out.graph.node if n.op_type == "MatMulNBits")
    if not nodes:
        return out, [], [], {}
    left = sorted(before - {n[: -len(f"_Q{q.bits}")] for n in nodes})
    fusions = fuse_quantized(out) if q.fuse else {}
    return out, sorted(n.name for n in out.graph.node if n.op_type == "MatMulNBits"), left, fusions


def _save(model, path: Path, location: str) -> None:
    """Save with every float / uint8 weight in the external data file `location` (shared tensors must be
    external to be mapped, however small; int64 shape constants stay inline, where shape inference reads
    them)."""
    import onnx
    from onnx.external_data_helper import set_external_data

    for t in model.graph.initializer:
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.UINT8) and t.raw_data:
            set_external_data(t, location)
    onnx.save_model(model, str(path))


def relocate_external(graph: Path, location: str) -> None:
    """Point every external tensor of the (external-data) graph file at `location`."""
    import onnx

    m = onnx.load(str(graph), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save_model(m, str(graph))


@torch.no_grad()
def agreement(target, path: Path, prompts: int = 4, length: int = 32, seed: int = 1234,
              vocab: int | None = None) -> dict:
    """The quantized target graph at `path` against the fp32 torch target on `prompts` held-out random
    prompts of `length` tokens (logits at every position): top-1 agreement and max |logit error|.
    vocab: draw the prompts' ids below it (a model whose tokenizer uses only the first ids)."""
    from retrace.export.onnx_export import causal_mask, target_inputs, target_io
    from retrace.export.onnx_parity import session

    sess = session(path)
    L = target.config.num_hidden_layers
    tree = "tree_mask" in {i.name for i in sess.get_inputs()}
    names_in = target_io(L, tree)[0]
    length = max(1, min(length, target.config.max_position_embeddings))
    args = target_inputs(target, prompts, length, 0, length, seed=seed)
    if vocab is not None:
        args = (args[0] % vocab, *args[1:])
    if tree:
        args = (*args, causal_mask(prompts, length))
    past = args[4:4 + 2 * L]
    ref = target(args[0], args[1], list(past[0::2]), list(past[1::2]), args[2], args[3])[0].float()
    got = torch.from_numpy(sess.run(["logits"], {n: a.numpy() for n, a in zip(names_in, args, strict=True)})[0]).float()
    return {"prompts": prompts, "tokens": prompts * length,
            "top1_agreement": round(float((got.argmax(-1) == ref.argmax(-1)).float().mean()), 4),
            "max_logit_error": round(float((got - ref).abs().max()), 4),
            "max_abs_logit": round(float(ref.abs().max()), 4)}


def quantize_bundle(graphs: dict, target, q: WeightQuant, note=None) -> dict:
    """Quantize the exported graphs `graphs` (name -> onnx_export.ExportedGraph, their census updated) at
    `q` and measure the target's agreement with the fp32 model, when the target is one of them: the
    manifest's `quantization` section (or `drafter_quantization`: a drafter at its own --drafter-weights)."""
    import collections
    import logging

    import onnx

    record = q.manifest() | {"graphs": {}}
    quant_log = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    level = quant_log.level
    quant_log.setLevel(logging.WARNING)  # it logs every node it visits at INFO
    try:
        for name, g in graphs.items():
            # a w8a8 drafter keeps its float head (cut off and sliced to the draft vocabulary at load)
            record["graphs"][name] = quantize_graph(g.path, q, lm_head=not (q.row_scaled and name == "drafter"))
            ops = collections.Counter(n.op_type for n in onnx.load(str(g.path), load_external_data=False).graph.node)
            g.op_counts, g.node_count = dict(ops), sum(ops.values())
            g.custom_nodes = ops.get("GatedSuffixFusion", 0)
            if note:
                note(f"{name}: {len(record['graphs'][name]['nodes'])} "
                     f"{'MatMulInteger' if q.row_scaled else 'MatMulNBits'}, "
                     f"{record['graphs'][name]['data_bytes'] / 2**20:.1f} MiB of weights")
    finally:
        quant_log.setLevel(level)
    if "target" not in graphs:  # a drafter at its own precision: its numerics only move acceptance
        return record
    record["agreement_with_fp32"] = agreement(target, graphs["target"].path)
    if note:
        a = record["agreement_with_fp32"]
        note(f"vs fp32 on {a['tokens']} held-out tokens: top-1 agreement {a['top1_agreement']:.1%}, "
             f"max |logit error| {a['max_logit_error']:.3g} (information, not a gate)")
    return record
