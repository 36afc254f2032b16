"""The loop's own time per round, the forwards replayed (not a test).

    python benchmarks/round_host_time.py --engine BUNDLE --target ZOO/target --prompts ZOO/prompts
        [--systems ar,dflash-fixed,retrace-fixed] [--batch-sizes 1,8] [--runs 5] [--threads 2] [--json F]

`retrace bench` splits a run's wall time into the forwards and the rest, but on a busy machine the forwards
vary run to run more than the rest does. This records every target and drafter call of one run of each
system (the bench's own RetraceSystem over an ONNX Runtime bundle), then times `--runs` runs whose backend
returns the recorded outputs: the time left is the loop's alone (drafting, verify and accept, the suffix
memory, commit and detokenization), per target call as the bench reports it. Every replayed run must
give the recorded tokens. Only policies whose rounds do not depend on timings (ar, fixed) can be replayed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `retrace` CLI sets it, before torch loads libgomp
import torch  # noqa: E402

from retrace.bench.prompts import load_prompts
from retrace.bench.systems import ForwardTimers, RetraceSystem
from retrace.runtime import Runtime
from retrace.runtime.tokenizer import TextCodec


class Replay:
    """The backend's target/draft either recorded (pass-through) or replayed in call order."""

    def __init__(self, backend):
        self.real = {"target": backend.target, "draft": backend.draft}
        self.calls: dict[str, list] = {"target": [], "draft": []}
        self.at = {"target": 0, "draft": 0}
        self.recording = True
        backend.target, backend.draft = self._call("target"), self._call("draft")

    def _call(self, name):
        def call(*args, **kwargs):
            if self.recording:
                out = self.real[name](*args, **kwargs)
                self.calls[name].append(out)
                return out
            self.at[name] += 1
            return self.calls[name][self.at[name] - 1]
        return call

    def record(self) -> None:
        self.recording = True
        for v in self.calls.values():
            v.clear()

    def replay(self) -> None:
        self.recording = False
        self.at = {"target": 0, "draft": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--target", required=True, help="the target's directory (its tokenizer)")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--systems", default="ar,dflash-fixed,retrace-fixed", help="MODE or MODE-fixed, comma-separated")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads outside the steps (the bench's setting)")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    codec = TextCodec.find(a.target)
    prompts = [p.ids for p in load_prompts([a.prompts], codec, a.limit)]
    base = Runtime.from_bundle(a.engine)
    replay = Replay(base.backend)
    timers = ForwardTimers(base.backend)
    results = {}
    for name in a.systems.split(","):
        mode, _, fixed = name.partition("-")
        if mode != "ar" and fixed != "fixed":
            raise SystemExit(f"{name}: only ar and fixed-policy systems can be replayed (adaptive K follows timings)")
        rt = Runtime(base.backend, base.codec, block_size=base.block_size, verify_policy="fixed")
        system = RetraceSystem(rt, "onnxruntime", mode, timers, name)
        for b in (int(x) for x in a.batch_sizes.split(",")):
            replay.record()
            want = system.run(prompts, a.max_new_tokens, b)
            per_call = []
            for _ in range(a.runs):
                replay.replay()
                got = system.run(prompts, a.max_new_tokens, b)
                if got.outputs != want.outputs:
                    raise SystemExit(f"{name} b{b}: the replayed run gave other tokens")
                per_call.append((got.wall_s - got.time["forward_s"]) / got.time["target_calls"])
            results[f"{name}@{b}"] = {"min_ms": 1e3 * min(per_call), "median_ms": 1e3 * statistics.median(per_call),
                                      "target_calls": got.time["target_calls"]}
            print(f"{name:16s} b{b}: loop-side {1e3 * min(per_call):.3f} ms per target call "
                  f"(median {1e3 * statistics.median(per_call):.3f}, {a.runs} runs)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
