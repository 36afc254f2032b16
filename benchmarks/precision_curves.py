"""Decode, prefill, T-token forward cost and peak RSS of our fp32 / int8 / int4 bundles against
onnxruntime-genai int4 / int8 and llama.cpp Q4_K_M / Q8_0 (not a test).

    python benchmarks/precision_curves.py --target HF_DIR --bundle fp32=B1 --bundle int4=B2 [--bundle int8=B3]
        [--genai int4 --genai int8] [--gguf q4_k_m=F.gguf] [--threads 2] [--rounds 3] [--context 128]
        [--tokens 1,2,4,8,16] [--batches 1,4] [--cache-dir D] [--json F]

`--bundle NAME=DIR@KEY=VALUE[@KEY=VALUE]`: ONNX Runtime session config entries for that system's sessions
(e.g. `@session.intra_op.allow_spinning=1@session.force_spinning_stop=1`), except `@row_invariant=0`: the
backend's calls at their own widths (retrace.runtime.row_invariance).
Every system lives in its own worker process (its peak RSS is that process's ru_maxrss after its load and
all its measurements); the rounds interleave the systems, each figure is the median over rounds of the
median of `--steps` calls in a round.
- decode: one step of one new token per row after `--context` tokens (ours: the caches filled with random
  values, one row of logits; onnxruntime-genai: after a random prompt of that length, generate_next_token;
  llama.cpp: eval of one token after the prompt, its last-token logits).
- prefill: `--context` new tokens at batch 1 with the last token's logits (ours and llama.cpp), or
  onnxruntime-genai's append_tokens of the prompt.
- T-curve (ours and llama.cpp with logits_all, what a verify needs): T new tokens after the context with
  logits at every one of them, relative to T = 1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import time
from pathlib import Path


def _median_time(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Ours:
    def __init__(self, bundle: str, threads: int, max_len: int, max_batch: int):
        import torch

        from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

        self.torch = torch
        bundle, *opts = bundle.split("@")  # NAME=DIR@KEY=VALUE...: session config entries for this system
        entries = dict(o.split("=", 1) for o in opts)
        invariant = entries.pop("row_invariant", "1") not in ("0", "false")  # retrace.runtime.row_invariance
        self.be = OnnxRuntimeBackend.from_bundle(bundle, max_batch=max_batch, threads=threads, verify=False,
                                                 max_seq_len=max_len, session_options=entries or None,
                                                 row_invariant=invariant)
        self.be.tcache.kv.normal_(0, 1)
        self.vocab = self.be.target_config.vocab_size

    def decode(self, batch: int, context: int):
        t = self.torch
        slots = t.arange(batch)
        return lambda: self.be.target(slots, t.randint(0, self.vocab // 2, (batch, 1)),
                                      t.full((batch, 1), context), t.zeros(batch, 1, dtype=t.int64))

    def prefill(self, context: int):
        t = self.torch
        ids = t.randint(0, self.vocab // 2, (1, context))
        return lambda: self.be.target(t.tensor([0]), ids, t.arange(context).unsqueeze(0), t.tensor([[context - 1]]))

    def forward(self, tokens: int, context: int):
        t = self.torch
        ids = t.randint(0, self.vocab // 2, (1, tokens))
        return lambda: self.be.target(t.tensor([0]), ids, context + t.arange(tokens).unsqueeze(0),
                                      t.arange(tokens).unsqueeze(0))


class Genai:
    def __init__(self, model_dir: str, threads: int):
        import numpy as np
        import onnxruntime_genai as og

        self.og, self.np = og, np
        self.model = og.Model(model_dir)

    def _gen(self, batch: int, context: int, steps: int):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=context + steps + 4, do_sample=False, batch_size=batch)
        gen = self.og.Generator(self.model, params)
        return gen, self.np.random.default_rng(context).integers(0, 1000, (batch, context), dtype=self.np.int32)

    def decode(self, batch: int, context: int, steps: int) -> float:
        gen, prompt = self._gen(batch, context, steps + 1)
        gen.append_tokens(prompt)
        gen.generate_next_token()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            gen.generate_next_token()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def prefill(self, context: int, steps: int) -> float:
        times = []
        for _ in range(steps + 1):
            gen, prompt = self._gen(1, context, 1)
            t0 = time.perf_counter()
            gen.append_tokens(prompt)
            times.append(time.perf_counter() - t0)
            del gen
        return statistics.median(times[1:])


class LlamaCpp:
    """Built with logits_all (its scores buffer); each eval asks for the logits it needs: the last token's for
    decode and prefill (as ours), every position's for the T-token forward (what a verify reads)."""

    def __init__(self, gguf: str, threads: int, max_len: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(gguf, n_ctx=max_len, n_batch=512, n_threads=threads, n_threads_batch=threads,
                                   logits_all=True, verbose=False)

    def _prompt(self, context: int):
        return [(7 + 31 * i) % 1000 for i in range(context)]

    def _eval(self, tokens, all_logits: bool = False):
        self.llm._logits_all = all_logits  # llama-cpp-python's per-eval switch (batch logits flags)
        self.llm.eval(tokens)

    def decode(self, context: int, steps: int) -> float:
        self.llm.reset()
        self._eval(self._prompt(context))
        times = []
        for i in range(steps + 1):
            self.llm.n_tokens = context  # eval drops the cache past n_tokens: the same context every step
            t0 = time.perf_counter()
            self._eval([11 + i])
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    def prefill(self, context: int, steps: int) -> float:
        def run():
            self.llm.reset()
            self._eval(self._prompt(context))
        return _median_time(run, steps)

    def forward(self, tokens: int, context: int, steps: int) -> float:
        self.llm.reset()
        self._eval(self._prompt(context))
        times = []
        for _ in range(steps + 1):
            self.llm.n_tokens = context
            t0 = time.perf_counter()
            self._eval([5 + j for j in range(tokens)], all_logits=True)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])


def worker(conn, kind: str, where: str, args) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    max_len = args.context + max(args.tokens) + 64
    sys_ = (Ours(where, args.threads, max_len, max(args.batches)) if kind == "ours" else
            Genai(where, args.threads) if kind == "genai" else LlamaCpp(where, args.threads, max_len))
    conn.send("ready")
    while conn.recv() != "stop":
        out = {}
        s, c = args.steps, args.context
        if kind == "ours":
            for b in args.batches:
                out[f"decode_b{b}"] = _median_time(sys_.decode(b, c), s)
            out["prefill"] = _median_time(sys_.prefill(c), max(2, s // 4))
            for t in args.tokens:
                out[f"T{t}"] = _median_time(sys_.forward(t, c), s)
        elif kind == "genai":
            for b in args.batches:
                out[f"decode_b{b}"] = sys_.decode(b, c, s)
            out["prefill"] = sys_.prefill(c, max(2, s // 4))
        else:
            out["decode_b1"] = sys_.decode(c, s)
            out["prefill"] = sys_.prefill(c, max(2, s // 4))
            for t in args.tokens:
                out[f"T{t}"] = sys_.forward(t, c, s)
        out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        conn.send(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=False)
    ap.add_argument("--bundle", action="append", default=[], help="NAME=BUNDLE_DIR (ours)")
    ap.add_argument("--genai", action="append", default=[], help="int4, int8 or int4:BLOCK: onnxruntime-genai "
                                                                  "builder model of --target (cached)")
    ap.add_argument("--gguf", action="append", default=[], help="NAME=FILE.gguf (llama.cpp)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--tokens", default="1,2,4,8,16")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.tokens = [int(x) for x in args.tokens.split(",")]
    args.batches = [int(x) for x in args.batches.split(",")]
    systems = [(f"retrace {n}", "ours", d) for n, d in (b.split("=", 1) for b in args.bundle)]
    if args.genai:
        from retrace.bench.builds import build_genai_model, default_cache_dir

        cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
        for p in args.genai:
            d, _ = build_genai_model(args.target, cache, args.threads, p)
            systems.append((f"ortgenai {p}", "genai", str(d)))
    systems += [(f"llama.cpp {n}", "llamacpp", f) for n, f in (g.split("=", 1) for g in args.gguf)]
    ctx = mp.get_context("spawn")
    procs = {}
    for name, kind, where in systems:  # started one at a time: a lower peak while each loads
        a, b = ctx.Pipe()
        p = ctx.Process(target=worker, args=(b, kind, where, args), daemon=True)
        p.start()
        assert a.recv() == "ready"
        procs[name] = (p, a)
    rows: dict[str, list[dict]] = {n: [] for n in procs}
    for r in range(args.rounds):
        order = list(procs)[r % len(procs):] + list(procs)[: r % len(procs)]
        for name in order:
            procs[name][1].send("go")
            rows[name].append(procs[name][1].recv())
        print(f"round {r + 1}/{args.rounds} done (load {os.getloadavg()[0]:.1f})", flush=True)
    for p, a in procs.values():
        a.send("stop")
        p.join(timeout=30)
    result = {"load_1min": os.getloadavg()[0], "threads": args.threads, "context": args.context, "systems": {}}
    for name, rs in rows.items():
        med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
        med["peak_rss_gb"] = max(x["peak_rss_gb"] for x in rs)
        result["systems"][name] = med
        curve = {t: med[f"T{t}"] / med["T1"] for t in args.tokens if f"T{t}" in med} if "T1" in med else {}
        dec = " ".join(f"b{b} {med[f'decode_b{b}'] * 1e3:.1f}" for b in args.batches if f"decode_b{b}" in med)
        print(f"{name:22s} decode ms/step {dec} | prefill {med['prefill'] * 1e3:.0f} ms | peak RSS "
              f"{med['peak_rss_gb']:.2f} GB | T-curve " + " ".join(f"{t}:{v:.2f}" for t, v in curve.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
