"""Checks of command-line values that click's types let through: non-finite floats, seeds too large for a
generator, thread counts beyond the machine, text that is not valid Unicode. Each raises a RetraceError
naming the option (exit 2, no traceback). Only the standard library is imported."""

from __future__ import annotations

import math
import os

from retrace.errors import RetraceError

SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed / numpy take 64-bit seeds
THREADS_PER_CORE = 4  # oversubscription beyond this is a typo, not a tuning choice


def machine_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(n: int | None, option: str = "--threads") -> None:
    if n is None:
        return
    top = machine_threads() * THREADS_PER_CORE
    if n < 1 or n > top:
        raise RetraceError(f"{option} {n} must be in 1..{top} ({machine_threads()} CPU cores available here)")


def check_seed(seed: int | None, option: str = "--seed") -> None:
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise RetraceError(f"{option} {seed} must be in 0..{SEED_MAX}")


def check_finite(value: float | None, option: str, low: float | None = None, high: float | None = None) -> None:
    if value is None:
        return
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        span = f" in {low:g}..{high:g}" if low is not None and high is not None else (
            f" >= {low:g}" if low is not None else "")
        raise RetraceError(f"{option} must be a finite number{span}, got {value}")


def is_text(s: str) -> bool:
    """s encodes as UTF-8: no lone surrogates (JSON escapes like \\ud800, undecodable command-line bytes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_text(text: str | None, option: str) -> None:
    """Undecodable bytes on the command line arrive as lone surrogates; the tokenizer cannot take them."""
    if text is not None and not is_text(text):
        raise RetraceError(f"{option} is not valid UTF-8 text; check the terminal's encoding or pass --prompt-ids")
