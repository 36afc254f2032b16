"""The runtime's command-line options, declared once, and the RuntimeOptions they build.

`retrace generate` and `retrace serve` take them all (`runtime_options`: the command gets `target`,
`drafter`, `engine`, `backend` and `options`, one checked retrace.runtime.options.RuntimeOptions);
`retrace bench` and `retrace eval` declare the ones they use with `runtime_flags` (their own defaults
where they differ). A wrong value exits 2 with one line naming its flag. Only click is imported here, so
`--help` stays fast and retrace.cli and retrace.serve.cli can both import this module.
"""

from __future__ import annotations

import functools

import click

from retrace.cli_errors import cli_errors
from retrace.errors import RetraceError

# RuntimeOptions field -> (the command's parameter name, the flag, click.option keyword arguments; `note`:
# the default as --help states it where it is not one value, dropped when a command gives its own default)
FLAGS: dict[str, tuple[str, str, dict]] = {
    "max_batch": ("max_batch", "--max-batch", dict(
        type=int, default=None, help="batch slots", note="[default: 8, or the bundle's limit]")),
    "max_seq_len": ("max_seq_len", "--max-seq-len", dict(
        type=int, default=None, help="tokens per slot", note="[default: 2048, or the bundle's limit]")),
    "block_size": ("block_size", "--block-size", dict(
        type=int, default=None, help="tokens per draft block", note="(default: drafter's)")),
    "threads": ("threads", "--threads", dict(type=int, default=None, help="CPU threads for the backend")),
    "verify_bundle": ("no_verify_bundle", "--no-verify-bundle", dict(
        is_flag=True, help="skip re-hashing the bundle's files on load (sizes are still checked)")),
    "verify_policy": ("verify_policy", "--verify-policy", dict(
        type=click.Choice(["adaptive", "fixed"]), default="adaptive", show_default=True,
        help="drafts verified per round: adaptive = as many as pay for themselves on this machine (none: plain "
             "decoding), fixed = the whole block")),
    "tree_budget": ("tree_budget", "--tree-budget", dict(
        type=int, default=0, show_default=True,
        help="verify a draft tree of at most N tokens per row and round (root included; --verify-policy "
             "adaptive picks how many pay, fixed: N); 0 = the chain")),
    "tree_sources": ("tree_sources", "--tree-sources", dict(
        default="topk,suffix,target", show_default=True,
        help="where a draft tree's candidates come from: topk (the drafter's per-slot top-k), suffix (the "
             "previous round's rejected suffix), target (the target's argmax on it)")),
    "prompt_lookup": ("prompt_lookup", "--prompt-lookup", dict(
        type=click.Choice(["off", "on", "first"]), is_flag=False, flag_value="on", default="first",
        show_default=True,
        help="verify drafts copied from the request's own prompt and output (n-gram lookup; greedy requests, "
             "rounds of up to 8 rows; runtime/prompt_lookup.py): `on` in rounds without a drafter call, `first` also "
             "instead of a draft call where the lookup is expected to commit faster "
             "(runtime/proposers/lookup_first.py), `off` never")),
    "prefill_chunk": ("prefill_chunk", "--prefill-chunk", dict(
        type=int, default=None, help="prompt tokens prefilled per step over all new prompts, so the running "
                                     "requests decode between a long prompt's chunks (runtime/prefill_chunks.py; "
                                     "0: each prompt whole)",
        note="[default: each prompt whole; serve: 256 on a CPU, 2048 on CUDA]")),
    "device": ("device", "--device", dict(
        default=None, help="where the torch backend runs: cpu, cuda, cuda:N", note="[default: cpu]")),
    "dtype": ("dtype", "--dtype", dict(
        type=click.Choice(["bfloat16", "float16", "float32"]), default=None,
        help="weights and caches of --target/--drafter", note="[default: float32]")),
    "compile": ("compile_steps", "--compile", dict(
        is_flag=True, help="run the torch backend's target and drafter steps under torch.compile(fullgraph=True)")),
    "cuda_graphs": ("no_cuda_graphs", "--no-cuda-graphs", dict(
        is_flag=True, help="on CUDA, run the torch backend's steps eagerly instead of as captured CUDA graphs")),
    "row_invariant": ("row_invariance", "--row-invariance/--no-row-invariance", dict(
        default=None, help="target calls padded to shapes whose rows the kernels compute alike, so a verify row "
                           "equals the decode step bit for bit and speculative output equals plain decoding's "
                           "even at near ties. Off: each call at its own width, a faster decode step (int4 ONNX "
                           "Runtime: the row-invariant step measured 1.2-1.5x the plain one; torch on the CPU: "
                           "every call at 16 columns)", note="[default: on for a bundle and on CUDA, off for torch "
                                                           "on the CPU]")),
}

LOOKUP = {None: False, "off": False, "on": True, "first": "first"}  # --prompt-lookup -> RuntimeOptions.prompt_lookup

SOURCE_OPTIONS = [  # where the runtime comes from (not RuntimeOptions: they pick the backend and its files)
    click.option("--target", type=click.Path(), help="Qwen3 target HF directory"),
    click.option("--drafter", type=click.Path(), help="DFlash drafter directory (with conditioner files)"),
    click.option("--engine", type=click.Path(), help="engine bundle from retrace-export build"),
    click.option("--backend", type=click.Choice(["torch", "onnxruntime", "tensorrt"]), default=None,
                 help="torch for --target/--drafter (default), onnxruntime for --engine (default)"),
]


def runtime_flags(*fields: str, helps: dict[str, str] | None = None, **defaults):
    """A decorator adding the click options of these RuntimeOptions fields (all of them if none are
    named), in FLAGS order; `defaults` (field=value) are a command's own defaults, shown in --help;
    `helps` (field: text) a command's own help texts."""
    helps = helps or {}
    unknown = [f for f in (*fields, *defaults, *helps) if f not in FLAGS]
    if unknown:
        raise ValueError(f"not runtime options: {unknown}")
    chosen = [f for f in FLAGS if not fields or f in fields]

    def add(fn):
        for field in reversed(chosen):
            param, flag, kw = FLAGS[field]
            kw = dict(kw)
            note = kw.pop("note", None)
            if field in defaults:
                kw.update(default=defaults[field], show_default=True)
            elif note:
                kw["help"] += " " + note
            if field in helps:
                kw["help"] = helps[field]
            fn = click.option(flag, param, **kw)(fn)
        return fn

    return add


def options_from_flags(values: dict):
    """The command's parameters of the FLAGS (by parameter name) -> RuntimeOptions (checked; a wrong value
    raises RetraceError naming its flag)."""
    from retrace.runtime.options import InvalidOption, RuntimeOptions

    given = {}
    for field, (param, _, _) in FLAGS.items():
        if param in values:
            given[field] = values[param]
    if "prompt_lookup" in given:  # --prompt-lookup [off|on|first]
        given["prompt_lookup"] = LOOKUP[given["prompt_lookup"]]
    for name in ("verify_bundle", "cuda_graphs"):  # "--no-" flags: off when given, else the default
        if name in given:
            given[name] = False if given[name] else None
    try:
        return RuntimeOptions(**given)
    except InvalidOption as e:
        raise RetraceError(f"{FLAGS[e.field][1]} {e.problem}") from None


def runtime_options(fn):
    """--target/--drafter/--engine/--backend and every runtime option; the command receives `target`,
    `drafter`, `engine`, `backend` and `options` (a RuntimeOptions, checked before the command runs)."""
    params = {param for param, _, _ in FLAGS.values()}

    @functools.wraps(fn)
    def build(*args, **kwargs):
        flags = {k: kwargs.pop(k) for k in list(kwargs) if k in params}
        return fn(*args, options=options_from_flags(flags), **kwargs)

    wrapped = cli_errors(build)
    wrapped = runtime_flags()(wrapped)
    for opt in reversed(SOURCE_OPTIONS):
        wrapped = opt(wrapped)
    return wrapped


def build_runtime(target, drafter, engine, backend, options, drafts: bool = True):
    """The Runtime for --engine (limits default to the bundle's) or --target/--drafter (torch), carrying
    `options` (a RuntimeOptions) whole. drafts=False (a command that only decodes plainly): an ONNX Runtime
    bundle's drafter session is not opened unless something drafts after all (lazy_drafter)."""
    from retrace.runtime import Runtime

    if engine is not None:
        if target or drafter:
            raise RetraceError("give either --engine or --target/--drafter, not both")
        backend = backend or "onnxruntime"
        lazy = {"lazy_drafter": True} if backend == "onnxruntime" and not drafts else {}
        return Runtime.from_bundle(engine, backend=backend, options=options, **lazy)
    if target is None:
        raise RetraceError("give --target (and --drafter) or --engine")
    from retrace.models.config import Qwen3Config
    from retrace.runtime.options import DIRS_MAX_SEQ_LEN

    max_pos = Qwen3Config.from_dir(target).max_position_embeddings
    if options.max_seq_len is not None and options.max_seq_len > max_pos:
        raise RetraceError(f"--max-seq-len {options.max_seq_len} exceeds the target's max_position_embeddings "
                           f"{max_pos}")
    options = options.replace(max_seq_len=options.max_seq_len or min(DIRS_MAX_SEQ_LEN, max_pos))
    return Runtime.from_dirs(target, drafter, backend=backend or "torch", options=options)
