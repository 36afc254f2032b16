"""The loop's own time per round, the forwards replayed (not a test).

    python benchmarks/round_host_time.py --engine BUNDLE --target ZOO/target --prompts ZOO/prompts
        [--systems ar,dflash-fixed,retrace-fixed,dflash,retrace] [--batch-sizes 1,8] [--runs 5] [--threads 2]
        [--clock wall|cpu] [--count-ops] [--json F]

`retrace bench` splits a run's wall time into the forwards and the rest, but on a busy machine the forwards
vary run to run more than the rest does. This records every target and drafter call of one run of each
system (the bench's own RetraceSystem over an ONNX Runtime bundle), then times `--runs` runs whose backend
returns the recorded outputs: the time left is the loop's alone (drafting, verify and accept, the suffix
memory, commit and detokenization), per target call as the bench reports it. A replayed call returns fresh
copies of its recorded outputs (in the cache, as a real call's). Every replayed run must give the recorded
tokens. The adaptive policy (`dflash`, `retrace`) chooses K from the round timings: its
replayed runs get the recorded run's timings back from their stopwatch, so they make the same choices.
Each run starts a fresh scheduler (the adaptive policy learns from nothing, as in the recorded run).
--clock cpu: the process's CPU time instead of wall time (on a shared machine, the time the loop itself
ran, not the time it waited for a core). --evict MB: each replayed call also writes over MB of memory (counted
as the forward's time), as a real forward's weights and caches evict the loop's code and data from the CPU
caches: on the zoo pair (a forward streams ~15 MB) the loop's phases then take what they take in a real run
(2-3x the warm replay's; 32 MB measured on a 2-core AMD EPYC, docs/gpu-runtime.md).
--count-ops: also the torch calls the loop makes per target call
(a TorchFunctionMode; one extra replayed run, not timed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the `retrace` CLI sets it, before torch loads libgomp
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from retrace.bench.prompts import load_prompts  # noqa: E402
from retrace.bench.systems import ForwardTimers, RetraceSystem  # noqa: E402
from retrace.runtime import Runtime  # noqa: E402
from retrace.runtime.stopwatch import HostStopwatch  # noqa: E402
from retrace.runtime.tokenizer import TextCodec  # noqa: E402


class Replay:
    """The backend's target/draft either recorded (pass-through) or replayed in call order."""

    def __init__(self, backend):
        self.real = {"target": backend.target, "draft": backend.draft}
        self.calls: dict[str, list] = {"target": [], "draft": []}
        self.at = {"target": 0, "draft": 0}
        self.recording = True
        self.timer, self.spent = time.perf_counter, 0.0  # time inside the replayed calls (by the run's clock)
        self.evict: torch.Tensor | None = None  # written over by each replayed call (--evict)
        backend.target, backend.draft = self._call("target"), self._call("draft")

    def _call(self, name):
        def call(*args, **kwargs):
            if self.recording:
                out = self.real[name](*args, **kwargs)
                self.calls[name].append(out)
                return out
            t0 = self.timer()
            self.at[name] += 1
            with torch._C.DisableTorchFunction():  # the copies are not the loop's calls (--count-ops)
                if self.evict is not None:
                    self.evict.add_(1.0)
                out = warm(self.calls[name][self.at[name] - 1])
            self.spent += self.timer() - t0
            return out
        return call

    def record(self) -> None:
        self.recording = True
        for v in self.calls.values():
            v.clear()
        self.clock.durations.clear()

    def replay(self) -> None:
        self.recording = False
        self.at = {"target": 0, "draft": 0}
        self.clock.at = 0
        self.spent = 0.0

    @property
    def clock(self) -> ReplayClock:
        if not hasattr(self, "_clock"):
            self._clock = ReplayClock(self)
        return self._clock


def warm(out):
    """A recorded call's outputs as fresh copies: just written, in the cache, as a real call's are (the
    recordings themselves are cold: ~100 MB at batch 8; the copy counts as the forward's time)."""
    return tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in out)


class ReplayClock(HostStopwatch):
    """The round's stopwatch: host timers while recording, the recorded durations (in order) while replaying."""

    def __init__(self, replay: Replay):
        self.replay, self.durations, self.at = replay, [], 0

    def seconds(self, start: float, end: float) -> float:
        if self.replay.recording:
            self.durations.append(end - start)
            return self.durations[-1]
        self.at += 1
        return self.durations[self.at - 1]


class TorchCalls(TorchFunctionMode):
    """Counts the torch functions and methods called (attribute reads such as .shape excluded)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") != "__get__":
            self.calls += 1
        return func(*args, **(kwargs or {}))


def fresh_system(base: Runtime, replay: Replay, timers: ForwardTimers, name: str) -> RetraceSystem:
    """A new runtime and scheduler on the shared backend, its stopwatch the replay's."""
    mode, _, fixed = name.partition("-")
    if fixed not in ("", "fixed"):
        raise SystemExit(f"{name}: a system is MODE or MODE-fixed")
    policy = "fixed" if fixed or mode == "ar" else "adaptive"
    rt = Runtime(base.backend, base.codec, block_size=base.block_size, verify_policy=policy, prompt_lookup=False)
    rt.scheduler().clock = replay.clock
    return RetraceSystem(rt, "onnxruntime", mode, timers, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--target", required=True, help="the target's directory (its tokenizer)")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--systems", default="ar,dflash-fixed,retrace-fixed,dflash,retrace",
                    help="MODE (adaptive policy) or MODE-fixed, comma-separated")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="torch threads outside the steps (the bench's setting)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--evict", type=int, default=0, metavar="MB", help="memory each replayed call writes over")
    ap.add_argument("--count-ops", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    codec = TextCodec.find(a.target)
    prompts = [p.ids for p in load_prompts([a.prompts], codec, a.limit)]
    base = Runtime.from_bundle(a.engine)
    replay = Replay(base.backend)
    replay.evict = torch.zeros(a.evict * 2**18) if a.evict else None
    timers = ForwardTimers(base.backend)
    clock = replay.timer = time.process_time if a.clock == "cpu" else time.perf_counter
    results = {"load_avg_start": os.getloadavg()[0], "clock": a.clock, "evict_mb": a.evict}
    for name in a.systems.split(","):
        for b in (int(x) for x in a.batch_sizes.split(",")):
            replay.record()
            want = fresh_system(base, replay, timers, name).run(prompts, a.max_new_tokens, b)
            per_call = []
            for _ in range(a.runs):
                replay.replay()
                system = fresh_system(base, replay, timers, name)
                t0 = clock()
                got = system.run(prompts, a.max_new_tokens, b)
                took = clock() - t0
                if got.outputs != want.outputs:
                    raise SystemExit(f"{name} b{b}: the replayed run gave other tokens")
                per_call.append((took - replay.spent) / got.time["target_calls"])
            row = {"min_ms": 1e3 * min(per_call), "median_ms": 1e3 * statistics.median(per_call),
                   "target_calls": got.time["target_calls"]}
            if a.count_ops:
                replay.replay()
                system = fresh_system(base, replay, timers, name)
                with TorchCalls() as ops:
                    got = system.run(prompts, a.max_new_tokens, b)
                row["torch_calls_per_target_call"] = ops.calls / got.time["target_calls"]
            results[f"{name}@{b}"] = row
            ops_note = (f", {row['torch_calls_per_target_call']:.1f} torch calls" if a.count_ops else "")
            print(f"{name:16s} b{b}: loop-side {row['min_ms']:.3f} ms per target call "
                  f"(median {row['median_ms']:.3f}, {a.runs} runs, {a.clock} clock, evict {a.evict} MB{ops_note})",
                  flush=True)
    results["load_avg_end"] = os.getloadavg()[0]
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
