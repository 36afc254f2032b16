"""`retrace-export build`: target + drafter directories -> a verified engine bundle, atomically.

Stages (each shown with its time): check inputs, load models, export the target graph, export the
drafter graph, onnx.checker + structure checks, ONNX Runtime parity against torch, the backend's own
stage (none for onnxruntime; `retrace.export.tensorrt:build_tensorrt` for tensorrt), tokenizer, hashes
and manifest, then the rename into place.

Atomicity and ownership follow retrace.output_dir (kind "engine-bundle"): everything is written to a
hidden temp sibling and renamed to the output path at the very end. Any error, Ctrl-C, SIGTERM or a full
disk removes the temp directory, so the output path either keeps what it had before or holds a complete,
verified bundle. An existing output is replaced only with `force=True`, and only if it is a bundle this
tool wrote (its owner marker), or a marker-less bundle that verifies completely and holds nothing but its
manifest's files (built before markers existed); an empty directory is free. Never some other directory.

Extension point for other backends: BACKEND_HOOKS maps a backend name to "module:function"; the function
is called as `fn(ctx: BuildContext)` after the ONNX graphs are written, checked and parity-tested, inside
the temp directory. It may add files under `ctx.staging` (they are hashed into the manifest
automatically), add manifest sections (`ctx.manifest["engines"] = {...}`), and show its own stages with
`with ctx.stage("build TensorRT engine"): ...`. Raising aborts the build and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrace.engines.bundle import FORMAT, is_complete_bundle, retrace_version, write_manifest
from retrace.errors import MissingDependencyError, RetraceError
from retrace.output_dir import check_output, staged_output

KIND = "engine-bundle"  # the owner-marker kind (retrace.output_dir)

# backend -> "module:function" run after the ONNX stages (None: the ONNX graphs are the engine)
BACKEND_HOOKS: dict[str, str | None] = {
    "onnxruntime": None,
    "tensorrt": "retrace.export.build:tensorrt_hook",
    "tensorrt-llm": "retrace.export.build:tensorrt_llm_hook",
}
DTYPES = ("float32", "float16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja", "tokenizer.model")


class BuildError(RetraceError):
    """The build cannot start or did not finish (nothing was left at the output path)."""


@dataclass
class BuildOptions:
    target: Path
    drafter: Path | None
    out: Path
    backend: str = "onnxruntime"
    dtype: str = "float32"
    max_batch: int = 8
    max_seq_len: int | None = None  # default: min(2048, the target's max_position_embeddings)
    block_size: int | None = None  # default: the drafter's
    force: bool = False
    attention: str = "native"
    tolerance: float | None = None  # default: onnx_parity.TOLERANCE[dtype]
    conditioner: bool = True  # include the drafter directory's ReTrace conditioner when it has one
    tree_mask: bool = False  # the target graph's optional tree_mask input (tree verification, ONNX Runtime)
    backend_options: dict[str, Any] = field(default_factory=dict)  # for hooks (e.g. TensorRT profiles)
    # weight-only quantization (retrace.export.quantize): fp32 (the default: the graphs parity-checked
    # against torch, and bundles as before), int8 or int4 MatMulNBits; its block size and accuracy level
    weights: str = "fp32"
    weight_block_size: int | None = None
    accuracy_level: int | None = None
    head_block_size: int | None = None
    # the drafter's own precision (fp32, int8, int4, w8a8; its kind's default block and accuracy level): None
    # quantizes it as `weights` says. The drafter's numerics never change the output (verification decides);
    # at the Qwen3-0.6B shape an int8 drafter beside an fp32 target drafts at 0.14 of a decode instead of 0.20
    drafter_weights: str | None = None
    export_cache: Path | None = None  # retrace/export/export_cache.py (None: $RETRACE_EXPORT_CACHE, if set)

    def __post_init__(self):
        if self.tree_mask and self.backend != "onnxruntime":
            raise RetraceError("--tree-mask: tree verification runs on the onnxruntime backend only")
        self.target = Path(self.target)
        self.drafter = Path(self.drafter) if self.drafter is not None else None
        self.out = Path(self.out)
        from retrace.export.quantize import WeightQuant

        self.quant = WeightQuant(self.weights, self.weight_block_size, self.accuracy_level, self.head_block_size)
        self.drafter_quant = (self.quant if self.drafter_weights in (None, self.weights)
                              else WeightQuant(self.drafter_weights))
        if self.drafter_weights is not None and self.drafter is None:
            raise RetraceError("--drafter-weights needs --drafter (a target-only bundle has no drafter to quantize)")
        for option, q in (("--weights", self.quant), ("--drafter-weights", self.drafter_quant)):
            if q.quantized and (self.backend != "onnxruntime" or self.dtype != "float32"):
                raise RetraceError(f"{option} {q.weights} builds ONNX Runtime quantized graphs from float32 "
                                   "weights: use it with --backend onnxruntime --dtype float32")


@dataclass
class BuildContext:
    """What a backend hook sees (see the module docstring)."""

    options: BuildOptions
    staging: Path
    manifest: dict
    target: Any = None  # retrace.models.target.Qwen3Target (torch, loaded in options.dtype)
    drafter: Any = None  # retrace.models.drafter.DFlashDrafter | None
    graphs: dict = field(default_factory=dict)  # name -> retrace.export.onnx_export.ExportedGraph
    reporter: Any = None

    def stage(self, name: str):
        return self.reporter.stage(name)


@dataclass
class BuildResult:
    out: Path
    manifest: dict
    seconds: float
    stages: list[tuple[str, float]]


# -- progress ------------------------------------------------------------------------------------------------
class Reporter:
    """Per-stage progress on a rich console (a spinner while running, a line with the time when done)."""

    def __init__(self, console=None, quiet: bool = False):
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self.quiet = quiet
        self.stages: list[tuple[str, float]] = []
        self._notes: list[str] = []

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        self._notes: list[str] = []
        status = self.console.status(f"{name} ...") if not self.quiet else contextlib.nullcontext()
        try:
            with status:
                yield
        except BaseException:
            if not self.quiet:
                self.console.print(f"[red]✗[/red] {name} [dim]({time.perf_counter() - t0:.1f} s)[/dim]")
            raise
        dt = time.perf_counter() - t0
        self.stages.append((name, dt))
        if not self.quiet:
            self.console.print(f"[green]✓[/green] {name} [dim]({dt:.1f} s)[/dim]")
            for text in self._notes:
                self.console.print(f"    [dim]{text}[/dim]")
        self._notes = []

    def note(self, text: str) -> None:
        """A detail line shown under the current stage's line."""
        self._notes.append(text)


# -- output path handling -------------------------------------------------------------------------------------
def _check_output(out: Path, force: bool) -> None:
    check_output(out, KIND, force, is_complete_bundle, "engine bundle")


# -- the build -----------------------------------------------------------------------------------------------
def _versions() -> dict:
    out = {"retrace": retrace_version()}
    for mod in ("torch", "onnx", "onnxscript", "onnxruntime", "transformers"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception:  # noqa: BLE001
            out[mod] = None
    return out


def _resolve_hook(backend: str, opts: BuildOptions | None = None):
    if backend not in BACKEND_HOOKS:
        raise BuildError(f"unknown backend {backend!r} (choose from {', '.join(BACKEND_HOOKS)})")
    spec = BACKEND_HOOKS[backend]
    if spec is None:
        return None
    module, fn = spec.split(":")
    try:
        hook = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise MissingDependencyError(f"backend {backend!r} is not available in this installation ({e})") from None
    precheck = getattr(hook, "precheck", None)
    if precheck is not None:  # fail before the (long) ONNX stages, e.g. when TensorRT is not installed
        precheck(opts)
    return hook


def _validate(opts: BuildOptions):
    """Everything that can be checked before any heavy work; returns (target config, drafter config)."""
    from retrace.models.conditioner import ReTraceConditioner
    from retrace.models.config import DrafterConfig, Qwen3Config

    if opts.dtype not in DTYPES:
        raise BuildError(f"unknown dtype {opts.dtype!r} (choose from {', '.join(DTYPES)})")
    if opts.max_batch < 1:
        raise BuildError(f"--max-batch must be >= 1, got {opts.max_batch}")
    if opts.tolerance is not None and not (math.isfinite(opts.tolerance) and opts.tolerance >= 0):
        raise BuildError(f"--tolerance must be a finite number >= 0, got {opts.tolerance}")
    if opts.attention not in ("native", "decomposed"):
        raise BuildError(f"unknown attention form {opts.attention!r} (native or decomposed)")
    tcfg = Qwen3Config.from_dir(opts.target)
    tokenizer_files(opts.target)  # before the export, not at the end
    if opts.max_seq_len is None:
        opts.max_seq_len = min(2048, tcfg.max_position_embeddings)
    if opts.max_seq_len < 2:
        raise BuildError(f"--max-seq-len must be >= 2, got {opts.max_seq_len}")
    if opts.max_seq_len > tcfg.max_position_embeddings:
        raise BuildError(f"--max-seq-len {opts.max_seq_len} exceeds the target's max_position_embeddings "
                         f"{tcfg.max_position_embeddings} ({opts.target / 'config.json'})")
    dcfg = None
    if opts.drafter is not None:
        dcfg = DrafterConfig.from_dir(opts.drafter)
        dcfg.check_fits(tcfg, opts.drafter / "config.json")
        block = dcfg.block_size if opts.block_size is None else opts.block_size
        if not 2 <= block <= dcfg.block_size:
            raise BuildError(f"--block-size {block} must be in 2..{dcfg.block_size} (the drafter's block_size)")
        if block + 1 >= opts.max_seq_len:
            raise BuildError(f"--max-seq-len {opts.max_seq_len} leaves no room for a block of {block}")
        if opts.conditioner and ReTraceConditioner.exists(opts.drafter):  # read its config now: a broken one fails fast
            from retrace.models.config import read_json

            read_json(opts.drafter / "retrace_config.json")
        from retrace.models.draft_vocab import DraftVocab

        DraftVocab.load(opts.drafter, tcfg.vocab_size)  # a broken map fails before any export
    elif opts.block_size is not None:
        raise BuildError("--block-size needs --drafter")
    return tcfg, dcfg


def build_bundle(opts: BuildOptions, reporter: Reporter | None = None) -> BuildResult:
    """Build the bundle described by opts (see the module docstring). Raises RetraceError subclasses for
    problems the user can fix; the output path is untouched unless the build succeeds."""
    reporter = reporter or Reporter(quiet=True)
    t_start = time.perf_counter()
    out = Path(os.path.abspath(opts.out))
    hook = _resolve_hook(opts.backend, opts)
    with reporter.stage("check inputs"):
        tcfg, dcfg = _validate(opts)
        _check_output(out, opts.force)
    with staged_output(out, KIND, opts.force, is_complete_bundle, "engine bundle",
                       installing=lambda: reporter.stage("move into place")) as staging:
        manifest = _build_into(staging, opts, tcfg, dcfg, hook, reporter)
    return BuildResult(out, manifest, time.perf_counter() - t_start, list(reporter.stages))


def _build_into(staging: Path, opts: BuildOptions, tcfg, dcfg, hook, reporter: Reporter) -> dict:
    import torch

    from retrace.export import onnx_export, onnx_parity
    from retrace.models.drafter import load_pair

    t0 = time.perf_counter()
    dtype = {"float32": torch.float32, "float16": torch.float16}[opts.dtype]
    block = (opts.block_size or dcfg.block_size) if dcfg is not None else None
    tolerance = opts.tolerance if opts.tolerance is not None else onnx_parity.TOLERANCE[opts.dtype]
    ctx = BuildContext(opts, staging, {}, reporter=reporter)

    with reporter.stage(f"load models ({opts.dtype})"):
        if dcfg is None:
            from retrace.models.target import Qwen3Target

            # a target-only bundle (ar mode): still tap the middle layer so the graph I/O is uniform
            target, drafter = Qwen3Target.from_pretrained(opts.target, (tcfg.num_hidden_layers // 2,), dtype), None
        else:
            # the graph keeps the full head (parity is checked on it); the draft vocabulary travels as its map
            target, drafter = load_pair(opts.target, opts.drafter, dtype=dtype, load_conditioner=opts.conditioner,
                                        draft_vocab=False)
        ctx.target, ctx.drafter = target, drafter

    with reporter.stage(f"export target graph ({tcfg.num_hidden_layers} layers, {opts.attention} attention)"):
        tree = {"tree_mask": True} if opts.tree_mask else {}
        ctx.graphs["target"] = export_target_graph(target, staging / "target", opts.attention, **tree,
                                                   cache_dir=opts.export_cache)
        reporter.note(f"{ctx.graphs['target'].node_count} nodes")
    if drafter is not None:
        what = "ReTrace" if drafter.conditioner is not None else "DFlash"
        with reporter.stage(f"export drafter graph ({what}, {dcfg.layers.num_hidden_layers} layers)"):
            ctx.graphs["drafter"] = export_drafter_graph(drafter, staging / "drafter", opts.attention,
                                                         cache_dir=opts.export_cache)
            reporter.note(f"{ctx.graphs['drafter'].node_count} nodes, "
                          f"{ctx.graphs['drafter'].custom_nodes} retrace::GatedSuffixFusion")

    with reporter.stage("check graphs (onnx.checker)"):
        onnx_export.check_graph(ctx.graphs["target"].path, "target", expect_fusion_nodes=0)
        if drafter is not None:
            onnx_export.check_graph(ctx.graphs["drafter"].path, "drafter",
                                    expect_fusion_nodes=1 if drafter.conditioner is not None else 0)

    parity: dict[str, Any] = {"tolerance": tolerance, "rule": "max|ort-torch| <= tolerance * max(1, max|logits|)"}
    with reporter.stage("parity: target in ONNX Runtime vs torch"):
        parity["target"] = run_parity("target", target, ctx.graphs["target"].path, block or 16, tolerance)
        reporter.note(_parity_note(parity["target"]))
    if drafter is not None:
        with reporter.stage("parity: drafter in ONNX Runtime vs torch"):
            parity["drafter"] = run_parity("drafter", drafter, ctx.graphs["drafter"].path, block, tolerance)
            reporter.note(_parity_note(parity["drafter"]))

    sections = {}  # manifest section -> its record: "quantization" (the target's precision, and the drafter's
    # when it is the same), "drafter_quantization" (a drafter quantized at its own --drafter-weights)
    own = opts.drafter_quant is not opts.quant
    for section, q, names in (("quantization", opts.quant, ["target"] if own else list(ctx.graphs)),
                              ("drafter_quantization", opts.drafter_quant, ["drafter"] if own else [])):
        if not q.quantized or not names:
            continue
        with reporter.stage(f"quantize {' and '.join(names)} ({q.weights}, per-row int8 activations)" if q.row_scaled
                            else f"quantize {' and '.join(names)} ({q.weights}, block {q.block}, LM head block "
                            f"{q.head_block}, accuracy level {q.level})"):
            from retrace.export.quantize import quantize_bundle

            sections[section] = quantize_bundle({n: ctx.graphs[n] for n in names}, target, q, reporter.note)
        with reporter.stage("check quantized graphs (onnx.checker)"):
            for name in names:  # the drafter's fusion node inlined (retrace.export.inline_fusion)
                onnx_export.check_graph(ctx.graphs[name].path, name, expect_fusion_nodes=0)

    shared: dict[str, str] = {}
    if drafter is not None:
        with reporter.stage("shared weights: drafter initializers equal to the target's"):
            from retrace.runtime.shared_weights import shared_pairs

            shared = shared_pairs(ctx.graphs["target"].path, ctx.graphs["drafter"].path)
            reporter.note(f"{len(shared)} shared (ONNX Runtime loads them once): {', '.join(shared) or 'none'}")

    with reporter.stage("tokenizer"):
        tok = _copy_tokenizer(opts.target, staging / "tokenizer")
        reporter.note(f"copied {', '.join(tok)}" if tok else "no tokenizer files in the target directory "
                      "(generate with token ids)")

    ctx.manifest = _manifest(opts, tcfg, dcfg, drafter, block, ctx.graphs, parity, tok)
    if "quantization" in sections:
        ctx.manifest["weights"] = opts.quant.weights
    if own:
        ctx.manifest["drafter_weights"] = opts.drafter_quant.weights
    ctx.manifest.update(sections)
    if drafter is not None:
        from retrace.export.draft_vocab import copy_draft_vocab

        entry = copy_draft_vocab(opts.drafter, staging, tcfg.vocab_size)
        if entry is not None:
            ctx.manifest["models"]["drafter"]["draft_vocab"] = entry
            reporter.note(f"draft vocabulary: {entry['draft_vocab_size']} ids, coverage {entry['coverage']}")
    if shared:  # drafter initializer -> target initializer (retrace.runtime.shared_weights)
        ctx.manifest["graphs"]["drafter"]["shared_initializers"] = shared
    if hook is not None:
        hook(ctx)  # the backend's own stages (they use ctx.stage)

    with reporter.stage("hash files + write manifest"):
        ctx.manifest["build"]["seconds"] = round(time.perf_counter() - t0, 2)
        manifest = write_manifest(staging, ctx.manifest)
    return manifest


# Indirections the tests monkeypatch (to interrupt a build mid-way without paying for a real export).
def export_target_graph(target, out_dir: Path, attention: str, tree_mask: bool = False, cache_dir=None):
    from retrace.export.onnx_export import export_target

    return export_target(target, out_dir, attention, tree_mask, cache_dir)


def export_drafter_graph(drafter, out_dir: Path, attention: str, cache_dir=None):
    from retrace.export.onnx_export import export_drafter

    return export_drafter(drafter, out_dir, attention, cache_dir)


def run_parity(name: str, model, path: Path, block: int, tolerance: float) -> dict:
    from retrace.export import onnx_parity

    fn = onnx_parity.target_parity if name == "target" else onnx_parity.drafter_parity
    results = fn(model, path, block)
    worst = onnx_parity.check(results, tolerance, name)
    return {"cases": results, "max_scaled_logits_diff": worst}


def tensorrt_hook(ctx: BuildContext) -> None:
    """--backend tensorrt: TensorRT plans from the bundle's ONNX graphs (retrace.export.tensorrt), written
    to BUNDLE/tensorrt/ and listed in the manifest's "engines" section. The ONNX graphs stay in the
    bundle (the onnxruntime backend can still run it). ctx.options.backend_options go to build_tensorrt."""
    from retrace.export.tensorrt import build_tensorrt

    o = ctx.options
    with ctx.stage("build TensorRT engines"):
        written = build_tensorrt(ctx.staging, ctx.staging / "tensorrt", max_batch=o.max_batch,
                                 max_seq_len=o.max_seq_len, block_size=ctx.manifest["limits"]["block_size"],
                                 dtype={"float32": "auto", "float16": "fp16"}[o.dtype], **o.backend_options)
    ctx.manifest["engines"] = {"tensorrt": {k: Path(p).relative_to(ctx.staging).as_posix()
                                            for k, p in written.items()}}


def _tensorrt_precheck(opts: BuildOptions | None = None) -> None:
    from retrace.plugins.errors import require_tensorrt

    trt = require_tensorrt("Building TensorRT engines (retrace-export build --backend tensorrt)")
    if opts is not None:  # refuse before exporting when the parser cannot import the chosen attention form
        from retrace.export.tensorrt import check_attention_form

        check_attention_form(trt, opts.attention)


tensorrt_hook.precheck = _tensorrt_precheck


def tensorrt_llm_hook(ctx: BuildContext) -> None:
    """--backend tensorrt-llm: a TensorRT-LLM (>= 1.3, PyTorch backend) DFlash deployment in
    BUNDLE/tensorrt_llm/ (copies of the target and drafter dirs, LLM-API options, serve.sh, run_llm.py).
    TensorRT-LLM serves DFlash mode; ReTrace conditioning runs in retrace's own runtime."""
    from retrace.export.tensorrt_llm import write_trtllm_deployment

    o = ctx.options
    with ctx.stage("write TensorRT-LLM deployment"):
        info = write_trtllm_deployment(o.target, o.drafter, ctx.staging / "tensorrt_llm", link="copy",
                                       max_draft_len=ctx.manifest["limits"]["block_size"] - 1,
                                       max_batch_size=o.max_batch, max_seq_len=ctx.manifest["limits"]["max_seq_len"],
                                       **o.backend_options)
    ctx.manifest["engines"] = {"tensorrt-llm": {"dir": "tensorrt_llm", "notes": info.get("notes", [])}}


def _tensorrt_llm_precheck(opts: BuildOptions | None = None) -> None:
    if opts is not None and opts.drafter is None:
        raise BuildError("--backend tensorrt-llm needs --drafter (its DFlash speculative decoding)")


tensorrt_llm_hook.precheck = _tensorrt_llm_precheck


def _parity_note(p: dict) -> str:
    return "max |Δlogits| " + ", ".join(f"{k} {v['logits']:.1e}" for k, v in p["cases"].items())


def tokenizer_files(src: Path) -> list[str]:
    """The target's tokenizer files to copy into the bundle. A symbolic link is followed only to a file inside
    the target directory: one pointing elsewhere (merges.txt -> /etc/passwd) would put that file into the
    bundle and every Triton repository made from it, so it is refused, named."""
    found = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    root = src.resolve()
    for n in found:
        real = (src / n).resolve()
        if not real.is_relative_to(root):
            raise BuildError(f"{src / n} is a symbolic link to {real}, outside the target directory {src}; refusing "
                             "to copy it into the bundle (put the real tokenizer file in the target directory)")
    return found


def _copy_tokenizer(src: Path, dst: Path) -> list[str]:
    found = tokenizer_files(src)
    if found:
        dst.mkdir(parents=True, exist_ok=True)
        for n in found:
            shutil.copy2(src / n, dst / n)
    return found


def _read_json_or_none(path: Path):
    import json

    return json.loads(path.read_text()) if path.is_file() else None


def _manifest(opts: BuildOptions, tcfg, dcfg, drafter, block, graphs, parity, tok) -> dict:
    models: dict[str, Any] = {
        "target": {
            "config": _read_json_or_none(opts.target / "config.json"),
            "generation_config": _read_json_or_none(opts.target / "generation_config.json"),
            "eos_token_ids": list(tcfg.eos_token_ids),
            "tap_layers": list(dcfg.target_layer_ids) if dcfg is not None else [tcfg.num_hidden_layers // 2],
            "source": str(opts.target.resolve()),
            "summary": dataclasses.asdict(tcfg.layers) | {"vocab_size": tcfg.vocab_size},
        },
        "drafter": None,
        "conditioner": None,
    }
    if dcfg is not None:
        models["drafter"] = {"config": dcfg.to_zlab_dict(), "source": str(opts.drafter.resolve()),
                             "summary": dataclasses.asdict(dcfg.layers) | {
                                 "block_size": dcfg.block_size, "mask_token_id": dcfg.mask_token_id,
                                 "target_layer_ids": list(dcfg.target_layer_ids)}}
        if drafter is not None and drafter.conditioner is not None:
            models["conditioner"] = {"config": drafter.conditioner.config_dict(), "op": "retrace::GatedSuffixFusion"}
    return {
        "format": FORMAT,
        "retrace_version": retrace_version(),
        "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": opts.backend,
        "dtype": opts.dtype,
        "limits": {"max_batch": opts.max_batch, "max_seq_len": opts.max_seq_len, "block_size": block},
        "models": models,
        "graphs": {name: {"path": f"{name}/{g.path.name}",
                          "data": f"{name}/{g.data_path.name}" if g.data_path else None,
                          **g.summary()} for name, g in graphs.items()},
        "parity": parity,
        "tokenizer": {"dir": "tokenizer", "files": tok} if tok else None,
        "build": {"versions": _versions(), "attention": opts.attention, "opset": 23},
    }
