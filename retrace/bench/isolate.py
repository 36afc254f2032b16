"""Build the benchmark's systems in worker processes, one per group, each under the environment it is
fastest with (retrace.bench.envs), and keep the record of what each ran with."""

from __future__ import annotations

import fnmatch
import time
from pathlib import Path

from retrace.bench import envs
from retrace.bench.worker import ProcessSystem, WorkerClient
from retrace.errors import RetraceError


def group_wanted(group: str, wanted: tuple[str, ...] | None) -> bool:
    """Whether any of the user's --systems patterns can select a system of the group."""
    from retrace.bench.config import BACKENDS, MODES, ORTGENAI_SPEC
    from retrace.bench.llamacpp_peers import LLAMACPP_MODES
    from retrace.bench.llamacpp_server import SERVER_MODES

    known = {"hf": ("hf-ar", "hf-dflash"), "ortgenai": ("ortgenai-ar", *ORTGENAI_SPEC),
             "llamacpp": tuple(f"llamacpp-{m}" for m in (*LLAMACPP_MODES, *SERVER_MODES)),
             **{f"retrace-{b}": tuple(f"retrace-{b}-{m}" for m in MODES) for b in BACKENDS}}[group]
    if wanted is None:
        return True
    prefix = envs.GROUPS[group][0].rstrip("*")
    return any(fnmatch.fnmatchcase(n, w) for n in known for w in wanted) or any(w.startswith(prefix) for w in wanted)


def _start(group: str, env: dict, request: dict, cache: Path) -> tuple[WorkerClient, dict]:
    logs = cache / "worker-logs"
    logs.mkdir(parents=True, exist_ok=True)
    tag = f"{group}-{env.get('omp_wait_policy') or 'default'}-t{env['threads']}"
    w = WorkerClient(group, env, envs.child_environ(env), logs / f"{tag}.log")
    try:
        reply = w.call({**request, "threads": env["threads"]})
    except BaseException:
        w.close()
        raise
    if reply.get("omp_wait_policy") != env.get("omp_wait_policy"):
        w.close()
        raise RetraceError(f"bench worker {tag} started torch with OMP_WAIT_POLICY={reply.get('omp_wait_policy')}")
    return w, reply


def _time_once(w: WorkerClient, name: str, prompts, n: int) -> float:
    return w.run(name, prompts, n, 1).wall_s


def build_isolated(cfg, threads: int, request: dict, cache: Path, log, tune_prompts) -> tuple[list, list, dict, list]:
    """Workers for every group with a wanted system. Returns (systems, skipped, builds, workers)."""
    systems, skipped, builds, workers = [], [], {}, []
    cpu = request.get("cpu", "")
    for group in envs.GROUPS:
        if not group_wanted(group, cfg.systems):
            continue
        req = {**request, "group": group}
        cands = envs.candidates(group, threads)
        if cfg.peer_env == "defaults":
            cands = cands[:1]
        key = envs.cache_key(group, threads, cpu, request.get("model_digest", ""), cands)
        cached = envs.load_choice(cache, key) if len(cands) > 1 else None
        if cached is not None:
            cands = [cached["env"]]
        log(f"starting the {group} worker{'s' if len(cands) > 1 else ''} "
            f"({'; '.join(envs.describe(c) for c in cands)})")
        started = []
        try:
            for c in cands:
                started.append((c, *_start(group, c, req, cache)))
                if not started[0][2]["systems"]:
                    break  # nothing of this group could be built: no point in trying the other candidates
        except RetraceError as e:
            for _, w, _ in started:
                w.close()
            skipped.append({"name": f"{group} systems", "reason": str(e).splitlines()[0]})
            continue
        reply0 = started[0][2]
        table = None
        if len(started) > 1 and reply0["systems"]:
            # alternate the candidates on the group's first system: one warm-up, then two timed runs each
            name = reply0["systems"][0]["name"]
            n = min(32, cfg.max_new_tokens)
            best = {id(w): float("inf") for _, w, _ in started}
            for _, w, _ in started:
                _time_once(w, name, tune_prompts, n)
            for _ in range(2):
                for _, w, _ in started:
                    best[id(w)] = min(best[id(w)], _time_once(w, name, tune_prompts, n))
            tokens = n * len(tune_prompts)
            table = [{**c, "tokens_per_s": tokens / best[id(w)], "system": name} for c, w, _ in started]
            win = min(started, key=lambda t: best[id(t[1])])
            for _c, w, _ in started:
                if w is not win[1]:
                    w.close()
            started = [win]
            envs.save_choice(cache, key, {"env": win[0], "measured": table, "unix": int(time.time()),
                                          "load_class": envs.load_class()})
        env, w, reply = started[0]
        skipped += reply["skipped"]
        builds.update(reply["builds"])
        if not reply["systems"]:
            w.close()
            continue
        workers.append(w)
        how = ("measured now" if table else "measured earlier (cached)" if cached is not None
               else "library defaults" if cfg.peer_env == "defaults" else "only candidate")
        record = {**env, "describe": envs.describe(env), "process": f"worker {group}", "chosen_by": how,
                  "load_class": envs.load_class(),
                  "candidates": table or (cached or {}).get("measured")}
        for info in reply["systems"]:
            s = ProcessSystem(w, info)
            s.env = record
            systems.append(s)
    return systems, skipped, builds, workers


class IdleMeter:
    """CPU time each idle worker uses while another one is timed (a spinning idle worker would show here)."""

    def __init__(self, workers: list[WorkerClient]):
        self.workers = workers

    def around(self, busy: WorkerClient | None):
        others = [w for w in self.workers if w is not busy]
        before = [envs.process_cpu_s(w.proc.pid) for w in others]
        t0 = time.perf_counter()

        def done() -> None:
            wall = time.perf_counter() - t0
            for w, b in zip(others, before, strict=True):
                a = envs.process_cpu_s(w.proc.pid)
                if a is not None and b is not None:
                    w.idle_cpu_s += a - b
                    w.idle_wall_s += wall
        return done

    def report(self) -> dict:
        return {w.group: {"idle_cpu_s": round(w.idle_cpu_s, 3), "idle_wall_s": round(w.idle_wall_s, 3),
                          "idle_cpu_share": (w.idle_cpu_s / w.idle_wall_s) if w.idle_wall_s else None}
                for w in self.workers}


def in_process_env(threads: int) -> dict:
    import os

    pol = os.environ.get("OMP_WAIT_POLICY")
    env = {"omp_wait_policy": pol, "threads": threads}
    return {**env, "describe": envs.describe(env), "process": "bench process",
            "chosen_by": "inherited (--peer-env inherit)", "candidates": None}


__all__ = ["build_isolated", "IdleMeter", "in_process_env"]
