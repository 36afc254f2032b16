"""A benchmark worker: one process that builds one group of systems (retrace.bench.envs.GROUPS) under its
own environment and runs them on request, timing inside the process.

Protocol: one JSON object per line on stdin, one reply per line on the original stdout (the worker's own
prints go to stderr). Requests: {"op": "build", ...BenchConfig fields and sizes}, {"op": "run", "name",
"prompts", "n", "batch_size"}, {"op": "profile", "path", "prompts", "n"}, {"op": "close"}. Replies carry
"ok": true, or "ok": false with "error".

`WorkerClient` starts one and `ProcessSystem` stands for one of its systems in the parent's runner.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

from retrace.bench.systems import RunOut, System
from retrace.errors import RetraceError


# ----------------------------------------------------------------------------------------------- worker side
def _serve(inp, out) -> None:
    from retrace.bench.config import BenchConfig
    from retrace.bench.lineup import build_systems
    from retrace.bench.profiling import profile_run

    built = None
    cfg = None
    try:
        for line in inp:
            req = json.loads(line)
            op = req.get("op")
            try:
                if op == "build":
                    fields = {f.name for f in dataclasses.fields(BenchConfig)}
                    cfg = BenchConfig(**{k: v for k, v in req["config"].items() if k in fields})
                    built = build_systems(cfg, req["threads"], req["max_seq_len"], req["max_batch"], lambda m: None,
                                                 bundle_seq_len=req.get("bundle_seq_len"),
                                                 tune_prompts=req.get("tune_prompts"), groups=(req["group"],))
                    reply = {"systems": [{"name": s.name, "family": s.family, "backend": s.backend, "mode": s.mode,
                                          "settings": getattr(s, "settings", None),
                                          "supports": {str(b): s.supports(b) for b in req["batch_sizes"]}}
                                         for s in built.systems],
                             "skipped": built.skipped, "builds": built.builds,
                             "omp_wait_policy": OMP_AT_START}
                elif op == "run":
                    s = next(s for s in built.systems if s.name == req["name"])
                    r = s.run(req["prompts"], req["n"], req["batch_size"])
                    reply = {"run": dataclasses.asdict(r)}
                elif op == "profile":
                    reply = {"profile": profile_run(req["path"], [s for s in built.systems if s.name == req["name"]],
                                                        req["prompts"], req["n"], lambda m: None)}
                elif op == "close":
                    for s in built.systems if built else []:
                        s.close()
                    out.write(json.dumps({"ok": True}) + "\n")
                    out.flush()
                    return
                else:
                    raise RetraceError(f"unknown worker op {op!r}")
                reply["ok"] = True
            except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
                traceback.print_exc(file=sys.stderr)
                reply = {"ok": False, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:  # the parent closed, or went away (end of input), or this failed: no system outlives the worker
        for s in built.systems if built else []:
            s.close()


OMP_AT_START: str | None = None


def main() -> None:
    global OMP_AT_START
    OMP_AT_START = os.environ.get("OMP_WAIT_POLICY")
    import torch  # noqa: F401 - loads libgomp now, which reads OMP_WAIT_POLICY once, from this environment

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything printed by libraries goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    _serve(sys.stdin, proto)


# ----------------------------------------------------------------------------------------------- parent side
class WorkerClient:
    """One worker process with a given environment (retrace.bench.envs.child_environ)."""

    def __init__(self, group: str, env: dict, environ: dict, log_path: Path):
        self.group = group
        self.env = env
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "retrace.bench.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=environ, text=True, bufsize=1)
        self.idle_cpu_s = 0.0
        self.idle_wall_s = 0.0

    def call(self, req: dict) -> dict:
        if self.proc.poll() is not None:
            raise RetraceError(f"bench worker {self.group} exited ({self.proc.returncode}); log: {self.log_path}")
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RetraceError(f"bench worker {self.group} died (exit {self.proc.wait()}); log: {self.log_path}")
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RetraceError(f"bench worker {self.group}: {reply.get('error')} (log: {self.log_path})")
        return reply

    def run(self, name: str, prompts, n: int, batch_size: int) -> RunOut:
        r = self.call({"op": "run", "name": name, "prompts": prompts, "n": n, "batch_size": batch_size})["run"]
        return RunOut(**r)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "close"})
            except (RetraceError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class ProcessSystem(System):
    """A system that lives in a worker; `run` is timed inside the worker (start-up and transfer excluded)."""

    def __init__(self, worker: WorkerClient, info: dict):
        self.worker = worker
        self.name = info["name"]
        self.family = info["family"]
        self.backend = info["backend"]
        self.mode = info["mode"]
        self.settings = info.get("settings")
        self._supports = info["supports"]
        self.env: dict = {}

    def supports(self, batch_size: int) -> str | None:
        return self._supports.get(str(batch_size), "not built for this batch size")

    def run(self, prompts, n, batch_size, progress=None) -> RunOut:
        out = self.worker.run(self.name, prompts, n, batch_size)
        if progress is not None:
            progress(sum(len(o) for o in out.outputs))
        return out


if __name__ == "__main__":
    main()
