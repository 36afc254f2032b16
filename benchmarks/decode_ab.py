"""Batch-1 / batch-N decode step of several int4 / int8 bundles and onnxruntime-genai models in ONE process,
call by call interleaved (A B C, B C A, ...), so that a loaded machine slows each system alike (not a test).

    python benchmarks/decode_ab.py --bundle NAME=B1 --bundle NAME=B2[@KEY=VALUE...] [--genai NAME=GENAI_DIR]
        [--gguf NAME=FILE.gguf] [--threads 2] [--context 128] [--batch 1] [--calls 200] [--spinning 0|1] [--rss]

`@KEY=VALUE` after a bundle: an ONNX Runtime session config entry for that system's sessions, except
`@lm_head_session=0|1` (the backend's option: the shared LM head in its own session or in each graph) and
`@fold_layout=0` (the in-place K/V graph with its layout Transposes, retrace.runtime.kv_inplace_layout) and
`@row_invariant=0` (one-token calls at width 1, retrace.runtime.row_invariance).
`--rss`: instead, each system alone in a process of its own (load, 3 + 20 steps): its peak RSS (ru_maxrss).
Prints, per system, the min, the 10th percentile and the median of its step times (ms), and the median
process CPU time per step (all threads; less sensitive to other load than wall time, but it counts
spinning: onnxruntime-genai's sessions spin unboundedly, ours for at most RETRACE_ORT_SPIN_US between
kernels). Ours: one OnnxRuntimeBackend.target call of one new token per row over random caches; onnxruntime-genai:
generate_next_token after a random prompt of --context tokens; llama.cpp (llama-cpp-python, batch 1 only):
Llama.eval of one token after a prompt of --context tokens, the last token's logits.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BACKEND_KEYS = {"lm_head_session", "fold_layout", "row_invariant"}


@contextlib.contextmanager
def _unfolded(fold: bool):
    """The in-place K/V rewrite with its layout Transposes (fold=False) while a backend loads."""
    import retrace.runtime.onnxruntime_backend as orb

    real = orb.to_inplace_kv
    if not fold:
        orb.to_inplace_kv = lambda *a, **k: real(*a, **k, fold_layout=False)
    try:
        yield
    finally:
        orb.to_inplace_kv = real


def _rss(args) -> int:
    """Each system alone in its own process: peak RSS after load and 23 steps."""
    common = ["--threads", str(args.threads), "--context", str(args.context), "--batch", str(args.batch),
              "--calls", "20", *([] if args.spinning is None else ["--spinning", str(args.spinning)])]
    for flag, specs in (("--bundle", args.bundle), ("--genai", args.genai), ("--gguf", args.gguf)):
        for spec in specs:
            out = subprocess.run([sys.executable, __file__, flag, spec, *common], capture_output=True, text=True,
                                 check=True).stdout
            rss = next(ln for ln in out.splitlines() if ln.startswith("peak RSS"))
            print(f"{spec.split('=', 1)[0]:24s} {rss}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", action="append", default=[])
    ap.add_argument("--genai", action="append", default=[])
    ap.add_argument("--gguf", action="append", default=[], help="NAME=FILE.gguf: llama.cpp (batch 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--spinning", type=int, default=None,
                    help="our sessions' session.intra_op.allow_spinning (default: the runtime's, ort_spinning.py)")
    ap.add_argument("--rss", action="store_true", help="peak RSS of each system alone in its own process")
    args = ap.parse_args(argv)
    if args.rss:
        return _rss(args)
    import numpy as np
    import torch

    from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

    steps = {}
    n, c = args.batch, args.context
    for spec in args.bundle:
        name, d = spec.split("=", 1)
        d, *opts = d.split("@")
        spin = {} if args.spinning is None else {"session.intra_op.allow_spinning": str(args.spinning)}
        options = spin | dict(o.split("=", 1) for o in opts)
        kw = {k: options.pop(k) not in ("0", "false") for k in BACKEND_KEYS & set(options)}
        with _unfolded(kw.pop("fold_layout", True)):
            be = OnnxRuntimeBackend.from_bundle(d, max_batch=n, threads=args.threads, verify=False,
                                                max_seq_len=c + 64, session_options=options, **kw)
        be.tcache.kv.normal_(0, 1)
        v = be.target_config.vocab_size
        steps[name] = (lambda be=be, v=v: be.target(torch.arange(n), torch.randint(0, v // 2, (n, 1)),
                                                      torch.full((n, 1), c), torch.zeros(n, 1, dtype=torch.int64)))
    gens = []
    for spec in args.genai:
        import onnxruntime_genai as og

        from retrace.bench.builds import genai_run_copy

        name, d = spec.split("=", 1)
        # at --threads, whatever the directory's own config says (a builder's base config leaves ONNX
        # Runtime's default: one thread per physical core)
        run_dir = tempfile.TemporaryDirectory(prefix="genai-ab-")  # removed when the process ends
        model = og.Model(str(genai_run_copy(Path(d), Path(run_dir.name), args.threads)))
        gens.append(run_dir)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=c + args.calls + 8, do_sample=False, batch_size=n)
        gen = og.Generator(model, params)
        gen.append_tokens(np.random.default_rng(0).integers(0, 1000, (n, c), dtype=np.int32))
        gens.append((model, params, gen))
        steps[name] = gen.generate_next_token
    for spec in args.gguf:
        import llama_cpp

        if n != 1:
            raise SystemExit("--gguf: llama-cpp-python decodes one sequence (--batch 1)")
        name, f = spec.split("=", 1)
        llm = llama_cpp.Llama(f, n_ctx=c + args.calls + 16, n_batch=512, n_threads=args.threads,
                              n_threads_batch=args.threads, verbose=False)
        llm.eval([(7 + 31 * i) % 1000 for i in range(c)])
        gens.append(llm)
        steps[name] = lambda llm=llm: llm.eval([11])
    times = {k: [] for k in steps}
    cpu = {k: [] for k in steps}
    for k in steps:  # warm-up
        for _ in range(3):
            steps[k]()
    names = list(steps)
    for i in range(args.calls):
        # each round starts one system later (A B C, B C A, ...): no system always runs right after the same
        # one (onnxruntime-genai's workers keep spinning after its call returns and slow whoever comes next)
        for k in names[i % len(names):] + names[:i % len(names)]:
            f = steps[k]
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    print(f"batch {n}, context {c}, threads {args.threads}, {args.calls} calls each, load {os.getloadavg()[0]:.1f}")
    for k, ts in times.items():
        ts = sorted(x * 1e3 for x in ts)
        print(f"{k:24s} min {ts[0]:7.2f}  p10 {ts[len(ts) // 10]:7.2f}  median {statistics.median(ts):7.2f} ms"
              f" | process CPU median {statistics.median(cpu[k]) * 1e3:7.2f} ms")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9:.3f} GB (this process)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
