"""Per-op-type kernel time of one decode step: our bundle's target graph (as the ONNX Runtime backend runs it:
in-place K/V, the LM head in its own session where it is cut) against an onnxruntime-genai model, both with
ONNX Runtime's own profiler (SessionOptions.enable_profiling) at the same threads and context (not a test).

    python benchmarks/op_profile.py --bundle NAME=B-int4[@row_invariant=0] [--genai GENAI_MODEL_DIR] [--threads 2]
        [--context 128] [--steps 16] [--batch 1] [--spinning 0|1] [--json F]

--spinning sets our sessions' session.intra_op.allow_spinning (default: the runtime's bounded spinning);
onnxruntime-genai keeps ONNX Runtime's default (spinning on: its config has no key for it).

Each system runs in its own process; only the kernels of the last `--steps` runs are counted, per run.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path


def _profile_table(files: list[str], runs: int) -> dict:
    """{op type: [kernels per run, ms per run]} over the last `runs` model_run events of each profile file,
    plus the wall time of those runs ("model_run")."""
    table = collections.defaultdict(lambda: [0.0, 0.0])
    for f in files:
        events = json.loads(Path(f).read_text())
        model_runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[-runs:]
        if not model_runs:
            continue
        t0 = model_runs[0]["ts"]
        table["model_run"][0] += len(model_runs) / runs
        table["model_run"][1] += sum(e["dur"] for e in model_runs) / 1e3 / runs
        for e in events:
            if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < t0:
                continue
            op = e.get("args", {}).get("op_name", "?")
            table[op][0] += 1 / runs
            table[op][1] += e["dur"] / 1e3 / runs
    return {k: [round(v[0], 2), round(v[1], 3)] for k, v in table.items()}


def _ours(bundle: str, args, out_dir: str) -> dict:
    import torch

    import retrace.runtime.onnxruntime_backend as ob

    made = []
    plain = ob._session_options

    def profiled(threads, entries):
        so = plain(threads, entries)
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(out_dir, f"ours{len(made)}")
        made.append(so)
        return so

    ob._session_options = profiled
    entries = {} if args.spinning is None else {"session.intra_op.allow_spinning": str(args.spinning)}
    bundle, _, option = bundle.partition("@")  # DIR@row_invariant=0: retrace.runtime.row_invariance off
    be = ob.OnnxRuntimeBackend.from_bundle(bundle, max_batch=args.batch, threads=args.threads, verify=False,
                                           max_seq_len=args.context + 64, session_options=entries,
                                           row_invariant=option != "row_invariant=0")
    be.tcache.kv.normal_(0, 1)
    slots = torch.arange(args.batch)
    vocab = be.target_config.vocab_size
    times = []
    for _ in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        be.target(slots, torch.randint(0, vocab // 2, (args.batch, 1)), torch.full((args.batch, 1), args.context),
                  torch.zeros(args.batch, 1, dtype=torch.int64))
        times.append(time.perf_counter() - t0)
    files = [be.tgraph.sess.end_profiling()]
    if be.head is not None:
        files.append(be.head.sess.end_profiling())
    return {"ops": _profile_table(files, args.steps), "step_ms": sorted(times[args.warmup:])[args.steps // 2] * 1e3}


def _genai(model_dir: str, args, out_dir: str) -> dict:
    import numpy as np
    import onnxruntime_genai as og

    d = Path(out_dir) / "genai_model"
    d.mkdir()
    for f in Path(model_dir).iterdir():
        if f.name != "genai_config.json":
            os.link(f, d / f.name) if f.stat().st_dev == d.stat().st_dev else shutil.copy(f, d / f.name)
    cfg = json.loads((Path(model_dir) / "genai_config.json").read_text())
    so = cfg["model"]["decoder"]["session_options"]
    so.update(intra_op_num_threads=args.threads, inter_op_num_threads=1,
              enable_profiling=os.path.join(out_dir, "genai"))
    (d / "genai_config.json").write_text(json.dumps(cfg))
    model = og.Model(str(d))
    params = og.GeneratorParams(model)
    n = args.warmup + args.steps
    params.set_search_options(max_length=args.context + n + 4, do_sample=False, batch_size=args.batch)
    gen = og.Generator(model, params)
    gen.append_tokens(np.random.default_rng(0).integers(0, 1000, (args.batch, args.context), dtype=np.int32))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        gen.generate_next_token()
        times.append(time.perf_counter() - t0)
    del gen, params, model  # the profile file is written when the session closes
    files = sorted(str(p) for p in Path(out_dir).glob("genai*.json"))
    return {"ops": _profile_table(files, args.steps), "step_ms": sorted(times[args.warmup:])[args.steps // 2] * 1e3}


def _worker(conn, kind, where, args):
    with tempfile.TemporaryDirectory() as out_dir:
        try:
            conn.send((_ours if kind == "ours" else _genai)(where, args, out_dir))
        except Exception as e:  # noqa: BLE001 - reported as the system's row
            conn.send({"error": f"{type(e).__name__}: {e}", "ops": {}, "step_ms": float("nan")})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", action="append", default=[], help="NAME=BUNDLE_DIR")
    ap.add_argument("--genai", action="append", default=[], help="NAME=MODEL_DIR")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--spinning", type=int, default=None, help="default: the runtime's (ort_spinning.py)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    result = {"load_1min": os.getloadavg()[0], "threads": args.threads, "context": args.context,
              "batch": args.batch, "spinning": args.spinning, "systems": {}}
    for kind, specs in (("ours", args.bundle), ("genai", args.genai)):
        for spec in specs:
            name, where = spec.split("=", 1)
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(b, kind, where, args))
            p.start()
            result["systems"][name] = a.recv()
            p.join()
    ops = sorted({k for s in result["systems"].values() for k in s["ops"]})
    names = list(result["systems"])
    print("op type".ljust(34) + "".join(f"{n[:20]:>24s}" for n in names))
    for op in sorted(ops, key=lambda o: -max(s["ops"].get(o, [0, 0])[1] for s in result["systems"].values())):
        cells = [result["systems"][n]["ops"].get(op) for n in names]
        print(op.ljust(34) + "".join(f"{c[0]:>10.0f} {c[1]:>8.3f} ms" if c else " " * 24 for c in cells))
    print("step wall ms".ljust(34) + "".join(f"{result['systems'][n]['step_ms']:>24.2f}" for n in names))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
