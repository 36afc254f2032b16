"""The report: sections run one by one, each in try/except, the JSON rewritten after every section."""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path


def _clean(obj):
    """JSON-safe: non-finite floats -> None, tuples -> lists, unknown objects -> str."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


class Report:
    def __init__(self, path: Path, settings: dict, render: Callable[[dict], str] | None = None):
        """`render(data)` -> the Markdown report, written beside the JSON at every write."""
        self.path = Path(path)
        self.render = render
        self.data: dict = {"settings": settings, "sections": {}, "started_unix": int(time.time())}
        self.t0 = time.perf_counter()
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_clean(self.data), indent=1) + "\n")
        tmp.replace(self.path)
        if self.render is not None:
            try:
                self.path.with_suffix(".md").write_text(self.render(self.data))
            except Exception as e:  # noqa: BLE001 - the JSON is what matters
                self.path.with_suffix(".md").write_text(f"report rendering failed: {type(e).__name__}: {e}\n")

    def run(self, name: str, fn: Callable[[dict], None]) -> None:
        """fn(result) fills `result` as it goes (partial results survive an exception)."""
        log(f"== {name}: start")
        t = time.perf_counter()
        result: dict = {}
        sec = self.data["sections"][name] = {"status": "running", "result": result}
        self.write()
        try:
            fn(result)
            sec["status"] = "ok"
        except BaseException as e:  # noqa: BLE001 - recorded; KeyboardInterrupt/SystemExit re-raised below
            sec["status"] = "error"
            sec["error"] = f"{type(e).__name__}: {e}"
            sec["traceback"] = traceback.format_exc()[-6000:]
            log(f"== {name}: ERROR {sec['error']}\n{sec['traceback']}")
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
        finally:
            sec["elapsed_s"] = round(time.perf_counter() - t, 2)
            self.write()
        log(f"== {name}: {sec['status']} in {sec['elapsed_s']:.1f}s")

    def skip(self, name: str, why: str) -> None:
        self.data["sections"][name] = {"status": "skipped", "reason": why}
        log(f"== {name}: skipped ({why})")
        self.write()


def log(msg: str) -> None:
    print(f"[gpucheck {time.strftime('%H:%M:%S')}] {msg}", flush=True)
    sys.stdout.flush()
