"""One benchmark run: build every system, warm each up, then time them interleaved across K runs.

The systems are timed in a rotating order inside every run (run k starts k/K of the way down the list), so
slow drifts of the machine (other jobs, thermal state) hit all systems alike; results are medians and
ranges over the K runs, compared as ratios measured in the same benchmark.

Each group of systems runs in its own worker process under the threading environment it is fastest with
(retrace.bench.envs, retrace.bench.isolate; `--peer-env inherit` keeps everything in this process). One
worker runs at a time, timing inside itself; the others wait on their input pipe, and the CPU time they
use meanwhile is recorded (`machine.idle_workers`) to show that no idle worker spins.
"""

from __future__ import annotations

import fnmatch
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from retrace.bench import report
from retrace.bench.prompts import BenchPrompt, load_prompts
from retrace.bench.systems import ForwardTimers, RunOut, System
from retrace.errors import RetraceError

ORTGENAI_SPEC = ("ortgenai-ngram", "ortgenai-ngram-adaptive", "ortgenai-draft", "ortgenai-draft-adaptive")
PEERS = ("hf-ar", "hf-dflash", "ortgenai-ar", *ORTGENAI_SPEC)
MODES = ("ar", "dflash", "retrace")
BACKENDS = ("torch", "onnxruntime")
HEADLINE = "retrace-onnxruntime-retrace"
GOALS = {"vs_ortgenai_ar": 2.0, "vs_hf_dflash": 1.5, "max_outside_forward_share": 0.05}


@dataclass
class BenchConfig:
    target: str
    drafter: str
    prompts: list[str]
    engine: str | None = None
    max_new_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1, 8)
    runs: int = 3
    limit: int | None = 16
    threads: int | None = None
    systems: tuple[str, ...] | None = None  # fnmatch patterns over system names; None = all
    draft_ar: str | None = None  # HF Qwen3 draft model for ortgenai-draft (None: DIR/draft-ar of a zoo, or trained)
    peer_env: str = "measure"  # retrace.bench.envs.POLICIES
    cache_dir: str | None = None
    build_engine: bool = True  # build an ORT bundle into the cache when no --engine is given
    warmup: bool = True
    profile: str | None = None  # write a cProfile of one headline retrace run here
    verify_policy: str = "adaptive"  # what retrace-<backend>-<mode> runs; -fixed names run the whole block
    # > 0: also retrace-<backend>-<mode>-tree (draft trees of <= this many tokens a round, verify_policy picks)
    # and -tree<b>-fixed for each b of tree_fixed (exactly b); ONNX Runtime: a bundle built with --tree-mask
    tree_budget: int = 0
    tree_fixed: tuple[int, ...] = ()
    tree_sources: str = "topk,suffix,target"
    prompt_lookup: bool = False  # also retrace-<backend>-<mode>-lookup: verify_policy + prompt lookup
    weights: tuple[str, ...] = ("fp32",)  # the precision axis (retrace.bench.precision): ours and the peers'
    device: str | None = None  # the torch backend's device (None: cpu) and dtype (None: float32)
    dtype: str | None = None
    compile_steps: bool = False  # the torch backend's steps under torch.compile
    command: str = ""
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        if self.max_new_tokens < 2:
            raise RetraceError("--max-new-tokens must be at least 2")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise RetraceError("--batch-sizes must be positive integers, e.g. 1,8")
        if self.runs < 1:
            raise RetraceError("--runs must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise RetraceError("--threads must be positive")
        from retrace.bench.envs import POLICIES

        if self.peer_env not in POLICIES:
            raise RetraceError(f"--peer-env must be one of {', '.join(POLICIES)}, got {self.peer_env!r}")


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _wanted(name: str, patterns: tuple[str, ...] | None) -> bool:
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


# ----------------------------------------------------------------------------------------------- machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(mod: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(mod)
    except metadata.PackageNotFoundError:
        return None


def machine_info(threads: int) -> dict:
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": default_threads(),
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in ("retrace", "torch", "transformers", "onnxruntime",
                                              "onnxruntime-genai", "numpy", "tokenizers")},
        "loadavg_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
        "env_note": "the bench process's own; each system's is systems[].env",
    }


# ----------------------------------------------------------------------------------------------- building
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
    out = [(name + suffix, mode, policy) for name, mode, policy in out]
    return [x for x in out if _wanted(x[0], cfg.systems)]


def _retrace_systems(built: Built, rt, backend: str, cfg: BenchConfig, suffix: str = "") -> None:
    timers = ForwardTimers(rt.backend)
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
                built.skip([name], "the bundle's target graph has no tree_mask input (retrace-export build --tree-mask)")
                continue
            _, tree_policy, budget = policy.split(":")
            runtimes[policy] = Runtime(rt.backend, rt.codec, block_size=rt.block_size, verify_policy=tree_policy,
                                       tree_budget=int(budget), tree_sources=cfg.tree_sources)
        if policy.startswith("lookup:") and policy not in runtimes:
            runtimes[policy] = Runtime(rt.backend, rt.codec, block_size=rt.block_size,
                                       verify_policy=policy.split(":")[1], prompt_lookup=True)
        if policy not in runtimes:
            runtimes[policy] = Runtime(rt.backend, rt.codec, block_size=rt.block_size, verify_policy=policy)
        built.systems.append(RetraceSystem(runtimes[policy], backend, mode, timers, name))


def build_systems(cfg: BenchConfig, threads: int, max_seq_len: int, max_batch: int, log,
                  bundle_seq_len: int | None = None, tune_prompts: list[list[int]] | None = None,
                  groups: tuple[str, ...] | None = None) -> Built:
    """The wanted systems of the given groups (retrace.bench.envs.GROUPS; None = all) in this process."""
    import torch

    built = Built()
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    if cache is None:
        from retrace.bench.builds import default_cache_dir

        cache = default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)

    # ours, torch backend
    def group(g: str) -> bool:
        return groups is None or g in groups

    if group("retrace-torch") and _retrace_names("torch", cfg):
        from retrace.runtime import Runtime

        log("loading the torch runtime")
        rt = Runtime.from_dirs(cfg.target, cfg.drafter, backend="torch", max_batch=max_batch,
                               max_seq_len=max_seq_len, threads=threads, device=cfg.device, dtype=cfg.dtype,
                               compile=cfg.compile_steps)
        _retrace_systems(built, rt, "torch", cfg)

    # ours, ONNX Runtime backend, at each precision (fp32: --engine when given)
    from retrace.bench.precision import suffix as precision_suffix

    for weights in cfg.weights:
        _ort_systems(built, cfg, weights, precision_suffix(weights), cache, max_batch, bundle_seq_len, threads,
                     max_seq_len, log, group("retrace-onnxruntime"))

    # transformers peers
    hf_names = [n for n in ("hf-ar", "hf-dflash") if _wanted(n, cfg.systems) and group("hf")]
    if hf_names:
        from transformers import AutoModel, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from retrace.bench.systems import HFArSystem, HFDFlashSystem

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        log("loading transformers' target")
        model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval()
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        if "hf-ar" in hf_names:
            built.systems.append(HFArSystem(model, int(pad)))
        if "hf-dflash" in hf_names:
            try:
                from retrace.bench.builds import build_hf_assistant

                asst_dir = build_hf_assistant(cfg.drafter, cfg.target, cache)
                built.builds["hf_assistant"] = str(asst_dir)
                assistant = AutoModel.from_pretrained(asst_dir, dtype=torch.float32).eval()
                built.systems.append(HFDFlashSystem(model, assistant))
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
                built.skip(["hf-dflash"], f"{type(e).__name__}: {e}".splitlines()[0])

    # onnxruntime-genai peers
    for weights in cfg.weights:
        sfx = precision_suffix(weights)
        if group("ortgenai") and any(_wanted(n + sfx, cfg.systems) for n in ("ortgenai-ar", *ORTGENAI_SPEC)):
            from retrace.bench.ortgenai_peers import add_ortgenai_systems

            add_ortgenai_systems(built, cfg, cache, threads, tune_prompts, log, weights)

    # llama.cpp peers (llama-cpp-python), at the GGUF type of each quantized precision
    if group("llamacpp"):
        from retrace.bench.llamacpp_peers import add_llamacpp_systems

        add_llamacpp_systems(built, cfg, cache, threads, tune_prompts, log)

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
            path, info = build_ort_bundle(cfg.target, cfg.drafter, cache, max_batch, bundle_seq_len, weights)
            built.builds[key] = info
            bundle = str(path)
        else:
            built.builds[key] = {"bundle": str(bundle), "built": False, "given": True}
        from retrace.runtime import Runtime

        rt = _bundle_runtime(Runtime, bundle, max_batch, threads, max_seq_len)
        _retrace_systems(built, rt, "onnxruntime", cfg, suffix)
    except (RetraceError, ImportError) as e:
        built.skip(ort_names, str(e).splitlines()[0])


def _bundle_runtime(Runtime, bundle, max_batch: int, threads: int, max_seq_len: int):
    return Runtime.from_bundle(bundle, backend="onnxruntime", max_batch=max_batch, threads=threads,
                               max_seq_len=max_seq_len)


# ----------------------------------------------------------------------------------------------- the run
def _order(pairs: list, k: int, runs: int) -> list:
    shift = (k * len(pairs)) // runs if pairs else 0
    return pairs[shift:] + pairs[:shift]


def wide_console():
    """A stderr console; when it is not a terminal, wide enough for the results table."""
    from rich.console import Console

    c = Console(stderr=True)
    return c if c.is_terminal else Console(stderr=True, width=200)


def run_bench(cfg: BenchConfig, console=None, show_progress: bool = True) -> dict:
    """Run the benchmark described by `cfg` and return the results (the JSON document)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    cfg.validate()
    console = console or wide_console()
    threads = cfg.threads or default_threads()
    machine = machine_info(threads)

    def log(msg: str) -> None:
        if show_progress:
            console.print(f"[dim]bench:[/dim] {msg}")

    from retrace.models.config import DrafterConfig, Qwen3Config
    from retrace.runtime.tokenizer import TextCodec

    tcfg = Qwen3Config.from_dir(cfg.target)
    dcfg = DrafterConfig.from_dir(cfg.drafter)
    N = cfg.max_new_tokens
    B = dcfg.block_size
    ctx = int(tcfg.max_position_embeddings)
    tree_max = max((cfg.tree_budget, *cfg.tree_fixed))
    max_prompt = ctx - N - max(B, tree_max) - 2
    if max_prompt < 1:
        raise RetraceError(f"--max-new-tokens {N} + block {B} does not fit the target's context of {ctx} tokens")
    prompts: list[BenchPrompt] = load_prompts(cfg.prompts, TextCodec.find(cfg.target), cfg.limit,
                                              tcfg.vocab_size, max_prompt)
    ids = [p.ids for p in prompts]
    max_seq_len = max(len(i) for i in ids) + N + max(B, tree_max) + 2
    batch_sizes = tuple(sorted(set(cfg.batch_sizes)))

    # a bundle built here is sized for the benchmark: the batch and the target's whole context
    built = _build(cfg, threads, max_seq_len, max(batch_sizes), log, min(ctx, 2048), ids[:2], batch_sizes, machine)
    built.block_size = B
    if not built.systems:
        raise RetraceError("no system could be built: " + "; ".join(f"{s['name']}: {s['reason']}" for s in built.skipped))

    pairs = [(s, b) for b in batch_sizes for s in built.systems if s.supports(b) is None]
    runs: dict[tuple[str, int], list[RunOut]] = {(s.name, b): [] for s, b in pairs}
    per_pair_tokens = N * len(ids)
    warm_tokens = sum(N * min(b, len(ids)) for _, b in pairs) if cfg.warmup else 0
    total = warm_tokens + cfg.runs * per_pair_tokens * len(pairs)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not show_progress) as bar:
        task = bar.add_task("bench", total=total)

        def advance(n: int) -> None:
            bar.advance(task, n)

        try:
            if cfg.warmup:
                for s, b in pairs:
                    bar.update(task, description=f"warm-up {s.name} b={b}")
                    s.run(ids[:b], N, b, advance)
            from retrace.bench.isolate import IdleMeter

            meter = IdleMeter(built.workers)
            for k in range(cfg.runs):
                for s, b in _order(pairs, k, cfg.runs):
                    bar.update(task, description=f"run {k + 1}/{cfg.runs} {s.name} b={b}")
                    done = meter.around(getattr(s, "worker", None))
                    runs[(s.name, b)].append(s.run(ids, N, b, advance))
                    done()

            profile = None
            if cfg.profile:
                profile = _profile(cfg.profile, built.systems, ids, N, log)
        except BaseException:
            _close(built)
            raise

    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    machine["idle_workers"] = meter.report() if built.workers else None
    results = assemble(cfg, built, runs, prompts, batch_sizes, machine, threads)
    results["profile"] = profile
    _close(built)
    return results


def _close(built: Built) -> None:
    for s in built.systems:
        s.close()
    for w in built.workers:
        w.close()
    built.workers = []


def _build(cfg: BenchConfig, threads: int, max_seq_len: int, max_batch: int, log, bundle_seq_len: int,
           tune_prompts, batch_sizes, machine: dict) -> Built:
    """In this process (--peer-env inherit) or in one worker process per group (retrace.bench.isolate)."""
    from dataclasses import asdict

    from retrace.bench.isolate import build_isolated, in_process_env

    if cfg.peer_env == "inherit":
        built = build_systems(cfg, threads, max_seq_len, max_batch, log, bundle_seq_len=bundle_seq_len,
                              tune_prompts=tune_prompts)
        for s in built.systems:
            s.env = in_process_env(threads)
        return built
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    if cache is None:
        from retrace.bench.builds import default_cache_dir

        cache = default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    from retrace.bench.builds import dir_digest

    conf = {k: v for k, v in asdict(cfg).items() if k not in ("extra",)}
    request = {"op": "build", "config": conf, "max_seq_len": max_seq_len, "max_batch": max_batch,
               "bundle_seq_len": bundle_seq_len, "tune_prompts": tune_prompts, "batch_sizes": list(batch_sizes),
               "cpu": machine["cpu"], "model_digest": dir_digest(cfg.target, cfg.drafter)}
    built = Built()
    built.systems, built.skipped, built.builds, built.workers = build_isolated(cfg, threads, request, cache, log,
                                                                               tune_prompts)
    return built


def _profile(path: str, systems: list[System], ids, n: int, log) -> dict | None:
    import cProfile
    import pstats

    by_name = {s.name: s for s in systems}
    target = by_name.get(HEADLINE) or by_name.get("retrace-torch-retrace") or next(
        (s for s in systems if s.family == "retrace"), None)
    if target is None:
        return None
    if getattr(target, "worker", None) is not None:
        log(f"profiling one run of {target.name} at batch 1 (in its worker)")
        return target.worker.call({"op": "profile", "path": path, "name": target.name, "prompts": ids,
                                   "n": n})["profile"]
    log(f"profiling one run of {target.name} at batch 1")
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    out = target.run(ids, n, 1)
    prof.disable()
    wall = time.perf_counter() - t0
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.dump_stats(path)
    st = pstats.Stats(prof)
    rows, runtime_rows = [], []
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in st.stats.items():
        row = {"function": f"{Path(file).name}:{line}({fn})", "ncalls": nc, "tottime_s": tt, "cumtime_s": ct}
        rows.append(row)
        if "retrace" in Path(file).parts and "runtime" in Path(file).parts:
            runtime_rows.append(row)
    rows.sort(key=lambda r: -r["tottime_s"])
    runtime_rows.sort(key=lambda r: -r["cumtime_s"])
    return {"system": target.name, "batch_size": 1, "path": str(path), "wall_s": wall,
            "time_split": out.time, "top_tottime": rows[:25], "runtime_cumtime": runtime_rows[:20]}


# ----------------------------------------------------------------------------------------------- results
def _spread(xs: list[float]) -> dict:
    med = statistics.median(xs)
    return {"min": min(xs), "max": max(xs), "rel_range": (max(xs) - min(xs)) / med if med else None}


def _tau(accepted: list[list[int]] | None) -> tuple[float | None, int]:
    if not accepted:
        return None, 0
    rounds = sum(len(a) for a in accepted)
    if not rounds:
        return None, 0
    return sum(x + 1 for a in accepted for x in a) / rounds, rounds


def per_prompt_tau(accepted: list[list[int]] | None) -> dict:
    """tau of each prompt (its own tokens per round) and their mean and median: {} without round counts."""
    per = [t for t in (_tau([a])[0] for a in accepted or []) if t is not None]
    if not per:
        return {}
    return {"tau_per_prompt": per, "tau_prompt_mean": statistics.fmean(per), "tau_prompt_median": statistics.median(per)}


def _hist(accepted: list[list[int]]) -> list[int]:
    h: list[int] = []
    for a in accepted:
        for x in a:
            if x >= len(h):
                h.extend([0] * (x + 1 - len(h)))
            h[x] += 1
    return h


def _time_split(rs: list[RunOut]) -> dict | None:
    if not rs or rs[0].time is None:
        return None
    keys = rs[0].time.keys()
    mean = {k: statistics.fmean(r.time[k] for r in rs) for k in keys}
    w = mean["wall_s"] or 1e-12
    for k in ("prefill", "draft", "verify", "other"):
        mean[f"{k}_share"] = mean[f"{k}_s"] / w
    mean["forward_share"] = mean["forward_s"] / w
    mean["outside_forward_share"] = mean["outside_forward_s"] / w
    mean["target_ms_per_call"] = 1000 * mean["target_forward_s"] / mean["target_calls"] if mean["target_calls"] else None
    mean["draft_ms_per_call"] = 1000 * mean["draft_forward_s"] / mean["draft_calls"] if mean["draft_calls"] else None
    return mean


def _compare(outputs: list[list[int]], ref: list[list[int]]) -> dict:
    bad = []
    for i, (o, r) in enumerate(zip(outputs, ref, strict=True)):
        if o != r:
            first = next((j for j, (x, y) in enumerate(zip(o, r, strict=False)) if x != y), min(len(o), len(r)))
            bad.append({"prompt": i, "first_divergence": first})
    return {"prompts_mismatched": len(bad), "mismatches": bad}


def assemble(cfg: BenchConfig, built: Built, runs: dict, prompts: list[BenchPrompt], batch_sizes, machine: dict,
             threads: int) -> dict:
    N = cfg.max_new_tokens
    expected = N * len(prompts)
    ref_key = ("hf-ar", 1) if ("hf-ar", 1) in runs else next(iter(runs))
    ref = runs[ref_key][0].outputs

    systems: list[dict] = []
    for b in batch_sizes:
        for s in built.systems:
            entry = {"name": s.name, "family": s.family, "backend": s.backend, "mode": s.mode, "batch_size": b,
                     "env": getattr(s, "env", None), "settings": getattr(s, "settings", None)}
            why = s.supports(b)
            if why is not None:
                systems.append({**entry, "status": "n/a", "reason": why, "tokens_per_s": None,
                                "tokens_per_s_runs": [], "tau": None, "time_split": None})
                continue
            rs = runs[(s.name, b)]
            tps = [sum(len(o) for o in r.outputs) / r.wall_s for r in rs]
            tau, rounds = _tau(rs[0].accepted)
            spec = rs[0].stats
            if spec is not None:  # onnxruntime-genai's own count: tokens emitted per speculative round
                tau, rounds = spec["tokens_per_round"], spec["rounds"]
            lengths_ok = all(len(o) == N for r in rs for o in r.outputs)
            stable = all(r.outputs == rs[0].outputs for r in rs[1:])
            systems.append({
                **entry, "status": "ok",
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_runs": tps,
                "spread": _spread(tps),
                "wall_s_runs": [r.wall_s for r in rs],
                "tokens_per_run": sum(len(o) for o in rs[0].outputs),
                "tau": tau,  # pooled: tokens per round over every prompt's rounds
                **per_prompt_tau(rs[0].accepted),
                "rounds": rounds if rs[0].accepted is not None or spec is not None else None,
                "speculative_stats": spec,
                "accepted_hist": _hist(rs[0].accepted) if rs[0].accepted is not None else None,
                "verify_hist": rs[0].verify_hist,
                "time_split": _time_split(rs),
                "exact_length": lengths_ok,
                "deterministic_across_runs": stable,
                "agreement": {"reference": f"{ref_key[0]}@b{ref_key[1]}", **_compare(rs[0].outputs, ref)},
            })
        for sk in built.skipped:
            systems.append({"name": sk["name"], "family": "peer" if sk["name"] in PEERS else "retrace",
                            "backend": None, "mode": None, "batch_size": b, "status": "skipped",
                            "reason": sk["reason"], "tokens_per_s": None, "tokens_per_s_runs": [], "tau": None,
                            "time_split": None})

    results = {
        "command": cfg.command,
        "config": {"target": str(cfg.target), "drafter": str(cfg.drafter), "engine": cfg.engine,
                   "prompts": [str(p) for p in cfg.prompts], "n_prompts": len(prompts),
                   "prompt_tokens": [len(p.ids) for p in prompts], "truncated_prompts": sum(p.truncated > 0 for p in prompts),
                   "max_new_tokens": N, "batch_sizes": list(batch_sizes), "runs": cfg.runs, "threads": threads,
                   "block_size": built.block_size,
                   "greedy": True, "eos": "ignored by every system (exactly max_new_tokens each)",
                   "expected_tokens_per_run": expected},
        "machine": machine,
        "builds": built.builds,
        "systems": systems,
        "skipped": built.skipped,
    }
    results["ratios"] = ratios(systems)
    results["agreement"] = agreement_summary(systems)
    results["fidelity"] = fidelity(runs, N) if ("hf-dflash", 1) in runs and (FIDELITY, 1) in runs else None
    results["per_domain"] = per_domain(runs, prompts)
    results["goals"] = goals(systems, results["ratios"])
    results["analysis"] = round_analysis(systems, len(prompts))
    results["per_prompt"] = [{"source": p.source, "domain": p.domain, "prompt_tokens": len(p.ids)} for p in prompts]
    return results


def ratios(systems: list[dict]) -> list[dict]:
    """tokens/s of every retrace configuration over every peer at the same batch size (None where n/a)."""
    ok = {(s["name"], s["batch_size"]): s for s in systems if s["status"] == "ok"}
    out = []
    for s in systems:
        if s["family"] != "retrace" or s["status"] != "ok":
            continue
        for peer in PEERS:
            p = ok.get((peer, s["batch_size"]))
            out.append({"system": s["name"], "batch_size": s["batch_size"], "peer": peer,
                        "ratio": s["tokens_per_s"] / p["tokens_per_s"] if p and p["tokens_per_s"] else None})
    return out


def agreement_summary(systems: list[dict]) -> dict:
    ok = [s for s in systems if s["status"] == "ok"]
    return {
        "reference": ok[0]["agreement"]["reference"] if ok else None,
        "checked": len(ok),
        "mismatched_prompts": {f"{s['name']}@b{s['batch_size']}": s["agreement"]["prompts_mismatched"] for s in ok},
        "total_mismatched_prompts": sum(s["agreement"]["prompts_mismatched"] for s in ok),
        "all_exact_length": all(s["exact_length"] for s in ok),
        "note": "greedy outputs compared token for token with the reference; fp32 kernels that sum in a different "
                "order can flip a near-tie argmax, after which the continuations differ (counted, not fatal)",
    }


def _committed(acc: list[int], n: int) -> list[int]:
    """Per-round accepted lengths as tokens kept: the final round is cut to what max_new_tokens allowed."""
    if not acc:
        return []
    out = list(acc)
    kept_before = sum(a + 1 for a in out[:-1])
    out[-1] = (n - 1 - kept_before) - 1
    return out


FIDELITY = "retrace-torch-dflash-fixed"  # whole blocks, like transformers' DFlash


def fidelity(runs: dict, n: int) -> dict:
    """Our dflash mode (the fixed verify policy) against transformers' DFlash on the same weights, T=0,
    batch 1."""
    ours = runs[(FIDELITY, 1)][0]
    hf = runs[("hf-dflash", 1)][0]
    tau_ours, rounds_ours = _tau(ours.accepted)
    tau_hf, rounds_hf = _tau(hf.accepted)
    committed = [_committed(a, n) for a in ours.accepted]
    tau_ours_kept, _ = _tau(committed)
    same_prompts = sum(c == h for c, h in zip(committed, hf.accepted, strict=True))
    diverged = []
    for i, (c, h) in enumerate(zip(committed, hf.accepted, strict=True)):
        if c != h:
            j = next((k for k, (x, y) in enumerate(zip(c, h, strict=False)) if x != y), min(len(c), len(h)))
            diverged.append({"prompt": i, "first_round": j, "ours": c[j:j + 3], "hf": h[j:j + 3]})
    truncated = sum(1 for a, c in zip(ours.accepted, committed, strict=True) if a and a[-1] != c[-1])
    outputs_equal = ours.outputs == hf.outputs
    rel = (tau_ours / tau_hf - 1.0) if tau_ours and tau_hf else None
    rel_kept = (tau_ours_kept / tau_hf - 1.0) if tau_ours_kept and tau_hf else None
    why = []
    if truncated:
        why.append(f"in {truncated} of {len(committed)} prompts the final round accepted more drafts than "
                   "max_new_tokens let it keep: the runtime's tau counts that round's full accepted length "
                   "(a+1), transformers' hook counts only the tokens kept; counted the same way (tokens kept "
                   f"per round) ours is {tau_ours_kept:.4f}")
    why.append("the prefill is not a round in either count (transformers' first hook call, num_matches=0 after "
               "the prefill, is excluded); counting it would give n/(rounds+1) instead of (n-1)/rounds")
    if diverged:
        why.append(f"{len(diverged)} prompts' per-round acceptance differs: fp32 drafter logits computed by "
                   "different kernels flip a near-tie draft argmax; after the first such round the blocks start "
                   "at different positions, so later rounds differ too"
                   + ("" if outputs_equal else "; the outputs differ as well (target numerics, see agreement)"))
    else:
        why.append(f"per-round acceptance is identical on all {len(committed)} prompts ({rounds_hf} rounds)")
    return {
        "tau_ours": tau_ours, "tau_hf": tau_hf, "tau_ours_tokens_kept": tau_ours_kept,
        "rounds_ours": rounds_ours, "rounds_hf": rounds_hf,
        "rel_gap": rel, "rel_gap_tokens_kept": rel_kept,
        "within_1pct": rel is not None and abs(rel) <= 0.01,
        "prompts_identical_rounds": same_prompts, "prompts": len(committed),
        "diverged": diverged[:10], "outputs_equal": outputs_equal,
        "explanation": "; ".join(why),
    }


def per_domain(runs: dict, prompts: list[BenchPrompt]) -> dict:
    """tau per prompt domain at batch 1 for every drafting system: pooled (tokens per round over all the
    domain's rounds) and the mean of per-prompt taus."""
    out: dict = {}
    domains = sorted({p.domain for p in prompts})
    for (name, b), rs in runs.items():
        if b != 1 or not rs or rs[0].accepted is None:
            continue
        d_out = {}
        for d in domains:
            acc = [a for a, p in zip(rs[0].accepted, prompts, strict=True) if p.domain == d]
            pooled, rounds = _tau(acc)
            per = [t for t in (_tau([a])[0] for a in acc) if t is not None]
            d_out[d] = {"tau_pooled": pooled, "tau_prompt_mean": statistics.fmean(per) if per else None,
                        "rounds": rounds, "prompts": len(acc)}
        out[name] = d_out
    return out


def round_analysis(systems: list[dict], n_prompts: int) -> list[dict]:
    """Where a round's time goes, per drafting system, against the fastest autoregressive peer at the same
    batch size. With r = our tokens/s over the peer's, t_round the wall time of one (batched) verify round
    and t_fwd its time inside the two forwards: r with zero loop overhead would be r x t_round / t_fwd, and
    the goal needs tau x goal / r at this round cost, or a round of t_round x r / goal at this tau."""
    ok = {(s["name"], s["batch_size"]): s for s in systems if s["status"] == "ok"}
    out = []
    for (name, b), s in ok.items():
        ts = s.get("time_split")
        if s["family"] != "retrace" or s["mode"] == "ar" or not ts or not s.get("tau"):
            continue
        peer = ok.get(("ortgenai-ar", b)) or ok.get(("hf-ar", b))
        if peer is None:
            continue
        rounds = ts["target_calls"] - -(-n_prompts // b)  # verify calls = target calls - one prefill per chunk
        if rounds <= 0:
            continue
        t_round = 1000 * ts["wall_s"] / rounds
        t_fwd = 1000 * (ts["target_forward_s"] + ts["draft_forward_s"]) / rounds
        r = s["tokens_per_s"] / peer["tokens_per_s"]
        goal = GOALS["vs_ortgenai_ar"] if peer["name"] == "ortgenai-ar" else 1.0
        t_peer = 1000 * b / peer["tokens_per_s"]  # ms per peer step of b tokens
        out.append({
            "system": name, "batch_size": b, "peer": peer["name"], "tau": s["tau"], "ratio": r,
            "peer_ms_per_step": t_peer, "round_ms": t_round, "rounds": rounds,
            "verify_ms": ts.get("target_ms_per_call"), "draft_ms": ts.get("draft_ms_per_call"),
            "outside_forward_ms_per_round": t_round - t_fwd,
            "verify_over_peer_step": ts["target_ms_per_call"] / t_peer if ts.get("target_ms_per_call") else None,
            "ratio_bound_zero_overhead": r * t_round / t_fwd if t_fwd else None,
            "goal": goal, "tau_needed_for_goal": s["tau"] * goal / r,
            "round_ms_needed_for_goal": t_round * r / goal,
        })
    return out


def goals(systems: list[dict], rat: list[dict]) -> dict:
    ok = {(s["name"], s["batch_size"]): s for s in systems if s["status"] == "ok"}
    head = HEADLINE if (HEADLINE, 1) in ok else ("retrace-torch-retrace" if ("retrace-torch-retrace", 1) in ok else None)
    res: dict = {"system": head, "targets": GOALS}
    if head is None:
        return res

    def r(peer: str, b: int) -> float | None:
        return next((x["ratio"] for x in rat if x["system"] == head and x["peer"] == peer and x["batch_size"] == b),
                    None)

    checks = []
    for b in sorted({k[1] for k in ok}):
        for peer, key in (("ortgenai-ar", "vs_ortgenai_ar"), ("hf-dflash", "vs_hf_dflash")):
            x = r(peer, b)
            if x is not None:
                checks.append({"what": f"{head} / {peer} at batch {b}", "value": x, "goal": GOALS[key],
                               "met": x >= GOALS[key], "shortfall": None if x >= GOALS[key] else GOALS[key] / x})
    for (name, b), s in ok.items():
        ts = s.get("time_split")
        if s["family"] == "retrace" and ts:
            x = ts["outside_forward_share"]
            checks.append({"what": f"time outside model forwards, {name} at batch {b}", "value": x,
                           "goal": GOALS["max_outside_forward_share"], "met": x <= GOALS["max_outside_forward_share"],
                           "shortfall": None if x <= GOALS["max_outside_forward_share"]
                           else x / GOALS["max_outside_forward_share"]})
    res["checks"] = checks
    res["all_met"] = all(c["met"] for c in checks) if checks else None
    return res


def run_and_report(cfg: BenchConfig, json_out: str | None, plot_out: str | None, readme: bool, console=None,
                   markdown_out: str | None = None) -> dict:
    """The `retrace bench` command: run, write JSON and plots, print the table (and the README table)."""
    import json

    console = console or wide_console()
    results = run_bench(cfg, console)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(results, indent=2) + "\n")
    if plot_out:
        from retrace.bench.plots import plot_results

        results["plots"] = plot_results(results, plot_out)
        if json_out:
            Path(json_out).write_text(json.dumps(results, indent=2) + "\n")
    report.print_results(results, console)
    md = report.render_markdown(results)
    if markdown_out:
        Path(markdown_out).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_out).write_text(md)
    if readme:
        print(md)
    return results
