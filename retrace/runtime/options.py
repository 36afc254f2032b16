"""How a runtime runs: one frozen dataclass, each setting's default and meaning in one place, checked once.

The command line builds one (retrace/cli_options.py), `Runtime.from_dirs` / `from_bundle` / `Runtime`
take it whole (`options=`; their keyword arguments of the same names build or override one), and the
scheduler (runtime/loop.py) reads it. What can be checked without a backend is checked here, when the
object is made (`dataclasses.replace` makes a new one, checked again); what needs the backend (the
drafter's block size, the backend's max length) by `block_size_for`, when a Runtime or Scheduler is made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from retrace.cli_checks import check_threads
from retrace.errors import RetraceError
from retrace.runtime.draft_tree import SOURCES, check_budget, parse_sources
from retrace.runtime.verify_policy import POLICIES

if TYPE_CHECKING:
    from retrace.runtime.prompt_lookup import PromptLookup
    from retrace.runtime.verify_policy import VerifyPolicy

DIRS_MAX_BATCH = 8  # batch slots of a runtime from model directories (a bundle's come from its manifest)
DIRS_MAX_SEQ_LEN = 2048  # tokens per slot of a runtime from model directories


class InvalidOption(RetraceError):
    """One runtime option is wrong: ``field`` names it (the command line says its flag instead)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field} {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class RuntimeOptions:
    # -- the round (runtime/loop.py) --
    block_size: int | None = None  # tokens per draft block, anchor included; None: the drafter's block_size
    verify_policy: str | VerifyPolicy = "adaptive"  # drafts verified per round: "adaptive" (what pays on this
    #   machine, runtime/verify_policy.py), "fixed" (the whole block: what training rollouts and `retrace eval`
    #   measure), or a policy object (its state is the runtime's: give each runtime its own)
    tree_budget: int = 0  # 0: chain verification; N >= 2: a draft tree of <= N nodes (root included) per row
    #   (runtime/draft_tree.py); the policy picks how many of its best-first nodes each round verifies
    tree_sources: str | tuple[str, ...] = SOURCES  # a tree's candidates, a comma list or a tuple of "topk"
    #   (the drafter's top-k), "suffix" (the previous round's rejected suffix), "target" (the target's argmax
    #   on it); kept as the validated tuple, in SOURCES order
    prompt_lookup: bool | str | PromptLookup = "first"  # "first" (PromptLookup(first=True), the default): in
    #   rounds without a drafter call, and instead of a draft call where it is expected to commit faster, verify
    #   drafts copied from the request's own tokens (runtime/prompt_lookup.py, runtime/proposers/lookup_first.py;
    #   dflash and retrace modes, rounds of up to 8 rows); True (or a PromptLookup): only in rounds
    #   without a drafter call; False: never (what measures the drafter alone: `retrace eval`, training
    #   rollouts, the bench's drafter-only systems)
    eos_ids: tuple[int, ...] | None = None  # tokens that end a request; None: the target's eos_token_ids
    prefill_chunk: int | str | None = None  # prompt tokens prefilled per step over all new prompts, so running
    #   requests go on between a long prompt's chunks (runtime/prefill_chunks.py); None or 0: each prompt whole;
    #   "auto": by device (256 on a CPU, 2048 on CUDA; `retrace serve`'s default)
    # -- the backend --
    max_batch: int | None = None  # batch slots; None: DIRS_MAX_BATCH for model dirs, the bundle's limit
    max_seq_len: int | None = None  # tokens per slot; None: DIRS_MAX_SEQ_LEN for model dirs, the bundle's
    threads: int | None = None  # CPU threads of the backend; None: the library's default
    device: str | None = None  # "cpu" (default), "cuda", "cuda:N"; a bundle: checked against its backend's
    dtype: str | None = None  # weights and caches of model dirs: "bfloat16", "float16", "float32" (None;
    #   checked by runtime/device.py when the weights load); a bundle's dtype is fixed when it is built (refused)
    compile: bool | str = False  # the torch backend's steps under torch.compile(fullgraph=True)
    #   (runtime/compiled_step.py; a backend name such as "eager" for tests); refused for a bundle
    cuda_graphs: bool | None = None  # the torch backend's padded steps as CUDA graphs, one per bucket
    #   (runtime/cuda_graphs.py); None: on CUDA, off elsewhere; True without CUDA: an error; refused for a bundle
    verify_bundle: bool | None = None  # re-hash a bundle's files on load; None: unless RETRACE_VERIFY_BUNDLE=0
    #   (sizes are always checked)
    row_invariant: bool | None = None  # target calls padded to shapes whose rows the kernels compute alike, so
    #   verify rows equal the decode step bit for bit: an ONNX Runtime bundle's (runtime/row_invariance.py; None:
    #   on) and the torch backend's (runtime/torch_backend.py; None: on CUDA, off on the CPU)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise RetraceError (InvalidOption for a bad number) naming the first wrong option; normalizes
        tree_sources to its tuple and eos_ids to a tuple."""
        for name in ("block_size", "max_batch", "max_seq_len", "threads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise InvalidOption(name, f"must be positive, got {value}")
        c = self.prefill_chunk
        if c is not None and c != "auto" and (not isinstance(c, int) or isinstance(c, bool) or c < 0):
            raise InvalidOption("prefill_chunk", f"must be a number of tokens >= 0 (0: whole prompts) or \"auto\", "
                                                 f"got {c!r}")
        if self.threads is not None:
            try:
                check_threads(self.threads, "threads")
            except RetraceError as e:
                raise InvalidOption("threads", str(e).removeprefix("threads ")) from None
        if isinstance(self.verify_policy, str) and self.verify_policy not in POLICIES:
            raise RetraceError(f"unknown verify policy {self.verify_policy!r} (choose from {', '.join(POLICIES)})")
        if isinstance(self.prompt_lookup, str) and self.prompt_lookup != "first":
            raise RetraceError(f"prompt_lookup must be True, False, \"first\" or a PromptLookup, got "
                               f"{self.prompt_lookup!r}")
        check_budget(self.tree_budget, self.block_size or 0)
        object.__setattr__(self, "tree_sources", parse_sources(self.tree_sources))
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", tuple(int(t) for t in self.eos_ids))

    def block_size_for(self, backend) -> int:
        """The block size in use on this backend (the drafter's unless given; 1 without a drafter), after
        checking the options against the backend: the block fits the drafter, the tree fits the max length."""
        dc = backend.drafter_config
        block_size = int(self.block_size or (dc.block_size if dc else 1))
        if dc is not None and not 2 <= block_size <= dc.block_size:
            raise RetraceError(f"block size {block_size} must be in 2..{dc.block_size} (the drafter's block_size)")
        if self.tree_budget + 3 > backend.max_seq_len:  # one prompt token + one new token + the tree + 1
            raise RetraceError(f"tree budget {self.tree_budget} leaves no room for any request in the max length "
                               f"{backend.max_seq_len} (at most {backend.max_seq_len - 3})")
        return block_size

    def serving(self) -> RuntimeOptions:
        """What a server (`retrace serve`, the Triton model) runs with: its requests stream, so a long prompt is
        prefilled in chunks unless prefill_chunk was given ("auto": 256 tokens a step on a CPU, 2048 on CUDA)."""
        return self.replace(prefill_chunk="auto") if self.prefill_chunk is None else self

    def replace(self, **changes) -> RuntimeOptions:
        """A copy with these fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, options: RuntimeOptions | None = None, **changes) -> RuntimeOptions:
        """`options` (default: the defaults) with the keyword arguments' fields changed: what the
        keyword-argument conveniences of Runtime / from_dirs / from_bundle build."""
        base = options if options is not None else cls()
        return dataclasses.replace(base, **changes) if changes else base

    @classmethod
    def split(cls, kwargs: dict) -> tuple[dict, dict]:
        """kwargs -> (those that are RuntimeOptions fields, the rest)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return ({k: v for k, v in kwargs.items() if k in names}, {k: v for k, v in kwargs.items() if k not in names})
