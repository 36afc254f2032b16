"""Start and stop a local ``tritonserver`` (loopback only) for tests, smoke checks and benchmarks.

    from retrace.export.triton.env import ensure_triton_env
    from retrace.export.triton_server import TritonServer

    with TritonServer(repo, ensure_triton_env()) as srv:
        requests.post(f"{srv.http_url}/v2/models/retrace/generate", json={...})

The server gets free ports (HTTP, gRPC, metrics), its own process group and a log file; ``stop()`` sends
SIGINT (Triton's graceful shutdown), then SIGTERM, then SIGKILL to the whole group, and checks that no
process of the group (python backend stubs included) is left.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from retrace.export.triton.env import TritonEnv, ensure_triton_env

LOOPBACK = "127.0.0.1"


class TritonServerError(RuntimeError):
    """tritonserver did not start, did not get ready, or did not stop; the message quotes its log."""


def free_ports(n: int, host: str = LOOPBACK) -> list[int]:
    """``n`` distinct ports that were free a moment ago (the kernel picks them)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _parent_death_signal() -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent dies (prctl PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TritonServer:
    """A ``tritonserver`` process serving ``model_repository`` on loopback; use as a context manager."""

    def __init__(
        self,
        model_repository: str | os.PathLike[str],
        env: TritonEnv | None = None,
        *,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 120.0,
        stop_timeout: float = 30.0,
        models: Sequence[str] = (),
        extra_args: Sequence[str] = (),
        log_verbose: int = 0,
        die_with_parent: bool = False,
    ) -> None:
        self.repo = Path(model_repository).absolute()
        self.env = env or ensure_triton_env()
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.models = tuple(models)
        self.extra_args = tuple(extra_args)
        self.log_verbose = log_verbose
        # Linux: SIGTERM the server when the thread that started it dies (a killed test run leaves no
        # server behind). Start it from a long-lived thread when this is on.
        self.die_with_parent = die_with_parent
        self.proc: subprocess.Popen[bytes] | None = None
        self.http_port = self.grpc_port = self.metrics_port = 0
        self.startup_s: float | None = None
        self.exit_code: int | None = None
        self.stop_signal: signal.Signals | None = None
        self.leftover = False

    # -- addresses ------------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{LOOPBACK}:{self.metrics_port}/metrics"

    @property
    def metrics_enabled(self) -> bool:
        return not any(a.replace(" ", "=") in ("--allow-metrics=false", "--allow-metrics=0") for a in self.extra_args)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    # -- lifecycle ------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        return [
            str(self.env.tritonserver),
            f"--model-repository={self.repo}",
            f"--backend-directory={self.env.backend_dir}",
            f"--http-address={LOOPBACK}", f"--http-port={self.http_port}",
            f"--grpc-address={LOOPBACK}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={LOOPBACK}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--exit-on-error=true",
            f"--exit-timeout-secs={max(1, int(self.stop_timeout) - 5)}",
            f"--log-verbose={self.log_verbose}",
            *self.extra_args,
        ]

    def start(self, attempts: int = 3) -> TritonServer:
        if self.proc is not None:
            raise TritonServerError("server already started")
        if not self.repo.is_dir():
            raise TritonServerError(f"model repository {self.repo} does not exist")
        last = ""
        for _ in range(attempts):  # a port picked by free_ports() can be taken before the server binds it
            self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
            t0 = time.monotonic()
            with open(self.log_path, "ab") as log:
                log.write(f"$ {' '.join(self.command())}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    env=self.env.server_environ(), cwd=str(self.repo), start_new_session=True,
                    preexec_fn=_parent_death_signal if self.die_with_parent else None,
                )
            try:
                self._wait_ready()
                self.startup_s = time.monotonic() - t0
                return self
            except TritonServerError as e:
                last = str(e)
                self._terminate()
                if "address already in use" not in self.log_tail(200).lower():
                    break
        raise TritonServerError(last)

    def _get(self, path: str, timeout: float = 2.0, base: str | None = None) -> int:
        try:
            with urllib.request.urlopen(f"{base or self.http_url}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return 0

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise TritonServerError(
                    f"tritonserver exited with code {rc} during startup; log {self.log_path}:\n{self.log_tail()}"
                )
            # tritonserver opens its metrics endpoint after HTTP and gRPC: ready means all three answer
            if self._get("/v2/health/ready") == 200 and all(
                self._get(f"/v2/models/{m}/ready") == 200 for m in self.models
            ) and (not self.metrics_enabled or self._get("", base=self.metrics_url) == 200):
                return
            time.sleep(0.1)
        raise TritonServerError(
            f"tritonserver not ready after {self.startup_timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _terminate(self) -> int | None:
        """SIGINT, then SIGTERM, then SIGKILL to the process group; returns the server's exit code."""
        proc = self.proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session: the server leads its own group
        rc = proc.poll()
        self.stop_signal = None
        for sig, wait_s in ((signal.SIGINT, self.stop_timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if rc is not None:
                break
            self.stop_signal = sig
            with contextlib.suppress(ProcessLookupError):
                if sig == signal.SIGINT:
                    proc.send_signal(sig)  # Triton's graceful shutdown; it stops its python stubs itself
                else:
                    os.killpg(pgid, sig)
            try:
                rc = proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                with open(self.log_path, "ab") as log:
                    log.write(f"[retrace] tritonserver ignored {sig.name} for {wait_s:.0f} s\n".encode())
        # Stubs of the python backend exit on their own once the server is gone; give them a moment.
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.leftover = _group_alive(pgid)
        if self.leftover:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.2)
        self.proc = None
        self.exit_code = rc
        return rc

    def stop(self, check: bool = True) -> int | None:
        """Stop the server; with ``check`` raise unless SIGINT alone stopped it (exit 0, nothing left over)."""
        if self.proc is None:
            return None
        rc = self._terminate()
        if check:
            problems = []
            if self.stop_signal not in (None, signal.SIGINT):
                problems.append(f"it needed {self.stop_signal.name}")
            if rc != 0:
                problems.append(f"exit code {rc}")
            if self.leftover:
                problems.append("processes of its group outlived it")
            if problems:
                raise TritonServerError(
                    f"tritonserver did not stop cleanly ({', '.join(problems)}); log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
        return rc

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop(check=exc[0] is None)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m retrace.export.triton_server",
                                 description="Serve a model repository with the cached CPU tritonserver (loopback).")
    ap.add_argument("repository")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--log", default=None, help="log file (default: a temp file)")
    ap.add_argument("--model", action="append", default=[], help="wait until this model is ready")
    args = ap.parse_args(argv)
    srv = TritonServer(args.repository, ensure_triton_env(args.cache_dir), log_path=args.log, models=args.model,
                       die_with_parent=True)

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    # SIGINT may arrive ignored (a background job of a script); SIGTERM must stop the server too.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    srv.start()
    print(f"ready in {srv.startup_s:.1f} s: http {srv.http_url}  grpc {srv.grpc_url}  metrics {srv.metrics_url}\n"
          f"log: {srv.log_path}  (Ctrl-C stops)", flush=True)
    try:
        while srv.is_running():
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    rc = srv.stop(check=False)
    print(f"tritonserver exited with code {rc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
