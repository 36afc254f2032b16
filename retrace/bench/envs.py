"""The threading environment each benchmarked system runs with, and how it is chosen.

Every group of systems that shares a loaded model runs in its own worker process (retrace.bench.worker),
started with its own environment, because the OpenMP runtime reads `OMP_WAIT_POLICY` once, at its first
parallel region: one process cannot give transformers the library default and another system PASSIVE.
The CLI's `OMP_WAIT_POLICY=PASSIVE` (retrace/cli.py) is therefore never inherited: each candidate below
sets or removes the variable explicitly.

Groups and candidates (threads T = --threads):
- `hf` (hf-ar, hf-dflash), `retrace-torch` (retrace-torch-*): torch threads T, OMP_WAIT_POLICY library
  default (unset: libgomp spins ~300k iterations, then sleeps) or PASSIVE (which wins depends on the load:
  docs/benchmarks.md).
- `retrace-onnxruntime`: ONNX Runtime's own thread pool (T intra-op threads); torch (the loop's small ops)
  default or PASSIVE.
- `ortgenai` (ortgenai-*): onnxruntime-genai, ONNX Runtime's thread pool (pip builds do not use OpenMP):
  intra_op_num_threads T or 1 in its genai_config.json.
- `llamacpp` (llamacpp-*): llama-cpp-python (its ggml OpenMP threads, n_threads T), and the llama-server processes
  it starts (they inherit the environment; `-t T`): default or PASSIVE.
ACTIVE is never a candidate: an idle worker whose OpenMP threads spin forever would steal a core from the
worker being timed (the runner records every idle worker's CPU time to show this does not happen).

`measure` (the default) starts one worker per candidate, times the group's first system on a short run in
alternation and keeps the fastest worker (the choice is cached per machine, group, threads, model and load
class, because the winner changes with the load);
`defaults` takes the first candidate of each group (the library defaults) without measuring; `inherit`
runs everything in this process with this process's environment (the old behaviour; recorded as such).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

POLICIES = ("measure", "defaults", "inherit")
GROUPS = {  # group -> fnmatch patterns of its systems
    "hf": ("hf-*",),
    "retrace-torch": ("retrace-torch-*",),
    "retrace-onnxruntime": ("retrace-onnxruntime-*",),
    "ortgenai": ("ortgenai-*",),
    "llamacpp": ("llamacpp-*",),
}
OMP_VARS = ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")


def candidates(group: str, threads: int) -> list[dict]:
    """Environments to try for a group, library defaults first. Each: {'omp_wait_policy': None|'PASSIVE',
    'threads': n} (None = the variable is unset: the OpenMP library's own default)."""
    if group == "ortgenai":
        ts = [threads] + ([1] if threads > 1 else [])
        return [{"omp_wait_policy": None, "threads": t} for t in ts]
    return [{"omp_wait_policy": None, "threads": threads}, {"omp_wait_policy": "PASSIVE", "threads": threads}]


def child_environ(env: dict, base: dict | None = None) -> dict:
    """os.environ for a worker: the OpenMP variables removed, then the candidate's set."""
    out = dict(os.environ if base is None else base)
    for k in OMP_VARS:
        out.pop(k, None)
    if env.get("omp_wait_policy"):
        out["OMP_WAIT_POLICY"] = env["omp_wait_policy"]
    return out


def describe(env: dict) -> str:
    pol = env.get("omp_wait_policy") or "default"
    return f"OMP_WAIT_POLICY={pol}, {env['threads']} thread{'s' if env['threads'] != 1 else ''}"


def load_class() -> str:
    """'idle' or 'loaded' (1-minute load average at or above 3/4 of the usable cores): spinning OpenMP threads
    pay off on an idle machine and cost several times over on a loaded one, so a choice made under one is
    not reused under the other."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return "loaded" if load >= 0.75 * cores else "idle"


def cache_key(group: str, threads: int, cpu: str, model_digest: str, cands: list[dict]) -> str:
    raw = json.dumps([group, threads, cpu, model_digest, cands, load_class()], sort_keys=True)
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_choice(cache_dir: Path, key: str) -> dict | None:
    try:
        return json.loads((cache_dir / "envs.json").read_text()).get(key)
    except (OSError, json.JSONDecodeError):
        return None


def save_choice(cache_dir: Path, key: str, choice: dict) -> None:
    p = cache_dir / "envs.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        data = {}
    data[key] = choice
    tmp = p.with_name(f".envs-{os.getpid()}.json")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(p)


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads), from /proc (None where unavailable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
