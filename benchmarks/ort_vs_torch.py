"""ONNX Runtime bundle vs the torch backend (not a test).

    python benchmarks/ort_vs_torch.py [--target DIR --drafter DIR | --bundle B] [--threads 2]
                                      [--max-new-tokens 128] [--prompts 8] [--json out.json]

1. Per call (batch 1, the shapes of a round): target decode (T=1), verify (T=16), drafter round (B=16,
   16 new context tokens), at past lengths 128 and 1024 in caches of max_seq_len 2048, for
     torch            the torch backend (retrace.runtime.torch_backend),
     ort inplace      the ORT backend's default on the CPU: K/V written in place (runtime/kv_inplace.py),
     ort gather       the portable graph: the needed past gathered into a dense staging buffer,
     ort full         the ORT backend binding whole per-slot caches (no copy, attends over max_seq_len),
     ort sess.run     a plain `InferenceSession.run` with numpy feeds (no IO binding), same past as gather,
   and the share of an ORT call spent gathering the past.
2. End to end: tokens/s of ar / dflash / retrace (greedy) at batch 1 (each prompt in turn) and at batch N
   (all prompts together) on both backends, with the loop's split (prefill / draft / verify / other), tau,
   and with ORT's intra-op spinning turned back on (the backend turns it off).
The pair: --target/--drafter, else ./zoo-small-target-check when present, else a random ~6.8M-parameter pair
(benchmarks/onnx_attention.py's). A random drafter is almost never accepted (tau ~1): with it, dflash and
retrace rows measure the cost of a round, not a speed-up.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from onnx_attention import random_pair  # noqa: E402

from retrace.export.build import BuildOptions, build_bundle  # noqa: E402
from retrace.runtime import Runtime, SamplingParams  # noqa: E402
from retrace.runtime.modes import MODES  # noqa: E402
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402
from retrace.runtime.torch_backend import TorchBackend  # noqa: E402

ZOO = Path(__file__).resolve().parents[1] / "zoo-small-target-check"
MAX_SEQ = 2048


def timeit(fn, seconds: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def per_call(backends: dict, seconds: float, reps: int) -> dict:
    """ms per backend call at batch 1 (slot 0), past P, in a cache of MAX_SEQ."""
    any_be = next(iter(backends.values()))
    tc, dc = any_be.target_config, any_be.drafter_config
    kd = dc.num_taps * tc.hidden_size
    slot = torch.tensor([0])
    cases = {}
    for P in (128, 1024):
        for T in (1, 16):
            ids = torch.randint(0, tc.vocab_size - 1, (1, T))
            pos = (P + torch.arange(T)).unsqueeze(0)
            li = torch.arange(T).unsqueeze(0)
            cases[f"target T={T} P={P}"] = ("target", (slot, ids, pos, li))
        B = 16
        ctx = torch.randn(1, 16, kd)
        cpos = (P + torch.arange(16)).unsqueeze(0)
        bpos = (P + 4 + torch.arange(B)).unsqueeze(0)
        block = torch.full((1, B), dc.mask_token_id)
        cases[f"draft B=16 C=16 P={P}"] = ("draft", (slot, ctx, cpos, block, bpos, None))
    out: dict = {name: {} for name in cases}
    for _ in range(reps):
        for name, (fn, args) in cases.items():
            for bname, be in backends.items():
                ms = timeit(lambda be=be, fn=fn, args=args: getattr(be, fn)(*args), seconds)
                out[name][bname] = min(out[name].get(bname, np.inf), ms)
    # the same target calls as a plain session.run (numpy in, numpy out), and the gather's share
    ort_be = backends.get("ort gather")
    if ort_be is not None:
        g = ort_be.tgraph
        for name, (fn, args) in cases.items():
            if fn != "target":
                continue
            slot_, ids, pos, li = args
            past = ort_be.tcache.past(slot_, int(pos[0, 0]), "gather")
            feed = {"input_ids": ids.numpy(), "position_ids": pos.numpy(), "past_len": pos[:, 0].numpy(),
                    "logits_index": li.numpy(),
                    **{n: p.numpy().copy() for n, p in zip(g.past_names, past, strict=True)}}
            out[name]["ort sess.run"] = min(timeit(lambda feed=feed: g.sess.run(None, feed), seconds)
                                            for _ in range(reps))
            out[name]["gather only"] = timeit(lambda a=slot_, p=int(pos[0, 0]): ort_be.tcache.past(a, p, "gather"),
                                              seconds)
    return out


def end_to_end(make_rt, prompts, max_new: int, batch_all: bool) -> dict:
    res = {}
    for mode in MODES:
        rt = make_rt()
        params = SamplingParams(max_new_tokens=max_new)
        rt.generate([prompts[0]], SamplingParams(max_new_tokens=8), mode)  # warm-up
        rt.reset_stats()
        if batch_all:
            rt.generate(prompts, params, mode)
        else:
            for p in prompts:
                rt.generate([p], params, mode)
        st = rt.run_stats()
        t = st["time"]
        res[mode] = {"tokens_per_s": st["tokens_per_s"], "tau": st["tau"], "rounds": st["rounds"],
                     "split_s": {k: round(t[f"{k}_s"], 3) for k in ("prefill", "draft", "verify", "other")},
                     "wall_s": round(t["wall_s"], 3)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--bundle", help="an existing bundle of --target/--drafter (skips the build)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=0.4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-per-call", action="store_true")
    ap.add_argument("--skip-end-to-end", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="ort-vs-torch-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    if a.target:
        tdir, ddir = Path(a.target), Path(a.drafter)
    elif (ZOO / "target").is_dir():
        tdir, ddir = ZOO / "target", ZOO / "drafter"
    else:
        tdir, ddir = random_pair(tmp / "pair")
    bundle = Path(a.bundle) if a.bundle else tmp / "bundle"
    if not a.bundle:
        t0 = time.perf_counter()
        build_bundle(BuildOptions(tdir, ddir, bundle, max_batch=max(8, a.prompts), max_seq_len=MAX_SEQ))
        print(f"bundle built in {time.perf_counter() - t0:.1f} s")
    report: dict = {"pair": [str(tdir), str(ddir)], "threads": a.threads}

    def ort_be(**kw):
        return OnnxRuntimeBackend.from_bundle(bundle, threads=a.threads, verify=False, **kw)

    if not a.skip_per_call:
        backends = {"torch": TorchBackend.from_dirs(tdir, ddir, max_batch=8, max_seq_len=MAX_SEQ),
                    "ort inplace": ort_be(max_batch=8), "ort gather": ort_be(max_batch=8, kv_mode="gather"),
                    "ort full": ort_be(max_batch=8, kv_mode="full")}
        pc = per_call(backends, a.seconds, a.reps)
        report["per_call_ms"] = pc
        cols = ["torch", "ort inplace", "ort gather", "ort full", "ort sess.run", "gather only"]
        w = max(map(len, pc))
        print(f"\nper call, batch 1, ms (max_seq_len {MAX_SEQ}, {a.threads} threads)")
        print(f"{'':{w}}" + "".join(f"{c:>14}" for c in cols))
        for name, row in pc.items():
            print(f"{name:{w}}" + "".join(f"{row[c]:>14.3f}" if c in row else f"{'-':>14}" for c in cols))

    if a.skip_end_to_end:
        if a.json:
            Path(a.json).write_text(json.dumps(report, indent=2))
        return 0
    g = torch.Generator().manual_seed(0)
    vocab = backends["torch"].target_config.vocab_size if not a.skip_per_call else \
        ort_be(max_batch=1).target_config.vocab_size
    prompts = [torch.randint(0, vocab - 1, (a.prompt_len + 3 * i,), generator=g).tolist() for i in range(a.prompts)]
    runs = {
        "torch": lambda: Runtime.from_dirs(tdir, ddir, max_batch=max(8, a.prompts), max_seq_len=MAX_SEQ,
                                           threads=a.threads),
        "onnxruntime": lambda: Runtime(ort_be(max_batch=max(8, a.prompts))),
        "onnxruntime (spinning)": lambda: Runtime(ort_be(max_batch=max(8, a.prompts), session_options={
            "session.intra_op.allow_spinning": "1"})),
    }
    report["end_to_end"] = {}
    for batch_all in (False, True):
        label = f"batch {a.prompts}" if batch_all else "batch 1"
        print(f"\nend to end, {label}, {a.prompts} prompts x {a.max_new_tokens} new tokens, greedy")
        print(f"{'backend':24}{'mode':9}{'tok/s':>9}{'tau':>6}  split s (prefill/draft/verify/other)")
        for bname, make in runs.items():
            r = end_to_end(make, prompts, a.max_new_tokens, batch_all)
            report["end_to_end"][f"{bname} / {label}"] = r
            for mode, x in r.items():
                s = x["split_s"]
                print(f"{bname:24}{mode:9}{x['tokens_per_s']:>9.1f}{x['tau']:>6.2f}  "
                      f"{s['prefill']:.2f}/{s['draft']:.2f}/{s['verify']:.2f}/{s['other']:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
