"""The lineup of a benchmark: which systems to build from a BenchConfig, and building them in this process.

Ours: `retrace-<backend>-<mode>` (the configured verify policy), `-fixed` (whole blocks), `-tree` /
`-tree<b>-fixed` (draft trees), `-lookup` (prompt lookup), `-lookup-first` (prompt lookup also before the
drafter), for the torch backend and an ONNX Runtime bundle at each precision; the peers: transformers
(retrace.bench.systems), onnxruntime-genai (retrace.bench.ortgenai_peers), llama.cpp
(retrace.bench.llamacpp_peers; its own speculative modes in llama-server: retrace.bench.llamacpp_server).
What cannot be built is recorded with its reason (`Built.skip`), never fatal. retrace.bench.isolate runs
`build_systems` once per group in a worker process (retrace.bench.worker).
"""

from __future__ import annotations

from pathlib import Path

from retrace.bench.config import BACKENDS, MODES, ORTGENAI_SPEC, PEERS, BenchConfig, wanted
from retrace.bench.systems import ForwardTimers, System
from retrace.errors import RetraceError


class Built:
    """The systems of one benchmark, plus what could not be built and why."""

    def __init__(self):
        self.systems: list[System] = []
        self.skipped: list[dict] = []
        self.builds: dict = {}
        self.block_size: int = 1
        self.workers: list = []  # retrace.bench.worker.WorkerClient, one per group (none with --peer-env inherit)

    def skip(self, names, reason: str) -> None:
        for n in names:
            self.skipped.append({"name": n, "reason": reason})


def _retrace_names(backend: str, cfg: BenchConfig, suffix: str = "") -> list[tuple[str, str, str]]:
    """(name, mode, verify policy): retrace-<backend>-<mode> runs cfg.verify_policy, -fixed the whole block;
    `suffix`: a quantized bundle's precision (retrace.bench.precision)."""
    out = [(f"retrace-{backend}-{m}", m, cfg.verify_policy) for m in MODES]
    out += [(f"retrace-{backend}-{m}-fixed", m, "fixed") for m in MODES if m != "ar"]
    if cfg.tree_budget:  # bundles need --tree-mask (the bench's own build has none)
        out += [(f"retrace-{backend}-{m}-tree", m, f"tree:{cfg.verify_policy}:{cfg.tree_budget}")
                for m in MODES if m != "ar"]
    out += [(f"retrace-{backend}-{m}-tree{b}-fixed", m, f"tree:fixed:{b}") for b in cfg.tree_fixed
            for m in MODES if m != "ar"]
    if cfg.prompt_lookup:
        out += [(f"retrace-{backend}-{m}-lookup", m, f"lookup:{cfg.verify_policy}") for m in MODES if m != "ar"]
        out += [(f"retrace-{backend}-{m}-lookup-first", m, f"lookup-first:{cfg.verify_policy}")
                for m in MODES if m != "ar"]
    out = [(name + suffix, mode, policy) for name, mode, policy in out]
    return [x for x in out if wanted(x[0], cfg.systems)]


def _retrace_systems(built: Built, rt, backend: str, cfg: BenchConfig, suffix: str = "") -> None:
    timers = ForwardTimers(rt.backend)
    from retrace.bench.decoding import Decoding
    from retrace.bench.systems import RetraceSystem
    from retrace.runtime import Runtime

    runtimes = {}  # one scheduler per policy over the same backend (systems run one at a time)
    for name, mode, policy in _retrace_names(backend, cfg, suffix):
        if mode == "retrace" and not getattr(rt.backend, "has_conditioner", False):
            built.skip([name], "the drafter has no ReTrace conditioner (retrace init-conditioner)")
            continue
        if mode != "ar" and rt.backend.drafter_config is None:
            built.skip([name], "no drafter")
            continue
        if policy.startswith("tree:") and policy not in runtimes:
            graph = getattr(rt.backend, "tgraph", None)  # an ONNX Runtime bundle: its target graph
            if graph is not None and not ({"tree_mask", "attention_bias"} & set(graph.inputs)):
                built.skip([name],
                           "the bundle's target graph has no tree_mask input (retrace-export build --tree-mask)")
                continue
            _, tree_policy, budget = policy.split(":")
            runtimes[policy] = Runtime(rt.backend, rt.codec, block_size=rt.block_size, verify_policy=tree_policy,
                                       tree_budget=int(budget), tree_sources=cfg.tree_sources, prompt_lookup=False)
        if policy.startswith(("lookup:", "lookup-first:")) and policy not in runtimes:
            kind, verify_policy = policy.split(":")
            runtimes[policy] = Runtime(rt.backend, rt.codec, block_size=rt.block_size, verify_policy=verify_policy,
                                       prompt_lookup=True if kind == "lookup" else "first")
        if policy not in runtimes:
            runtimes[policy] = Runtime(rt.backend, rt.codec, block_size=rt.block_size, verify_policy=policy,
                                       prompt_lookup=False)  # the drafter alone: lookup has systems of its own
        built.systems.append(RetraceSystem(runtimes[policy], backend, mode, timers, name, Decoding.of(cfg)))


def build_systems(cfg: BenchConfig, threads: int, max_seq_len: int, max_batch: int, log,
                  bundle_seq_len: int | None = None, tune_prompts: list[list[int]] | None = None,
                  groups: tuple[str, ...] | None = None) -> Built:
    """The wanted systems of the given groups (retrace.bench.envs.GROUPS; None = all) in this process."""
    import torch

    built = Built()
    cache = cfg.cache()
    torch.set_num_threads(threads)

    # ours, torch backend
    def group(g: str) -> bool:
        return groups is None or g in groups

    if group("retrace-torch") and _retrace_names("torch", cfg):
        from retrace.runtime import Runtime

        log("loading the torch runtime")
        rt = Runtime.from_dirs(cfg.target, cfg.drafter, backend="torch", max_batch=max_batch,
                               max_seq_len=max_seq_len, threads=threads, device=cfg.device, dtype=cfg.dtype,
                               compile=cfg.compile_steps, cuda_graphs=cfg.cuda_graphs)
        _retrace_systems(built, rt, "torch", cfg)

    # ours, ONNX Runtime backend, at each precision (fp32: --engine when given)
    from retrace.bench.precision import suffix as precision_suffix

    for weights in cfg.weights:
        _ort_systems(built, cfg, weights, precision_suffix(weights), cache, max_batch, bundle_seq_len, threads,
                     max_seq_len, log, group("retrace-onnxruntime"))

    # transformers peers
    hf_names = [n for n in ("hf-ar", "hf-dflash") if wanted(n, cfg.systems) and group("hf")]
    if hf_names:
        from transformers import AutoModel, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from retrace.bench.decoding import Decoding
        from retrace.bench.systems import HFArSystem, HFDFlashSystem

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        log("loading transformers' target")
        model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval()
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        if "hf-ar" in hf_names:
            built.systems.append(HFArSystem(model, int(pad), Decoding.of(cfg)))
        if "hf-dflash" in hf_names:
            try:
                from retrace.bench.builds import build_hf_assistant

                asst_dir = build_hf_assistant(cfg.drafter, cfg.target, cache)
                built.builds["hf_assistant"] = str(asst_dir)
                assistant = AutoModel.from_pretrained(asst_dir, dtype=torch.float32).eval()
                built.systems.append(HFDFlashSystem(model, assistant, Decoding.of(cfg)))
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                built.skip(["hf-dflash"], f"{type(e).__name__}: {e}".splitlines()[0])

    # onnxruntime-genai peers
    for weights in (w for w in cfg.weights if w != "w8a8"):  # w8a8 is ours only (its peers: int8)
        sfx = precision_suffix(weights)
        if group("ortgenai") and any(wanted(n + sfx, cfg.systems) for n in ("ortgenai-ar", *ORTGENAI_SPEC)):
            from retrace.bench.ortgenai_peers import add_ortgenai_systems

            add_ortgenai_systems(built, cfg, cache, threads, tune_prompts, log, weights)

    # llama.cpp peers (llama-cpp-python, llama-server), at the GGUF type of each quantized precision
    if group("llamacpp"):
        from retrace.bench.llamacpp_peers import add_llamacpp_systems

        add_llamacpp_systems(built, cfg, cache, threads, tune_prompts, log, n_ctx=max_seq_len)
        # and its own speculative decoding (DFlash with our drafter, a draft model) in llama-server
        from retrace.bench.llamacpp_server import add_llama_server_systems

        add_llama_server_systems(built, cfg, cache, threads, tune_prompts, log, n_ctx=max_seq_len)

    order = {n: i for i, n in enumerate(PEERS + tuple(f"retrace-{b}-{m}{f}" for b in BACKENDS for m in MODES
                                                      for f in ("", "-fixed")))}
    built.systems.sort(key=lambda s: order.get(s.name, len(order)))
    return built


def _ort_systems(built: Built, cfg: BenchConfig, weights: str, suffix: str, cache: Path, max_batch: int,
                 bundle_seq_len: int | None, threads: int, max_seq_len: int, log, wanted: bool) -> None:
    """retrace-onnxruntime-*<suffix>: a bundle at `weights` (fp32: --engine when given, else built into the
    cache; int4 / int8: built with retrace-export build --weights)."""
    ort_names = [n for n, _, _ in _retrace_names("onnxruntime", cfg, suffix)] if wanted else []
    if not ort_names:
        return
    key = "onnxruntime_bundle" + suffix.replace("-", "_")
    bundle = cfg.engine if weights == "fp32" else None
    try:
        if bundle is None:
            if not cfg.build_engine:
                raise RetraceError("no --engine given and building one was turned off")
            from retrace.bench.builds import build_ort_bundle

            log(f"building the ONNX Runtime engine bundle ({weights}, cached)")
            path, info = build_ort_bundle(cfg.target, cfg.drafter, cache, max_batch, bundle_seq_len, weights,
                                          cfg.drafter_weights)
            built.builds[key] = info
            bundle = str(path)
        else:
            built.builds[key] = {"bundle": str(bundle), "built": False, "given": True}
        from retrace.runtime import Runtime

        rt = _bundle_runtime(Runtime, bundle, max_batch, threads, max_seq_len, cfg.row_invariant)
        _retrace_systems(built, rt, "onnxruntime", cfg, suffix)
    except (RetraceError, ImportError) as e:
        built.skip(ort_names, str(e).splitlines()[0])


def _bundle_runtime(Runtime, bundle, max_batch: int, threads: int, max_seq_len: int, row_invariant: bool = True):
    return Runtime.from_bundle(bundle, backend="onnxruntime", max_batch=max_batch, threads=threads,
                               max_seq_len=max_seq_len, row_invariant=None if row_invariant else False)
