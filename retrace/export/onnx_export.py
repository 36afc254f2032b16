"""Export the Qwen3 target and the DFlash/ReTrace drafter to ONNX (opset 23, dynamo exporter).

Both graphs are the functional forwards of `retrace.models` with explicit K/V tensors, so ONE graph per
model serves prefill, decode and verify (dynamic batch N, new tokens T, past length P; P = 0 works).

Target graph (see docs/INTERFACES.md for the semantics):
    inputs   input_ids [N,T] i64, position_ids [N,T] i64, past_len [N] i64, logits_index [N,K] i64,
             past_key_{i} / past_value_{i} [N,Hkv,P,hd] (model dtype), i = 0..L-1
             and, only when exported with tree_mask=True (retrace-export build --tree-mask): tree_mask
             [N,T,T] bool, which new tokens each new token attends to (a draft tree's ancestor mask; the
             causal triangle for a chain); graphs without it serve chains only
    outputs  logits [N,K,V] f32, taps [N,T,k*d], new_key_{i} / new_value_{i} [N,Hkv,T,hd]
Drafter graph:
    inputs   ctx_taps [N,C,k*d], ctx_positions [N,C] i64, block_ids [N,B] i64, block_positions [N,B] i64,
             past_len [N] i64, past_key_{i} / past_value_{i} [N,Hkv,P,hd],
             and, only when the drafter has a ReTrace conditioner: memory [N,B,d], features [N,B,F],
             valid [N,B] (model dtype), corr_index [N,B] i64
    outputs  hidden [N,B,d], logits [N,B-1,V] f32, new_key_{i} / new_value_{i} [N,Hkv,C,hd] (context K/V)
The drafter graph carries the target's embedding and LM head (the drafter shares them). With a
conditioner, the gated suffix fusion is ONE `retrace::GatedSuffixFusion` node carrying its ONNX function
body (ONNX Runtime inlines it) and TensorRT's `plugin_namespace`/`plugin_version` attributes; DFlash mode
feeds `valid = 0` (the op is then exactly the identity). A drafter without a conditioner is exported
without the four suffix inputs and without the node: a plain DFlash graph any ONNX runtime can run.

Attention forms (`attention=`): "native" emits one opset-23 `Attention` node per layer and lets the
onnxscript fusions produce `RMSNormalization`/`RotaryEmbedding`; "decomposed" keeps MatMul/Softmax and
elementwise norms (for runtimes without the opset-23 kernels). See benchmarks/onnx_attention.py.

Weights always go to external data (`model.onnx.data` beside `model.onnx`): one layout for every size
(the 2 GB protobuf limit never matters), cheap to hash and to memory-map.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from retrace.errors import RetraceError
from retrace.export import export_cache
from retrace.models import layers
from retrace.models.drafter import DFlashDrafter, SuffixInputs
from retrace.models.target import Qwen3Target

OPSET = 23
ATTENTION_FORMS = ("native", "decomposed")
GRAPH_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# Example sizes for tracing: all different and > 1, so the exporter keeps every dim symbolic.
EXAMPLE = {"N": 2, "T": 3, "P": 5, "K": 2, "C": 6, "B": 4}


class ExportError(RetraceError):
    """An ONNX export or graph check failed (the message says which graph and why)."""


# -- names -----------------------------------------------------------------------------------------------
def kv_names(prefix: str, num_layers: int) -> list[str]:
    """past_key_0, past_value_0, past_key_1, ... (the order of the graphs' K/V inputs and outputs)."""
    return [f"{prefix}_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value")]


def target_io(num_layers: int, tree_mask: bool = False) -> tuple[list[str], list[str]]:
    inputs = ["input_ids", "position_ids", "past_len", "logits_index", *kv_names("past", num_layers)]
    inputs += ["tree_mask"] if tree_mask else []
    outputs = ["logits", "taps", *kv_names("new", num_layers)]
    return inputs, outputs


SUFFIX_INPUTS = ("memory", "features", "valid", "corr_index")


def drafter_io(num_layers: int, suffix: bool) -> tuple[list[str], list[str]]:
    inputs = ["ctx_taps", "ctx_positions", "block_ids", "block_positions", "past_len",
              *kv_names("past", num_layers), *(SUFFIX_INPUTS if suffix else ())]
    outputs = ["hidden", "logits", *kv_names("new", num_layers)]
    return inputs, outputs


# -- flat-signature wrappers (what the exporter traces) ----------------------------------------------------
class TargetGraph(nn.Module):
    def __init__(self, target: Qwen3Target, tree_mask: bool = False):
        super().__init__()
        self.target = target
        self.tree_mask = tree_mask

    def forward(self, input_ids, position_ids, past_len, logits_index, *past):
        mask = None
        if self.tree_mask:  # the last input
            past, mask = past[:-1], past[-1]
        logits, taps, nk, nv = self.target(input_ids, position_ids, list(past[0::2]), list(past[1::2]),
                                           past_len, logits_index, tree_mask=mask)
        return (logits, taps, *[t for kv in zip(nk, nv, strict=True) for t in kv])


class DrafterGraph(nn.Module):
    def __init__(self, drafter: DFlashDrafter, num_layers: int, suffix: bool):
        super().__init__()
        self.drafter = drafter
        # registered here so the shared embedding / LM head keep readable initializer names
        self.shared_target = drafter.target
        self.num_layers = num_layers
        self.suffix = suffix

    def forward(self, ctx_taps, ctx_positions, block_ids, block_positions, past_len, *rest):
        n = 2 * self.num_layers
        past, extra = rest[:n], rest[n:]
        suffix = SuffixInputs(*extra) if self.suffix else None
        hidden, logits, nk, nv = self.drafter(ctx_taps, ctx_positions, list(past[0::2]), list(past[1::2]),
                                              past_len, block_ids, block_positions, suffix)
        return (hidden, logits, *[t for kv in zip(nk, nv, strict=True) for t in kv])


# -- example inputs ------------------------------------------------------------------------------------------
def _kv(n, heads, length, head_dim, layers_, dtype, g):
    return [torch.randn(n, heads, length, head_dim, generator=g).to(dtype) for _ in range(2 * layers_)]


def target_inputs(target: Qwen3Target, N: int, T: int, P: int, K: int | None = None, seed: int = 0,
                  past_len: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Random but valid target inputs: N rows of T new tokens after P past entries (row n sees
    past_len[n] <= P of them), logits at K indices."""
    c = target.config.layers
    dtype = target.lm_head.weight.dtype
    g = torch.Generator().manual_seed(seed)
    K = T if K is None else K
    if past_len is None:
        past_len = torch.tensor([max(P - (i % 2), 0) for i in range(N)], dtype=torch.int64)
    ids = torch.randint(0, target.config.vocab_size, (N, T), generator=g)
    pos = past_len.unsqueeze(1) + torch.arange(T)
    li = torch.stack([torch.randperm(T, generator=g)[:K] if K <= T else torch.randint(0, T, (K,), generator=g)
                      for _ in range(N)])
    return (ids, pos, past_len, li, *_kv(N, c.num_key_value_heads, P, c.head_dim, c.num_hidden_layers, dtype, g))


def drafter_inputs(drafter: DFlashDrafter, N: int, C: int, B: int, P: int, suffix: bool, seed: int = 0,
                   valid_all_zero: bool = False) -> tuple[torch.Tensor, ...]:
    """Random but valid drafter inputs: C new context taps after P cached ones, a block of B, and (when
    `suffix`) memory/features/valid/corr_index as the runtime's suffix memory produces them."""
    cfg = drafter.config
    c = cfg.layers
    d = c.hidden_size
    dtype = drafter.fc.weight.dtype
    g = torch.Generator().manual_seed(seed)
    past_len = torch.tensor([max(P - (i % 2), 0) for i in range(N)], dtype=torch.int64)
    ctx_taps = torch.randn(N, C, cfg.num_taps * d, generator=g).to(dtype)
    ctx_pos = past_len.unsqueeze(1) + torch.arange(C)
    # the anchor sits inside the new context (as after a verify): a few context entries are masked
    anchor = past_len + torch.tensor([max(C - 1 - (i % 3), 0) for i in range(N)])
    block_pos = anchor.unsqueeze(1) + torch.arange(B)
    block_ids = torch.full((N, B), cfg.mask_token_id, dtype=torch.int64)
    block_ids[:, 0] = torch.randint(0, cfg.vocab_size, (N,), generator=g)
    args = [ctx_taps, ctx_pos, block_ids, block_pos, past_len,
            *_kv(N, c.num_key_value_heads, P, c.head_dim, c.num_hidden_layers, dtype, g)]
    if suffix:
        nf = drafter.conditioner.num_features if drafter.conditioner is not None else 3
        valid = (torch.rand(N, B, generator=g) > 0.3).to(dtype)
        valid[:, 0] = 0
        if valid_all_zero:
            valid.zero_()
        memory = torch.randn(N, B, d, generator=g).to(dtype) * valid.unsqueeze(-1)
        features = torch.rand(N, B, nf, generator=g).to(dtype) * valid.unsqueeze(-1)
        corr = torch.randint(0, C, (N, B), generator=g) * valid.long()
        args += [memory, features, valid, corr]
    return tuple(args)


# -- export ----------------------------------------------------------------------------------------------------
@dataclass
class ExportedGraph:
    """What export_* wrote: the graph file (+ external data), its I/O and a node census."""

    name: str
    path: Path
    data_path: Path | None
    inputs: list[str]
    outputs: list[str]
    attention: str
    node_count: int
    op_counts: dict[str, int]
    seconds: float
    custom_nodes: int = 0
    extra: dict = field(default_factory=dict)

    def summary(self) -> dict:
        return {
            "file": self.path.name, "data_file": self.data_path.name if self.data_path else None,
            "inputs": self.inputs, "outputs": self.outputs, "opset": OPSET, "attention": self.attention,
            "nodes": self.node_count, "custom_nodes": self.custom_nodes,
            "ops": dict(sorted(self.op_counts.items(), key=lambda kv: -kv[1])),
        }


@contextlib.contextmanager
def _attention_form(form: str):
    if form not in ATTENTION_FORMS:
        raise ExportError(f"unknown attention form {form!r} (choose from {', '.join(ATTENTION_FORMS)})")
    old = layers.ONNX_ATTENTION
    layers.ONNX_ATTENTION = form
    try:
        yield
    finally:
        layers.ONNX_ATTENTION = old


@contextlib.contextmanager
def _quiet_exporter():
    """The dynamo exporter prints progress lines and warnings meant for its own developers."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "torch.fx",
                                                  "torch._dynamo", "onnxscript", "torch.utils._sympy")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(_Sink()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lv in zip(loggers, levels, strict=True):
            lg.setLevel(lv)


class _Sink:
    def write(self, s):
        return len(s)

    def flush(self):
        pass


def _export(module: nn.Module, args: tuple, names_in: list[str], names_out: list[str], dynamic: dict,
            out_dir: Path, attention: str, name: str, with_function: bool,
            cache_dir: str | Path | None = None) -> ExportedGraph:
    """cache_dir: an export cache (retrace/export/export_cache.py; None: $RETRACE_EXPORT_CACHE, if set)."""
    import onnx

    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    path, data = out_dir / GRAPH_FILE, out_dir / DATA_FILE
    cache = export_cache.cache_dir(cache_dir)
    key = None
    if cache is not None:
        settings = {"names_in": names_in, "names_out": names_out, "dynamic": repr(dynamic), "attention": attention,
                    "name": name, "with_function": with_function, "opset": OPSET}
        key = export_cache.graph_key(module, args, settings)
    if key is None or not export_cache.restore(cache, key, out_dir):
        _trace(module, args, names_in, names_out, dynamic, path, attention, name, with_function)
        if key is not None:
            export_cache.store(cache, key, out_dir, [f for f in (path, data) if f.exists()])
    proto = onnx.load(str(path), load_external_data=False)
    graph = census(proto, name, path, data if data.exists() else None, names_in, names_out, attention)
    graph.seconds = time.perf_counter() - t0
    return graph


def _trace(module: nn.Module, args: tuple, names_in: list[str], names_out: list[str], dynamic: dict, path: Path,
           attention: str, name: str, with_function: bool) -> None:
    """The export proper: trace, optimize, write path (+ its external data), attach the plugin's function."""
    import onnx
    import onnx_ir as ir
    import onnx_ir.passes.common as common_passes
    import onnxscript.optimizer
    import onnxscript.rewriter.onnx_fusions

    try:
        with _attention_form(attention), _quiet_exporter(), torch.no_grad():
            prog = torch.onnx.export(module, args, dynamic_shapes=dynamic, input_names=names_in,
                                     output_names=names_out, dynamo=True, opset_version=OPSET, optimize=False,
                                     verbose=False, report=False, verify=False)
            model = prog.model
            _name_transposed_weights(model)
            # one Transpose per weight even where a layer uses it twice (the drafter's k/v projections)
            common_passes.CommonSubexpressionEliminationPass()(model)
            # constant folding / dead code, then (native form) RMSNormalization + RotaryEmbedding fusions
            onnxscript.optimizer.optimize_ir(model)
            if attention == "native":
                onnxscript.rewriter.onnx_fusions.fuse(model)
                common_passes.CommonSubexpressionEliminationPass()(model)  # per-layer cos/sin caches
                onnxscript.optimizer.optimize_ir(model)
    except RetraceError:
        raise
    except Exception as e:  # noqa: BLE001 - the exporter raises many types; keep the cause attached
        raise ExportError(f"exporting the {name} graph to ONNX failed: {type(e).__name__}: {e}") from e
    # Weights to external data, then reload the (small) graph proto to attach the plugin's function.
    ir.save(model, path, external_data=DATA_FILE, size_threshold_bytes=1024, alignment=4096)
    proto = onnx.load(str(path), load_external_data=False)
    if with_function:
        from retrace.plugins.onnx_function import attach_function

        attach_function(proto)
    proto.producer_name = "retrace-export"
    _strip_metadata(proto)
    onnx.save(proto, str(path))


def _name_transposed_weights(model) -> None:
    """Linear layers export as MatMul(x, Transpose(W)); constant folding turns Transpose(W) into a new
    initializer named after its output (val_123). Name those outputs `<weight>.T` first, so every weight
    in the bundle keeps a readable name (for debugging, TensorRT refit, weight sharing)."""
    taken = {v.name for v in model.graph.initializers.values()}
    for node in model.graph:
        if node.op_type != "Transpose" or not node.inputs or node.inputs[0] is None:
            continue
        src = node.inputs[0]
        if not src.is_initializer():
            continue
        name = f"{src.name}.T"
        if name not in taken:
            node.outputs[0].name = name
            taken.add(name)


def _strip_metadata(proto) -> None:
    """Drop the exporter's per-node debug metadata (stack traces with this machine's file paths, FX node
    dumps): most of the graph file's size, and it would make a bundle differ between build machines."""
    for node in proto.graph.node:
        del node.metadata_props[:]
        node.doc_string = ""
    del proto.graph.metadata_props[:]


def census(proto, name: str, path: Path, data: Path | None, names_in, names_out, attention) -> ExportedGraph:
    from retrace.plugins.onnx_function import fusion_nodes

    ops = Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}" for n in proto.graph.node)
    return ExportedGraph(name, path, data, list(names_in), list(names_out), attention, len(proto.graph.node),
                         dict(ops), 0.0, custom_nodes=len(fusion_nodes(proto)))


def export_target(target: Qwen3Target, out_dir: str | Path, attention: str = "native",
                  tree_mask: bool = False, cache_dir: str | Path | None = None) -> ExportedGraph:
    """Write `out_dir/model.onnx` (+ `model.onnx.data`) for the target with its tap layers (tree_mask: with
    the optional tree_mask input of tree verification; cache_dir: the export cache, `_export`)."""
    if not target.tap_layers:
        raise ExportError("the target has no tap layers: load it with the drafter's target_layer_ids "
                          "(retrace.models.drafter.load_pair)")
    L = target.config.num_hidden_layers
    e = EXAMPLE
    args = target_inputs(target, e["N"], e["T"], e["P"], e["K"])
    N, T, K = (torch.export.Dim(n, min=1) for n in ("N", "T", "K"))
    P = torch.export.Dim("P", min=0)
    past = [{0: N, 2: P} for _ in range(2 * L)]
    if tree_mask:
        args = (*args, causal_mask(args[0].shape[0], args[0].shape[1]))
        past.append({0: N, 1: T, 2: T})
    dynamic = {"input_ids": {0: N, 1: T}, "position_ids": {0: N, 1: T}, "past_len": {0: N},
               "logits_index": {0: N, 1: K}, "past": tuple(past)}
    names_in, names_out = target_io(L, tree_mask)
    return _export(TargetGraph(target, tree_mask), args, names_in, names_out, dynamic, Path(out_dir), attention,
                   "target", with_function=False, cache_dir=cache_dir)


def causal_mask(n: int, t: int) -> torch.Tensor:
    """The tree_mask input of a chain: [n, t, t] bool lower triangle."""
    return torch.ones(t, t, dtype=torch.bool).tril().expand(n, t, t).contiguous()


def export_drafter(drafter: DFlashDrafter, out_dir: str | Path, attention: str = "native",
                   cache_dir: str | Path | None = None) -> ExportedGraph:
    """Write `out_dir/model.onnx` (+ data) for the drafter (with the target's embedding and LM head, and
    the GatedSuffixFusion node when it has a conditioner; cache_dir: the export cache, `_export`)."""
    L = drafter.config.layers.num_hidden_layers
    suffix = drafter.conditioner is not None
    e = EXAMPLE
    args = drafter_inputs(drafter, e["N"], e["C"], e["B"], e["P"], suffix)
    N, C, B = (torch.export.Dim(n, min=1) for n in ("N", "C", "B"))
    P = torch.export.Dim("P", min=0)
    dynamic = {"ctx_taps": {0: N, 1: C}, "ctx_positions": {0: N, 1: C}, "block_ids": {0: N, 1: B},
               "block_positions": {0: N, 1: B}, "past_len": {0: N}}
    rest = [{0: N, 2: P} for _ in range(2 * L)]
    if suffix:
        rest += [{0: N, 1: B}] * 4
    dynamic["rest"] = tuple(rest)
    names_in, names_out = drafter_io(L, suffix)
    return _export(DrafterGraph(drafter, L, suffix), args, names_in, names_out, dynamic, Path(out_dir), attention,
                   "drafter", with_function=suffix, cache_dir=cache_dir)


def check_graph(path: str | Path, name: str, expect_fusion_nodes: int | None = None) -> None:
    """onnx.checker (with external data) plus the structure the runtimes rely on."""
    import onnx

    from retrace.plugins.onnx_function import PLUGIN_NAMESPACE, PLUGIN_VERSION, fusion_nodes

    try:
        onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{name} graph {path} fails onnx.checker: {e}") from None
    if expect_fusion_nodes is None:
        return
    proto = onnx.load(str(path), load_external_data=False)
    nodes = fusion_nodes(proto)
    if len(nodes) != expect_fusion_nodes:
        raise ExportError(f"{name} graph has {len(nodes)} retrace::GatedSuffixFusion nodes, expected "
                          f"{expect_fusion_nodes}")
    for nd in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nd.attribute}
        if attrs.get("plugin_namespace") != PLUGIN_NAMESPACE.encode() or \
                attrs.get("plugin_version") != PLUGIN_VERSION.encode():
            raise ExportError(f"{name} graph: GatedSuffixFusion node {nd.name!r} lacks the TensorRT plugin "
                              f"attributes (plugin_namespace={PLUGIN_NAMESPACE!r}, plugin_version={PLUGIN_VERSION!r})")
    if expect_fusion_nodes and not any(f.name == "GatedSuffixFusion" for f in proto.functions):
        raise ExportError(f"{name} graph has no FunctionProto for retrace::GatedSuffixFusion")
