"""Shared pieces of the trainers: device/dtype choice, AdamW with warmup + cosine, progress bars, and
atomic, pickle-free training checkpoints (tensors in safetensors, everything else in JSON).

A training checkpoint is a directory ``<out>/train_state/`` holding ``state.safetensors`` (trainable
parameters under ``param.<name>``, AdamW moments under ``optim.<i>.<key>``, RNG states under ``rng.*``)
and ``state.json`` (step, learning-rate schedule, AdamW hyper-parameters, the run's config and
anything the trainer adds). It is written into a temporary directory beside it and renamed into place,
so a crash leaves either the previous checkpoint or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from retrace.errors import RetraceError
from retrace.runtime.device import resolve_device as _resolve_device
from retrace.runtime.prompts import read_prompts_jsonl  # noqa: F401  (re-exported)

STATE_DIR = "train_state"  # the DFlash drafter's checkpoint
CONDITIONER_STATE_DIR = "conditioner_state"  # the conditioner's, beside it (so neither overwrites the other)
STATE_VERSION = 1


# -- device ------------------------------------------------------------------------------------------
def resolve_device(device: str | None) -> torch.device:
    """"auto" (or None) -> cuda when available else cpu; anything else is checked (runtime/device.py)."""
    return _resolve_device("auto" if device is None else device)


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on CUDA (and on CPU when asked); a no-op context otherwise."""
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    from retrace.cli_checks import check_threads

    if not n:  # 0 or None: leave torch's setting
        yield
        return
    check_threads(n)
    old = torch.get_num_threads()
    torch.set_num_threads(int(n))
    try:
        yield
    finally:
        torch.set_num_threads(old)


# -- schedule --------------------------------------------------------------------------------------------
def lr_at(step: int, total: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup to `lr` over `warmup` steps, then cosine decay to `min_ratio * lr` at `total`."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    t = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def make_adamw(named_params: list[tuple[str, torch.nn.Parameter]], lr: float, weight_decay: float,
               betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights and biases are not decayed)."""
    decay = [p for n, p in named_params if p.ndim >= 2]
    no_decay = [p for n, p in named_params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=1e-8)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


# -- progress ----------------------------------------------------------------------------------------------
def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True, leave=False,
                mininterval=1.0, file=sys.stderr)


def log(enabled: bool, tag: str, msg: str) -> None:
    if enabled:
        print(f"[{tag}] {msg}", file=sys.stderr, flush=True)


# -- checkpoints ---------------------------------------------------------------------------------------------
def _optim_tensors(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim.{idx}.{k}"] = v
            else:
                scalars[f"{idx}.{k}"] = v
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def save_train_state(out_dir: str | Path, params: dict[str, torch.Tensor], opt: torch.optim.Optimizer | dict,
                     step: int, info: dict, rng: dict[str, torch.Tensor] | None = None,
                     state: str = STATE_DIR) -> Path:
    """Atomically write `out_dir/train_state/` (see the module docstring). Returns its path. `opt`: the optimizer
    or its full state dict in torch's format (state keyed by parameter index; --fsdp gathers one)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / state
    tmp = out / f".{state}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    try:
        tensors = {f"param.{k}": v.detach().float().cpu().contiguous() for k, v in params.items()}
        ot, ometa = _optim_tensors(opt if isinstance(opt, dict) else opt.state_dict())
        tensors.update({k: v.detach().cpu().contiguous() for k, v in ot.items()})
        tensors["rng.torch"] = torch.get_rng_state()
        for k, v in (rng or {}).items():
            tensors[f"rng.{k}"] = v.detach().cpu().contiguous()
        save_file(tensors, str(tmp / "state.safetensors"), metadata={"format": "retrace-train-state"})
        meta = {"version": STATE_VERSION, "step": int(step), "optimizer": ometa, "info": info}
        (tmp / "state.json").write_text(json.dumps(meta, indent=2) + "\n")
        old = None
        if final.exists():
            old = out / f".{state}.old-{uuid.uuid4().hex[:6]}"
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def has_train_state(out_dir: str | Path, state: str = STATE_DIR) -> bool:
    d = Path(out_dir) / state
    return (d / "state.json").is_file() and (d / "state.safetensors").is_file()


def read_train_state(out_dir: str | Path, names, state: str = STATE_DIR) -> tuple[int, dict, dict[str, torch.Tensor],
                                                                                 dict, dict]:
    """Read a checkpoint whole: (step, info, {name: full parameter} for `names`, the optimizer state dict in
    torch's format, rng tensors by name incl. "torch"). Raises a RetraceError for a missing or foreign one."""
    d = Path(out_dir) / state
    meta = _read_meta(d)
    try:
        tensors = load_file(str(d / "state.safetensors"))
    except (SafetensorError, OSError) as e:
        raise RetraceError(f"{d / 'state.safetensors'}: cannot read the training checkpoint ({e}); is it truncated? "
                           "start without --resume") from None
    missing = [k for k in names if f"param.{k}" not in tensors]
    if missing:
        raise RetraceError(f"{d}: checkpoint lacks parameters {missing[:5]} (different model or flags?)")
    om = meta["optimizer"]
    ostate: dict[int, dict] = {}
    try:
        for key, v in tensors.items():
            if key.startswith("optim."):
                _, idx, name = key.split(".", 2)
                ostate.setdefault(int(idx), {})[name] = v
        for key, v in om["scalars"].items():
            idx, name = key.split(".", 1)
            ostate.setdefault(int(idx), {})[name] = v
        groups = om["param_groups"]
        for g in groups:
            if "betas" in g:
                g["betas"] = tuple(g["betas"])
    except (KeyError, ValueError, TypeError, AttributeError) as e:
        raise RetraceError(f"{d}: the checkpoint's optimizer state is malformed ({type(e).__name__}: {e}); start "
                           "without --resume") from None
    rng = {k[4:]: v for k, v in tensors.items() if k.startswith("rng.")}
    return (meta["step"], meta["info"], {k: tensors[f"param.{k}"] for k in names},
            {"state": ostate, "param_groups": groups}, rng)


def load_train_state(out_dir: str | Path, params: dict[str, torch.nn.Parameter],
                     opt: torch.optim.Optimizer, state: str = STATE_DIR) -> tuple[int, dict, dict[str, torch.Tensor]]:
    """Restore parameters and optimizer in place. Returns (step, info, extra rng tensors)."""
    step, info, full, osd, rng = read_train_state(out_dir, list(params), state)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(full[k].to(p.dtype))
    opt.load_state_dict(osd)
    torch.set_rng_state(rng.pop("torch"))
    return step, info, rng


def clear_train_state(out_dir: str | Path, state: str = STATE_DIR) -> None:
    shutil.rmtree(Path(out_dir) / state, ignore_errors=True)


def conditioner_state_dir(out_dir: str | Path) -> str:
    """Where the conditioner's checkpoint in out_dir is: CONDITIONER_STATE_DIR, or STATE_DIR for one an older
    retrace wrote there (it shared train_state/ with the drafter's, so a conditioner run overwrote that)."""
    out = Path(out_dir)
    if not has_train_state(out, CONDITIONER_STATE_DIR) and has_train_state(out):
        try:
            if json.loads((out / STATE_DIR / "state.json").read_text())["info"]["kind"] == "conditioner":
                return STATE_DIR
        except (OSError, ValueError, KeyError, TypeError):
            pass
    return CONDITIONER_STATE_DIR


def _read_meta(d: Path) -> dict:
    """state.json of the checkpoint d, checked: a JSON object of this version with an integer step >= 0."""
    if not ((d / "state.json").is_file() and (d / "state.safetensors").is_file()):
        raise RetraceError(f"{d}: no training checkpoint to resume from")
    try:
        meta = json.loads((d / "state.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RetraceError(f"{d / 'state.json'}: not a readable training checkpoint ({e}); start without "
                           "--resume") from None
    if not isinstance(meta, dict) or meta.get("version") != STATE_VERSION:
        v = meta.get("version") if isinstance(meta, dict) else None
        raise RetraceError(f"{d / 'state.json'}: training checkpoint version {v!r} (expected {STATE_VERSION})")
    step, info = meta.get("step"), meta.get("info")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise RetraceError(f"{d / 'state.json'}: step {step!r} is not a step count (an integer >= 0)")
    if not isinstance(info, dict) or not isinstance(meta.get("optimizer"), dict):
        raise RetraceError(f"{d / 'state.json'}: the checkpoint lacks its 'info' or 'optimizer' record")
    return meta


def check_resumable(out_dir: str | Path, kind: str, config_sha: str, max_step: int, state: str = STATE_DIR) -> int:
    """Before any expensive work (the target's generation): the checkpoint state.json is whole and of this
    trainer (`kind`), was made with these settings, and its step is within 0..max_step, and state.safetensors'
    header is whole. Returns its step; raises a RetraceError saying what is wrong otherwise."""
    d = Path(out_dir) / state
    meta = _read_meta(d)
    info, step = meta["info"], meta["step"]
    if info.get("kind") != kind:
        raise RetraceError(f"{d}: the training checkpoint is a {info.get('kind')!r} one, not {kind!r}; start "
                           "without --resume")
    if info.get("config_sha") != config_sha:
        raise RetraceError(f"{out_dir}: the training checkpoint was made with different settings; "
                           "start without --resume (or with the same flags)")
    if step > max_step:
        raise RetraceError(f"{d / 'state.json'}: step {step} is beyond this run's {max_step} steps; start without "
                           "--resume (or with at least as many steps)")
    try:
        with safe_open(str(d / "state.safetensors"), "pt"):
            pass
    except (SafetensorError, OSError) as e:
        raise RetraceError(f"{d / 'state.safetensors'}: cannot read the training checkpoint ({e}); is it truncated? "
                           "start without --resume") from None
    return step


# -- data ---------------------------------------------------------------------------------------------------
def key_sha(obj) -> str:
    """16 hex digits of the sha256 of `obj` as sorted JSON: the key of a run's settings or cached data."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# read_prompts_jsonl lives in retrace.runtime.prompts (one reader for the CLI, training and benchmarks)
def encode_prompts(rows: list[dict], codec) -> list[list[int]]:
    out = []
    for r in rows:
        if "prompt_ids" in r:
            out.append([int(t) for t in r["prompt_ids"]])
        else:
            if codec is None:
                raise RetraceError("prompts are text but the target directory has no tokenizer.json")
            out.append(codec.encode(r["prompt"]))
    return out


def split_validation(n: int, val_count: int, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic (train indices, validation indices) split of range(n)."""
    g = torch.Generator().manual_seed(10_007 + seed)
    order = torch.randperm(n, generator=g).tolist()
    val_count = min(val_count, n // 4) if n >= 4 else 0
    return sorted(order[val_count:]), sorted(order[:val_count])


# -- process parallelism (CPU) ----------------------------------------------------------------------------
def _run_in_worker(fn, args, threads):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(threads)
    return fn(*args)


def parallel_map(fn, arg_list: list[tuple], workers: int, threads: int = 1) -> list:
    """fn(*args) for each args, in `workers` spawned processes (`threads` torch threads each); in this process
    when workers <= 1. The decode loops of tiny models are latency-bound: two one-thread processes on two
    cores do ~2x the work of one two-thread process. fn must be importable (a module-level function)."""
    if workers <= 1 or len(arg_list) <= 1:
        return [fn(*a) for a in arg_list]
    import concurrent.futures as cf
    import multiprocessing as mp

    import torch.multiprocessing  # noqa: F401  (registers tensor pickling through shared memory)

    with cf.ProcessPoolExecutor(max_workers=min(workers, len(arg_list)), mp_context=mp.get_context("spawn")) as ex:
        futs = [ex.submit(_run_in_worker, fn, a, threads) for a in arg_list]
        return [f.result() for f in futs]


def shards(n: int, k: int) -> list[range]:
    """k contiguous, near-equal ranges covering range(n) (empty ones dropped)."""
    k = max(1, min(k, n))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(k) if bounds[i + 1] > bounds[i]]
