"""Fixtures and small clients for the Triton server tests (import the fixtures into a test module).

The tritonserver install and the model's numpy<2 environment are created once per cache directory
(``$RETRACE_TRITON_CACHE``, default ``~/.cache/retrace/triton``; the first creation takes ~1 min, later
runs find it at once). Servers bind 127.0.0.1 only, on free ports.

Fixtures (import the ``fixture_*`` functions into a test module; pytest knows them by their names):
``triton_env``, ``standin_bundle``, ``standin_server``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import http_json

from retrace.export.triton.env import TritonEnv, ensure_triton_env
from retrace.export.triton.repository import write_repository
from retrace.export.triton_server import TritonServer

STANDIN_FACTORY = "retrace.export.triton.standin:create_runtime"
MODEL = "retrace"
STANDIN_MAX_SEQ_LEN = 512
STANDIN_MAX_BATCH = 8
STANDIN_STEP_DELAY_S = 0.01


@pytest.fixture(scope="session", name="triton_env")
def fixture_triton_env() -> TritonEnv:
    t0 = time.monotonic()
    env = ensure_triton_env()
    dt = time.monotonic() - t0
    if dt > 1:
        print(f"\n[triton] created server + model env in {dt:.1f} s at {env.cache_dir}")
    return env


def write_standin_bundle(path: Path, max_seq_len: int = STANDIN_MAX_SEQ_LEN) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps({"format": "standin", "max_seq_len": max_seq_len}))
    (path / "weights.bin").write_bytes(b"\0" * 16)
    return path


@pytest.fixture(scope="session", name="standin_bundle")
def fixture_standin_bundle(tmp_path_factory) -> Path:
    return write_standin_bundle(tmp_path_factory.mktemp("bundle") / "bundle")


def write_standin_repo(out: Path, bundle: Path, env: TritonEnv, **kw: Any) -> Path:
    kw.setdefault("max_batch", STANDIN_MAX_BATCH)
    kw.setdefault("runtime_options", {"step_delay_s": STANDIN_STEP_DELAY_S})
    return write_repository(bundle, out, model_name=MODEL, env_path=env.model_env, runtime_factory=STANDIN_FACTORY,
                            force=True, **kw)


@pytest.fixture(scope="session", name="standin_server")
def fixture_standin_server(tmp_path_factory, triton_env, standin_bundle) -> Iterator[TritonServer]:
    """One server for the module's request tests (stand-in runtime, max_batch 8, 10 ms per round)."""
    root = tmp_path_factory.mktemp("standin")
    repo = write_standin_repo(root / "repo", standin_bundle, triton_env)
    srv = TritonServer(repo, triton_env, log_path=root / "server.log", models=[MODEL], startup_timeout=120,
                       die_with_parent=True)
    srv.start()
    print(f"\n[triton] server ready in {srv.startup_s:.2f} s, log {srv.log_path}")
    try:
        yield srv
    finally:
        srv.stop(check=True)


# ------------------------------------------------------------------------------------------- clients
def http_post(srv: TritonServer, path: str, body: Any, timeout: float = 60.0, parse: bool = True) -> tuple[int, Any]:
    """POST JSON to the server; returns (status, parsed JSON, or the raw text if not JSON or not parse)."""
    return http_json(srv.http_port, "POST", path, body, timeout, parse)


def generate(srv: TritonServer, body: Any, model: str = MODEL, timeout: float = 60.0) -> tuple[int, Any]:
    return http_post(srv, f"/v2/models/{model}/generate", body, timeout)


def parse_sse(raw: str) -> list[dict]:
    events = []
    for block in raw.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):].strip()))
    return events


def generate_stream(srv: TritonServer, body: Any, model: str = MODEL, timeout: float = 60.0) -> tuple[int, list[dict]]:
    """POST to /generate_stream; returns (status, the SSE events' JSON objects, errors included)."""
    status, raw = http_post(srv, f"/v2/models/{model}/generate_stream", body, timeout, parse=False)
    events = parse_sse(raw)
    if not events and raw.strip().startswith("{"):
        events = [json.loads(raw)]  # an error answered before streaming started
    return status, events


def as_list(v: Any) -> list:
    """/generate turns a one-element output into a scalar: normalise to a list."""
    return v if isinstance(v, list) else [v]


def stats_of(obj: dict) -> dict:
    return json.loads(obj["stats"])


def requests_total(srv: TritonServer, finish_reason: str) -> float:
    """retrace_requests_total on the server's metrics port, summed over modes, for one finish reason."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(srv.metrics_url, timeout=10).read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "retrace_requests_total" and s.labels.get("finish_reason") == finish_reason)


class FakeSink:
    def __init__(self):
        self.responses: list[tuple[list[int], str, dict | None, bool]] = []
        self.errors: list[tuple[str, str]] = []
        self.cancel = False
        self.done = threading.Event()

    def send(self, ids, text, stats, final):
        self.responses.append((list(ids), text, stats, final))
        if final:
            self.done.set()

    def error(self, message, kind="internal"):
        self.errors.append((message, kind))
        self.done.set()

    def is_cancelled(self):
        return self.cancel
