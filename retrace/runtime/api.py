"""The embeddable runtime: build from model directories or an engine bundle, then generate or stream."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from retrace.errors import MissingDependencyError, RetraceError
from retrace.runtime.backend import Backend
from retrace.runtime.device import resolve_device
from retrace.runtime.loop import MODES, Event, Request, Scheduler
from retrace.runtime.options import DIRS_MAX_BATCH, DIRS_MAX_SEQ_LEN, RuntimeOptions
from retrace.runtime.sampling_params import SamplingParams
from retrace.runtime.stats import AcceptStats
from retrace.runtime.tokenizer import TextCodec

# backend name -> "module:Class" (imported only when asked for; only backends know their engine)
BUNDLE_BACKENDS = {
    "onnxruntime": "retrace.runtime.onnxruntime_backend:OnnxRuntimeBackend",
    "tensorrt": "retrace.runtime.tensorrt_backend:TensorRTBackend",
}
# where a bundle backend runs (device type), and whether it takes a `device` argument
BUNDLE_DEVICES = {"onnxruntime": ("cpu", False), "tensorrt": ("cuda", True)}


def _bundle_device(backend: str, device, dtype) -> dict:
    """The backend keyword arguments for device= / dtype= given to from_bundle (checked)."""
    if dtype is not None:
        raise RetraceError("a bundle's dtype is fixed when it is built (retrace-export build --dtype); --dtype "
                           "applies to --target/--drafter")
    if device is None or backend not in BUNDLE_DEVICES:
        return {}
    dev = resolve_device(device)
    kind, takes = BUNDLE_DEVICES[backend]
    if dev.type != kind:
        raise RetraceError(f"the {backend} backend runs on {kind}, not {dev}; for --device {dev} run the torch "
                           "backend (--target/--drafter)" if kind == "cpu" else
                           f"the {backend} backend runs on {kind}, not {dev}")
    return {"device": str(dev)} if takes else {}


def _load_backend_class(name: str):
    if name not in BUNDLE_BACKENDS:
        raise RetraceError(f"unknown backend {name!r} for a bundle (choose from {', '.join(BUNDLE_BACKENDS)})")
    module, cls = BUNDLE_BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise MissingDependencyError(f"backend {name!r} is not available: {e}") from None


@dataclass
class Result:
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stats: dict
    error: str | None = None  # finish_reason "error": why this request failed alone (the others went on)


class Runtime:
    def __init__(self, backend: Backend, codec: TextCodec | None = None, options: RuntimeOptions | None = None,
                 **option_kwargs):
        """options: how it runs (runtime/options.py: block size, verify policy, draft tree, prompt lookup);
        keyword arguments of the same names (block_size=, verify_policy=, ...) build or change one; checked
        against the backend now."""
        self.options = RuntimeOptions.of(options, **option_kwargs)
        self.options.block_size_for(backend)  # fails now, not at the first request
        self.backend = backend
        self.codec = codec
        self._sched: Scheduler | None = None  # made at first use (from the backend then: tests wrap it)
        # events of requests being streamed, not yet yielded: a step run on behalf of one stream (or of
        # generate) commits tokens for every request, and the other streams must still see theirs
        self._pending: dict[int, list[Event]] = {}

    @property
    def block_size(self) -> int | None:
        """The block size asked for (None: the drafter's; the scheduler's block_size is the one in use)."""
        return self.options.block_size

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_dirs(cls, target_dir: str | Path, drafter_dir: str | Path | None = None, backend: str = "torch",
                  options: RuntimeOptions | None = None, **option_kwargs) -> Runtime:
        """The torch backend on a Qwen3 target directory and a DFlash drafter directory. options (or its
        fields as keyword arguments): max_batch / max_seq_len (default 8 / 2048), threads, device, dtype,
        compile, row_invariant (runtime/options.py), and the round's options."""
        opts = RuntimeOptions.of(options, **option_kwargs)
        if backend != "torch":
            raise RetraceError(f"backend {backend!r} runs from an engine bundle (retrace-export build); "
                               "with --target/--drafter use the torch backend")
        from retrace.runtime.torch_backend import TorchBackend

        be = TorchBackend.from_dirs(target_dir, drafter_dir, max_batch=opts.max_batch or DIRS_MAX_BATCH,
                                    max_seq_len=opts.max_seq_len or DIRS_MAX_SEQ_LEN, threads=opts.threads,
                                    device=opts.device, dtype=opts.dtype, compile=opts.compile,
                                    cuda_graphs=opts.cuda_graphs, row_invariant=opts.row_invariant)
        return cls(be, TextCodec.find(target_dir), opts)

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, backend: str = "onnxruntime", options: RuntimeOptions | None = None,
                    **kwargs) -> Runtime:
        """An engine bundle (retrace-export build) on its backend. options (or its fields as keyword
        arguments): max_batch / max_seq_len (default: the bundle's limits), threads, verify_bundle; device is
        checked against where the backend runs (onnxruntime: cpu; tensorrt: cuda); dtype and compile are
        refused (fixed when the bundle is built). Other keyword arguments go to the backend's from_bundle."""
        fields, backend_kwargs = RuntimeOptions.split(kwargs)
        opts = RuntimeOptions.of(options, **fields)
        if opts.compile:
            raise RetraceError("--compile applies to the torch backend (--target/--drafter), not to a bundle")
        if opts.cuda_graphs:
            raise RetraceError("cuda_graphs applies to the torch backend (--target/--drafter), not to a bundle")
        if opts.row_invariant is not None and backend != "onnxruntime":
            raise RetraceError("row_invariant (--row-invariance / --no-row-invariance) applies to an onnxruntime "
                               "bundle or the torch backend")
        extra = _bundle_device(backend, opts.device, opts.dtype)
        given = {"max_batch": opts.max_batch, "max_seq_len": opts.max_seq_len, "threads": opts.threads,
                 "verify": opts.verify_bundle, "row_invariant": opts.row_invariant}
        extra.update({k: v for k, v in given.items() if v is not None})
        be = _load_backend_class(backend).from_bundle(bundle_dir, **{**extra, **backend_kwargs})
        return cls(be, TextCodec.find(Path(bundle_dir) / "tokenizer", bundle_dir), opts)

    # -- text ------------------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.codec is None:
                raise RetraceError("this model has no tokenizer.json: pass token ids (--prompt-ids)")
            return self.codec.encode(prompt)
        return [int(t) for t in prompt]

    # -- generation ------------------------------------------------------------------------------------
    def scheduler(self) -> Scheduler:
        """The long-lived continuous-batching scheduler (requests join and leave between rounds)."""
        if self._sched is None:
            self._sched = Scheduler(self.backend, self.codec, self.options)
        return self._sched

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None,
                 mode: str = "retrace", progress=None) -> list[Result]:
        """Run all prompts as one continuous batch; returns one Result per prompt, in order."""
        params = params or SamplingParams()
        sched = self.scheduler()
        reqs = [sched.add(self.encode(p), params, mode) for p in prompts]
        mine = {r.rid for r in reqs}
        while not all(r.finished for r in reqs):
            events = self._step()
            if progress is not None:
                progress(sum(len(e.token_ids) for e in events if e.request.rid in mine))
        return [self._result(r) for r in reqs]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               mode: str = "retrace") -> Iterator[Event]:
        """Yield the tokens and text of one request as they are committed."""
        sched = self.scheduler()
        req = sched.add(self.encode(prompt), params or SamplingParams(), mode)
        pending = self._pending[req.rid] = []
        try:
            while True:
                if pending:
                    ev = pending.pop(0)
                    if ev.finished and req.error:
                        raise RetraceError(req.error)
                    yield ev
                    if ev.finished:
                        return
                elif req.finished:  # cancelled from outside
                    return
                else:
                    self._step()
        finally:
            del self._pending[req.rid]
            if not req.finished:
                sched.cancel(req)

    def _step(self) -> list[Event]:
        events = self.scheduler().step()
        for ev in events:
            if ev.request.rid in self._pending:
                self._pending[ev.request.rid].append(ev)
        return events

    def _result(self, r: Request) -> Result:
        d = r.result()
        return Result(d["token_ids"], d["text"] if self.codec else None, d["finish_reason"], d["stats"], r.error)

    def run_stats(self) -> dict:
        sched = self.scheduler()
        total = AcceptStats()
        for m in MODES:
            total.merge(sched.stats[m])
        t = sched.timing
        return {
            **total.to_dict(),
            "tokens_per_s": total.tokens / t.wall if t.wall else 0.0,
            "by_mode": {m: s.to_dict() for m, s in sched.stats.items() if s.tokens},
            "time": t.to_dict(),
            "max_batch_seen": sched.max_batch_seen,
            "backend": self.backend.name,
            "verify_policy": sched.policy.name,
            **({"tree": {"budget": sched.tree_budget, "sources": list(sched.tree_sources),
                         "source_counts": {s: {"tries": t, "accepted": h, "accepted_only": o}
                                           for s, (t, h, o) in sched.tree_counts.items()}}}
               if sched.tree_budget else {}),
            **({"prompt_lookup": sched.lookup.to_dict()} if sched.lookup is not None else {}),
        }

    def reset_stats(self) -> None:
        sched = self.scheduler()
        from retrace.runtime.stats import Timing

        sched.timing = Timing()
        sched.stats = {m: AcceptStats() for m in MODES}
        sched.max_batch_seen = 0
