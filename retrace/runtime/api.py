"""The embeddable runtime: build from model directories or an engine bundle, then generate or stream."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from retrace.errors import MissingDependencyError, RetraceError
from retrace.runtime.backend import Backend
from retrace.runtime.device import resolve_device
from retrace.runtime.draft_tree import SOURCES, check_budget, parse_sources
from retrace.runtime.loop import MODES, Event, Request, Scheduler
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.sampling import SamplingParams
from retrace.runtime.stats import AcceptStats
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.verify_policy import POLICIES, VerifyPolicy

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
    def __init__(self, backend: Backend, codec: TextCodec | None = None, block_size: int | None = None,
                 verify_policy: str | VerifyPolicy = "adaptive", tree_budget: int = 0,
                 tree_sources: str | tuple[str, ...] = SOURCES, prompt_lookup: bool | PromptLookup = False):
        """verify_policy: how many drafts each round verifies, for every request of this runtime:
        "adaptive" (what pays on this machine, runtime/verify_policy.py), "fixed" (the whole block), or a
        policy object. tree_budget > 0: verify a draft tree of at most that many nodes per row instead
        (runtime/draft_tree.py) from tree_sources ("topk,suffix,target"); the policy picks how many of its
        best-first nodes each round verifies ("fixed": all; "adaptive": runtime/tree_budget.py).
        prompt_lookup: True (or a PromptLookup) = in rounds without a drafter call, verify drafts copied
        from the request's own tokens (runtime/prompt_lookup.py; dflash and retrace modes, greedy rows)."""
        if isinstance(verify_policy, str) and verify_policy not in POLICIES:
            raise RetraceError(f"unknown verify policy {verify_policy!r} (choose from {', '.join(POLICIES)})")
        self.backend = backend
        self.codec = codec
        self.block_size = block_size
        self.verify_policy = verify_policy
        self.tree_budget = check_budget(tree_budget, block_size or 0)
        if self.tree_budget + 3 > backend.max_seq_len:  # one prompt token + one new token + the tree + 1
            raise RetraceError(f"tree budget {self.tree_budget} leaves no room for any request in the max length "
                               f"{backend.max_seq_len} (at most {backend.max_seq_len - 3})")
        self.tree_sources = parse_sources(tree_sources)
        self.prompt_lookup = prompt_lookup
        self._sched: Scheduler | None = None
        # events of requests being streamed, not yet yielded: a step run on behalf of one stream (or of
        # generate) commits tokens for every request, and the other streams must still see theirs
        self._pending: dict[int, list[Event]] = {}

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def from_dirs(cls, target_dir: str | Path, drafter_dir: str | Path | None = None, backend: str = "torch",
                  max_batch: int = 8, max_seq_len: int = 2048, block_size: int | None = None,
                  threads: int | None = None, verify_policy: str | VerifyPolicy = "adaptive",
                  tree_budget: int = 0, tree_sources: str | tuple[str, ...] = SOURCES,
                  prompt_lookup: bool | PromptLookup = False, device: str | None = None,
                  dtype: str | None = None, compile: bool | str = False) -> Runtime:
        """device: "cpu" (default), "cuda", "cuda:N"; dtype: "bfloat16" | "float16" | "float32" (default);
        compile: the torch backend's steps under torch.compile(fullgraph=True) (runtime/compiled_step.py)."""
        if backend != "torch":
            raise RetraceError(f"backend {backend!r} runs from an engine bundle (retrace-export build); "
                               "with --target/--drafter use the torch backend")
        from retrace.runtime.torch_backend import TorchBackend

        be = TorchBackend.from_dirs(target_dir, drafter_dir, max_batch=max_batch, max_seq_len=max_seq_len,
                                    threads=threads, device=device, dtype=dtype, compile=compile)
        return cls(be, TextCodec.find(target_dir), block_size, verify_policy, tree_budget, tree_sources, prompt_lookup)

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, backend: str = "onnxruntime", block_size: int | None = None,
                    verify_policy: str | VerifyPolicy = "adaptive", tree_budget: int = 0,
                    tree_sources: str | tuple[str, ...] = SOURCES, prompt_lookup: bool | PromptLookup = False,
                    device: str | None = None, dtype: str | None = None, **backend_kwargs) -> Runtime:
        """device: checked against where the bundle's backend runs (onnxruntime: cpu; tensorrt: cuda);
        dtype: refused (a bundle's dtype is fixed when it is built)."""
        extra = _bundle_device(backend, device, dtype)
        be = _load_backend_class(backend).from_bundle(bundle_dir, **extra, **backend_kwargs)
        return cls(be, TextCodec.find(Path(bundle_dir) / "tokenizer", bundle_dir), block_size, verify_policy,
                   tree_budget, tree_sources, prompt_lookup)

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
            self._sched = Scheduler(self.backend, self.codec, self.block_size, verify_policy=self.verify_policy,
                                    tree_budget=self.tree_budget, tree_sources=self.tree_sources,
                                    prompt_lookup=(PromptLookup() if self.prompt_lookup is True
                                                   else self.prompt_lookup or None))
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
