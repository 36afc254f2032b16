"""Build TensorRT plans from a bundle's ONNX graphs (target and drafter).

Bundle layout read here (file names are parameters): `manifest.json` with
`limits: {max_batch, max_seq_len, block_size}`, `target/model.onnx`, `drafter/model.onnx`.
Written to `out/`: `target.plan`, `drafter.plan` (each written atomically) and `tensorrt.json`
(limits, dtype, TensorRT version, the resolved optimisation profiles and the I/O name tables, which is
everything `retrace.runtime.tensorrt_backend` needs to bind the engines).

Every graph gets three optimisation profiles, in this order (the runtime picks the nearest that fits):

    prefill  T = 1..max_prompt_len new tokens, no past (P = 0)
    verify   T = 1..block_size,                P = 0..max_seq_len
    decode   T = 1,                            P = 0..max_seq_len

(P's opt is max_seq_len: the backend binds a slot range's whole cache, no prefix copy). For the drafter,
T is C, the new context tokens whose K/V it projects (its block is always B), and its verify profile
takes C up to max_seq_len: after rounds without a drafter call (the adaptive verify policy, prompt
lookup) the next call carries every round's taps since the last one, and a request admitted into a
running batch brings its whole prompt as context next to rows with a past.

The ONNX parser must know the graphs' opset-23 ops (`PARSER_OPS`: Attention since TensorRT 10.14,
RMSNormalization and RotaryEmbedding since 10.15, per onnx-tensorrt's changelog); `check_parser` refuses
an older TensorRT with the flag that avoids them (`--attention decomposed`).

GatedSuffixFusion nodes are handled by `plugin=`:
    "aot"   (default) each node becomes GatedSuffixRefine + GatedSuffixFuse, the two AOT plugins of
            `retrace.plugins.tensorrt_plugin` (PTX in the plan, no Python needed to run it);
    "jit"   the node stays and maps to the whole-op plugin, run by Python at engine run time;
    "none"  no plugin: TensorRT (>= 10.0) imports the node's ONNX function body as standard layers.
For "aot"/"jit" the model-local function is removed before parsing (parsers before 10.7 always
prefer a local function over a plugin).

Only `build_tensorrt` needs TensorRT; everything else here is pure and tested without it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import onnx
from onnx import ModelProto, helper

from retrace.errors import RetraceError
from retrace.plugins import onnx_function as of
from retrace.plugins.errors import require_tensorrt, tensorrt_version

# ---- name tables: the exporter and this builder must agree on these ----------------------------------
# input name (template "{i}" = layer index) -> symbolic dims. N batch, T new tokens, P past length,
# K logits rows, C new context tokens, B block size; Hkv, hd, kd (= taps * hidden), d, F are model dims
# read from the ONNX graph.
TARGET_INPUTS: dict[str, tuple[str, ...]] = {
    "input_ids": ("N", "T"),
    "position_ids": ("N", "T"),
    "past_len": ("N",),
    "logits_index": ("N", "K"),
    "past_key_{i}": ("N", "Hkv", "P", "hd"),
    "past_value_{i}": ("N", "Hkv", "P", "hd"),
}
DRAFTER_INPUTS: dict[str, tuple[str, ...]] = {
    "ctx_taps": ("N", "C", "kd"),
    "ctx_positions": ("N", "C"),
    "block_ids": ("N", "B"),
    "block_positions": ("N", "B"),
    "past_len": ("N",),
    "past_key_{i}": ("N", "Hkv", "P", "hd"),
    "past_value_{i}": ("N", "Hkv", "P", "hd"),
    "memory": ("N", "B", "d"),
    "features": ("N", "B", "F"),
    "valid": ("N", "B"),
    "corr_index": ("N", "B"),
}
# output role -> name (template) in the ONNX graphs
TARGET_OUTPUTS = {"logits": "logits", "taps": "taps", "new_key": "new_key_{i}", "new_value": "new_value_{i}"}
DRAFTER_OUTPUTS = {"hidden": "hidden", "logits": "logits", "new_key": "new_key_{i}", "new_value": "new_value_{i}"}
GRAPH_INPUTS = {"target": TARGET_INPUTS, "drafter": DRAFTER_INPUTS}
GRAPH_OUTPUTS = {"target": TARGET_OUTPUTS, "drafter": DRAFTER_OUTPUTS}
GRAPHS = ("target", "drafter")
PROFILES = ("prefill", "verify", "decode")
MODEL_DIMS = ("Hkv", "hd", "kd", "d", "F")
DEFAULT_FILES = {"target": "target/model.onnx", "drafter": "drafter/model.onnx"}
PLAN_FILES = {"target": "target.plan", "drafter": "drafter.plan"}
ENGINE_MANIFEST = "tensorrt.json"
PLUGIN_MODES = ("aot", "jit", "none")
DTYPES = ("auto", "fp32", "fp16", "bf16")

# opset-23 ops of the "native" attention form -> the first TensorRT whose ONNX parser imports them
PARSER_OPS = {"Attention": (10, 14), "RMSNormalization": (10, 15), "RotaryEmbedding": (10, 15)}
NATIVE_MIN_TENSORRT = max(PARSER_OPS.values())

Range = tuple[int, int, int]
Shape3 = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def symbol_ranges(graph: str, profile: str, max_batch: int, max_seq_len: int, block_size: int,
                  max_prompt_len: int) -> dict[str, Range]:
    """(min, opt, max) of every dynamic symbol of `graph` in `profile`."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r} (expected one of {PROFILES})")
    n = (1, max(1, max_batch // 2), max_batch)
    past = (0, max_seq_len, max_seq_len)
    new = {"prefill": (1, max(1, max_prompt_len // 2), max_prompt_len),
           "verify": (1, block_size, block_size if graph == "target" else max_seq_len),
           "decode": (1, 1, 1)}[profile]
    r = {"N": n, "P": (0, 0, 0) if profile == "prefill" else past}
    if graph == "target":
        r["T"] = new
        r["K"] = (1, block_size, block_size) if profile == "verify" else (1, 1, 1)
    elif graph == "drafter":
        r["C"] = new
        r["B"] = (2, block_size, block_size)  # the adaptive draft width drafts narrower blocks (runtime/draft_width.py)
    else:
        raise ValueError(f"unknown graph {graph!r} (expected one of {GRAPHS})")
    return r


def _check_limits(max_batch: int, max_seq_len: int, block_size: int, max_prompt_len: int) -> None:
    if max_batch < 1 or block_size < 2 or max_seq_len < block_size or not 1 <= max_prompt_len <= max_seq_len:
        raise RetraceError(
            f"invalid TensorRT limits: max_batch={max_batch} (>= 1), block_size={block_size} (>= 2), "
            f"max_seq_len={max_seq_len} (>= block_size), max_prompt_len={max_prompt_len} (1..max_seq_len)")


def optimisation_profiles(max_batch: int, max_seq_len: int, block_size: int, max_prompt_len: int | None = None,
                          dims: dict[str, dict[str, int]] | None = None) -> dict[str, dict[str, dict[str, Shape3]]]:
    """dict[graph][profile] -> {input_name: (min_shape, opt_shape, max_shape)}.

    Model dims (Hkv, hd, kd, d, F) are -1 unless `dims[graph]` gives them; per-layer inputs stay
    templates ("past_key_{i}") unless `dims[graph]["layers"]` is given, then they are expanded.
    `max_prompt_len` defaults to max_seq_len."""
    max_prompt_len = max_seq_len if max_prompt_len is None else max_prompt_len
    _check_limits(max_batch, max_seq_len, block_size, max_prompt_len)
    out: dict[str, dict[str, dict[str, Shape3]]] = {}
    for graph, table in GRAPH_INPUTS.items():
        gdims = (dims or {}).get(graph, {})
        out[graph] = {}
        for profile in PROFILES:
            ranges = symbol_ranges(graph, profile, max_batch, max_seq_len, block_size, max_prompt_len)
            entries: dict[str, Shape3] = {}
            for name, syms in table.items():
                shape = tuple(tuple(ranges[s][j] if s in ranges else int(gdims.get(s, -1)) for s in syms)
                              for j in range(3))
                names = [name]
                if "{i}" in name and "layers" in gdims:
                    names = [name.format(i=i) for i in range(int(gdims["layers"]))]
                for nm in names:
                    entries[nm] = shape  # type: ignore[assignment]
            out[graph][profile] = entries
    return out


def _template_regex(name: str) -> re.Pattern:
    return re.compile("^" + re.escape(name).replace(re.escape("{i}"), r"(\d+)") + "$")


def lookup(table: dict, name: str):
    """table[name], where table keys may be templates with "{i}"; KeyError if nothing matches."""
    if name in table:
        return table[name]
    for key, value in table.items():
        if "{i}" in key and _template_regex(key).match(name):
            return value
    raise KeyError(name)


def onnx_input_shapes(model: ModelProto) -> dict[str, list[int | None]]:
    """Graph inputs (initializers excluded) -> dims, None where the dim is symbolic."""
    inits = {i.name for i in model.graph.initializer}
    shapes = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return shapes


def resolve_profile(entries: dict[str, Shape3], input_shapes: dict[str, list[int | None]], where: str = "") \
        -> dict[str, Shape3]:
    """Concrete (min, opt, max) for every input of a graph: model dims (-1 in the table) are taken from
    the graph; a static graph dim must equal the table's; every graph input must be in the table."""
    resolved = {}
    for name, dims in input_shapes.items():
        try:
            entry = lookup(entries, name)
        except KeyError:
            raise RetraceError(f"{where}: graph input {name!r} has no optimisation-profile entry; known inputs: "
                               f"{sorted(entries)} (see retrace.export.tensorrt name tables)") from None
        if len(entry[0]) != len(dims):
            raise RetraceError(f"{where}: input {name!r} has rank {len(dims)} in the graph but {len(entry[0])} "
                               f"in the profile table")
        shapes = [list(s) for s in entry]
        for axis, static in enumerate(dims):
            for s in shapes:
                if s[axis] < 0:
                    if static is None:
                        raise RetraceError(f"{where}: input {name!r} axis {axis} is dynamic in the graph and has no "
                                           f"range (pass model dims)")
                    s[axis] = static
                elif static is not None and s[axis] != static:
                    raise RetraceError(f"{where}: input {name!r} axis {axis} is fixed to {static} in the graph, but "
                                       f"the profile needs {entry[0][axis]}..{entry[2][axis]}; export it dynamic")
        resolved[name] = tuple(tuple(s) for s in shapes)
    return resolved  # type: ignore[return-value]


# ---- graph preparation ---------------------------------------------------------------------------------

REFINE_OP = "GatedSuffixRefine"
FUSE_OP = "GatedSuffixFuse"


def split_fusion_nodes(model: ModelProto) -> int:
    """Replace every retrace::GatedSuffixFusion node by GatedSuffixRefine + GatedSuffixFuse (the AOT
    plugin pair, `aot=1`), in place. Returns the number of nodes split."""
    new_nodes, count = [], 0
    for node in model.graph.node:
        if not (node.op_type == of.OP_NAME and node.domain == of.OP_DOMAIN):
            new_nodes.append(node)
            continue
        count += 1
        x, memory, correction, features, valid, w_refine, w_gate, b_gate, norm_weight, w_value = node.input
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        eps = float(attrs.get("epsilon", of.DEFAULT_EPSILON))
        base = node.name or f"gsf{count}"
        refined = f"{base}/refined"
        plugin = {"plugin_namespace": of.PLUGIN_NAMESPACE, "plugin_version": of.PLUGIN_VERSION, "aot": 1}
        new_nodes.append(helper.make_node(REFINE_OP, [memory, correction, w_refine], [refined],
                                          name=f"{base}/refine", domain=of.OP_DOMAIN, **plugin))
        new_nodes.append(helper.make_node(FUSE_OP, [x, refined, features, valid, w_gate, b_gate, norm_weight, w_value],
                                          list(node.output), name=f"{base}/fuse", domain=of.OP_DOMAIN,
                                          epsilon=eps, **plugin))
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return count


def prepare_for_tensorrt(model: ModelProto, plugin: str = "aot") -> ModelProto:
    """Rewrite `model` in place for TensorRT's ONNX parser according to the plugin mode."""
    if plugin not in PLUGIN_MODES:
        raise ValueError(f"plugin must be one of {PLUGIN_MODES}, got {plugin!r}")
    if plugin == "none" or not of.fusion_nodes(model):
        return model
    if plugin == "aot":
        split_fusion_nodes(model)
    else:
        for node in of.fusion_nodes(model):
            keep = [a for a in node.attribute if a.name != "aot"]
            del node.attribute[:]
            node.attribute.extend(keep)
    return of.detach_function(model)


# ---- the parser's version -------------------------------------------------------------------------------


def parser_ops(model: ModelProto) -> dict[str, tuple[int, int]]:
    """The graph's standard-domain ops that need a recent ONNX parser -> the TensorRT version they need."""
    return {n.op_type: PARSER_OPS[n.op_type] for n in model.graph.node
            if n.domain in ("", "ai.onnx") and n.op_type in PARSER_OPS}


def check_parser(version: tuple[int, int], needs: dict[str, tuple[int, int]], where: str = "") -> None:
    """RetraceError naming `--attention decomposed` when TensorRT `version` cannot parse an op in `needs`."""
    missing = {op: v for op, v in needs.items() if version < v}
    if not missing:
        return
    have = ".".join(map(str, version))
    ops = ", ".join(f"{op} (TensorRT >= {'.'.join(map(str, v))})" for op, v in sorted(missing.items()))
    raise RetraceError(f"{where}TensorRT {have}'s ONNX parser cannot import the opset-23 {ops}: rebuild the bundle "
                       "with `retrace-export build --backend tensorrt --attention decomposed`, or install "
                       f"tensorrt>={'.'.join(map(str, max(missing.values())))}")


def check_attention_form(trt, attention: str) -> None:
    """Before exporting: the "native" form needs TensorRT >= NATIVE_MIN_TENSORRT's parser."""
    if attention == "native":
        check_parser(tensorrt_version(trt), PARSER_OPS, "--attention native: ")


# ---- build ---------------------------------------------------------------------------------------------


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def read_limits(bundle_dir: Path, manifest_name: str = "manifest.json") -> dict:
    path = bundle_dir / manifest_name
    if not path.is_file():
        return {}
    try:
        limits = json.loads(path.read_text()).get("limits", {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise RetraceError(f"{path}: not a valid bundle manifest ({e})") from None
    return {k: int(v) for k, v in limits.items() if k in ("max_batch", "max_seq_len", "block_size", "max_prompt_len")}


def plan_graphs(bundle_dir: str | Path, max_batch: int | None = None, max_seq_len: int | None = None,
                block_size: int | None = None, *, max_prompt_len: int | None = None, files: dict | None = None,
                plugin: str = "aot", manifest_name: str = "manifest.json") -> dict:
    """Everything `build_tensorrt` decides before TensorRT is involved: limits, prepared ONNX models and
    resolved profiles per graph. Pure (no TensorRT), so it is tested without it."""
    bundle = Path(bundle_dir)
    limits = read_limits(bundle, manifest_name)
    given = {"max_batch": max_batch, "max_seq_len": max_seq_len, "block_size": block_size,
             "max_prompt_len": max_prompt_len}
    limits.update({k: v for k, v in given.items() if v is not None})
    missing = [k for k in ("max_batch", "max_seq_len", "block_size") if k not in limits]
    if missing:
        raise RetraceError(f"{bundle}: no {', '.join(missing)} given and none in {manifest_name} 'limits'")
    limits.setdefault("max_prompt_len", limits["max_seq_len"])
    profiles = optimisation_profiles(limits["max_batch"], limits["max_seq_len"], limits["block_size"],
                                     limits["max_prompt_len"])
    files = {**DEFAULT_FILES, **(files or {})}
    graphs = {}
    for graph in GRAPHS:
        path = bundle / files[graph]
        if not path.is_file():
            if graph == "target":
                raise RetraceError(f"{path}: target ONNX graph not found")
            continue  # a bundle without drafter: autoregressive only
        model = onnx.load(str(path), load_external_data=False)
        prepare_for_tensorrt(model, plugin)
        shapes = onnx_input_shapes(model)
        resolved = {p: resolve_profile(profiles[graph][p], shapes, f"{path} [{p}]") for p in PROFILES}
        outputs = [o.name for o in model.graph.output]
        graphs[graph] = {"path": path, "model": model, "profiles": resolved, "inputs": list(shapes),
                         "outputs": outputs, "has_plugin": any(n.domain == of.OP_DOMAIN for n in model.graph.node)}
    return {"limits": limits, "graphs": graphs, "plugin": plugin}


def build_tensorrt(bundle_dir: str | Path, out: str | Path, max_batch: int | None = None,
                   max_seq_len: int | None = None, block_size: int | None = None, dtype: str = "auto", *,
                   max_prompt_len: int | None = None, files: dict | None = None, plugin: str = "aot",
                   workspace_gib: float | None = None, manifest_name: str = "manifest.json") -> dict[str, Path]:
    """Build `target.plan` (and `drafter.plan` when the bundle has a drafter) into `out`.

    dtype "auto": strongly typed networks, precision as exported; "fp16"/"bf16"/"fp32": weakly typed
    networks with that builder precision flag (TensorRT may keep layers in higher precision).
    Limits default to the bundle manifest's. Returns {graph: plan path, "manifest": tensorrt.json}."""
    if dtype not in DTYPES:
        raise RetraceError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    plan = plan_graphs(bundle_dir, max_batch, max_seq_len, block_size, max_prompt_len=max_prompt_len,
                       files=files, plugin=plugin, manifest_name=manifest_name)
    trt = require_tensorrt("Building TensorRT engines (retrace-export build --engine tensorrt)")
    for g in plan["graphs"].values():
        check_parser(tensorrt_version(trt), parser_ops(g["model"]), f"{g['path']}: ")
    if plugin != "none" and any(g["has_plugin"] for g in plan["graphs"].values()):
        from retrace.plugins import tensorrt_plugin

        tensorrt_plugin.register()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    logger = trt.Logger(trt.Logger.WARNING)
    written: dict[str, Path] = {}
    for graph, g in plan["graphs"].items():
        blob = _build_one(trt, logger, g, dtype, workspace_gib)
        path = out / PLAN_FILES[graph]
        _atomic_write(path, blob)
        written[graph] = path
    manifest = {
        "format": "retrace-tensorrt/1",
        "tensorrt_version": getattr(trt, "__version__", "unknown"),
        "dtype": dtype,
        "plugin": plugin,
        "limits": plan["limits"],
        "profiles": PROFILES,
        "graphs": {
            graph: {"plan": PLAN_FILES[graph], "inputs": g["inputs"], "outputs": g["outputs"],
                    "input_table": GRAPH_INPUTS[graph], "output_table": GRAPH_OUTPUTS[graph],
                    "shapes": {p: {n: [list(s) for s in v] for n, v in g["profiles"][p].items()} for p in PROFILES}}
            for graph, g in plan["graphs"].items()
        },
    }
    written["manifest"] = out / ENGINE_MANIFEST
    _atomic_write(written["manifest"], (json.dumps(manifest, indent=2) + "\n").encode())
    return written


def _parser_error(err) -> str:
    try:
        return f"node {err.node()} ({err.node_name()}, {err.node_operator()}): {err.desc()}"
    except AttributeError:
        return str(err)


def _build_one(trt, logger, g: dict, dtype: str, workspace_gib: float | None) -> bytes:
    builder = trt.Builder(logger)
    flags = 0
    if dtype == "auto":
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(g["model"].SerializeToString(), str(g["path"])):
        errors = [_parser_error(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RetraceError(f"{g['path']}: TensorRT's ONNX parser failed:\n  " + "\n  ".join(errors))
    config = builder.create_builder_config()
    if workspace_gib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if dtype == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif dtype == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    for profile in PROFILES:
        p = builder.create_optimization_profile()
        for name, (lo, opt, hi) in g["profiles"][profile].items():
            p.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(p)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise RetraceError(f"{g['path']}: TensorRT could not build an engine (see the log above)")
    return bytes(blob)


__all__ = ["build_tensorrt", "optimisation_profiles", "plan_graphs", "prepare_for_tensorrt", "resolve_profile",
           "split_fusion_nodes"]
