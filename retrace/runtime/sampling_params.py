"""A request's sampling parameters, importable without torch (the Triton model's stand-in and the serving
checks use it; runtime/sampling.py re-exports it beside the sampling code)."""

from __future__ import annotations

from dataclasses import dataclass, field

from retrace.request_validation import check_sampling


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False  # EOS is a token like any other: generation runs on to max_new_tokens
    min_tokens: int = 0  # EOS cannot be generated before this many new tokens (transformers' min_new_tokens)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """retrace/request_validation.py's check (the one every entrance shares); normalizes in place: a
        temperature below 1e-5 becomes 0 (greedy), stop a tuple. Raises InvalidParameter (a RetraceError)."""
        for k, v in check_sampling(self.max_new_tokens, self.temperature, self.top_p, self.top_k, self.seed,
                                   self.stop, self.ignore_eos, self.min_tokens).items():
            setattr(self, k, v)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
