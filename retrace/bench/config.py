"""What a benchmark run is asked to do (`BenchConfig`, the `retrace bench` options) and the names it uses:
the peer systems, our modes and backends, the headline system and the goals the results are checked against.

System names: `retrace-<backend>-<mode>[-fixed|-tree|-tree<b>-fixed|-lookup|-lookup-first][<precision>]` for ours
(retrace.bench.lineup), the PEERS' own names for theirs; `--systems` patterns select among them (`wanted`).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from retrace.errors import RetraceError
from retrace.runtime.modes import MODES

ORTGENAI_SPEC = ("ortgenai-ngram", "ortgenai-ngram-adaptive", "ortgenai-draft", "ortgenai-draft-adaptive")
PEERS = ("hf-ar", "hf-dflash", "ortgenai-ar", *ORTGENAI_SPEC)
BACKENDS = ("torch", "onnxruntime")
HEADLINE = "retrace-onnxruntime-retrace"
GOALS = {"vs_ortgenai_ar": 2.0, "vs_hf_dflash": 1.5, "max_outside_forward_share": 0.05}


@dataclass
class BenchConfig:
    target: str
    drafter: str
    prompts: list[str]
    engine: str | None = None
    max_new_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1, 8)
    runs: int = 3
    limit: int | None = 16
    threads: int | None = None
    systems: tuple[str, ...] | None = None  # fnmatch patterns over system names; None = all
    draft_ar: str | None = None  # HF Qwen3 draft model for ortgenai-draft (None: DIR/draft-ar of a zoo, or trained)
    peer_env: str = "measure"  # retrace.bench.envs.POLICIES
    cache_dir: str | None = None
    build_engine: bool = True  # build an ORT bundle into the cache when no --engine is given
    warmup: bool = True
    profile: str | None = None  # write a cProfile of one headline retrace run here
    verify_policy: str = "adaptive"  # what retrace-<backend>-<mode> runs; -fixed names run the whole block
    # > 0: also retrace-<backend>-<mode>-tree (draft trees of <= this many tokens a round, verify_policy picks)
    # and -tree<b>-fixed for each b of tree_fixed (exactly b); ONNX Runtime: a bundle built with --tree-mask
    tree_budget: int = 0
    tree_fixed: tuple[int, ...] = ()
    tree_sources: str = "topk,suffix,target"
    prompt_lookup: bool = False  # also retrace-<backend>-<mode>-lookup[-first]: verify_policy + prompt lookup
    #   (-first: PromptLookup(first=True), runtime/proposers/lookup_first.py)
    weights: tuple[str, ...] = ("fp32",)  # the precision axis (retrace.bench.precision): ours and the peers'
    drafter_weights: str | None = None  # our bundles' drafter precision (None: the target's; build --drafter-weights)
    device: str | None = None  # the torch backend's device (None: cpu) and dtype (None: float32)
    dtype: str | None = None
    compile_steps: bool = False  # the torch backend's steps under torch.compile
    cuda_graphs: bool | None = None  # the torch backend's CUDA graphs (None: on CUDA; False: --no-cuda-graphs)
    row_invariant: bool = True  # our bundles' calls row-invariant (False: --no-row-invariance; runtime/row_invariance)
    temperature: float = 0.0  # every system's decoding (retrace.bench.decoding): 0 greedy, else sampled at
    top_p: float = 1.0  #   these settings by each library's own sampler
    top_k: int = 0
    seed: int = 0
    command: str = ""
    extra: dict = field(default_factory=dict)

    def cache(self) -> Path:
        """The build cache (--cache-dir, else retrace.bench.builds.default_cache_dir()), created."""
        from retrace.bench.builds import default_cache_dir

        cache = Path(self.cache_dir) if self.cache_dir else default_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        return cache

    def validate(self) -> None:
        if self.max_new_tokens < 2:
            raise RetraceError("--max-new-tokens must be at least 2")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise RetraceError("--batch-sizes must be positive integers, e.g. 1,8")
        if self.runs < 1:
            raise RetraceError("--runs must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise RetraceError("--threads must be positive")
        from retrace.bench.decoding import Decoding
        from retrace.bench.envs import POLICIES

        Decoding.of(self)  # the request check's errors (e.g. "top_p must be in (0, 1]")

        if self.peer_env not in POLICIES:
            raise RetraceError(f"--peer-env must be one of {', '.join(POLICIES)}, got {self.peer_env!r}")


def wanted(name: str, patterns: tuple[str, ...] | None) -> bool:
    """Whether the system `name` is selected by the --systems fnmatch patterns (None: every system)."""
    return patterns is None or any(fnmatch.fnmatchcase(name, p) for p in patterns)


__all__ = ["BenchConfig", "wanted", "MODES", "BACKENDS", "PEERS", "ORTGENAI_SPEC", "HEADLINE", "GOALS"]
