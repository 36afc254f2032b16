"""A cProfile of one headline run (`retrace bench --profile PATH`), in this process or in the system's worker."""

from __future__ import annotations

import time
from pathlib import Path

from retrace.bench.config import HEADLINE
from retrace.bench.systems import System


def profile_run(path: str, systems: list[System], ids, n: int, log) -> dict | None:
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

