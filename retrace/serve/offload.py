"""A request's blocking work (tokenizing its prompt, rendering its chat template) off the event loop, in a
worker thread, with a time limit, so /health and the other requests stay responsive.

Jinja compiles a chat template to Python code (filename ``<template>``); a trace function on the worker
thread checks the deadline at every line of that code, so a template stuck in a huge loop raises
TimeLimitExceeded and its thread ends (nothing keeps running to block SIGTERM). Tokenizing is C code that
cannot be interrupted; its input is bounded by size before it runs (limits.py)."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from retrace.errors import RetraceError

T = TypeVar("T")
TRACED = frozenset({"<template>"})  # the code objects of compiled Jinja templates


class TimeLimitExceeded(RetraceError):
    """The work took longer than its time limit and was stopped."""


def call_with_deadline(fn: Callable[[], T], seconds: float, what: str) -> T:
    """fn() on this thread, stopped at the first template line past the deadline."""
    deadline = time.monotonic() + seconds

    def local(frame, event, arg):
        if time.monotonic() > deadline:
            raise TimeLimitExceeded(f"{what} did not finish within {seconds:g} s")
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename in TRACED else None

    sys.settrace(calls)
    try:
        return fn()
    finally:
        sys.settrace(None)


async def off_loop(fn: Callable[[], Any], seconds: float, what: str) -> Any:
    """await fn() run in a worker thread under call_with_deadline; an answer comes within the time limit
    even when fn is stuck in C code (which then finishes in the background)."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(call_with_deadline, fn, seconds, what), seconds + 1.0)
    except TimeoutError:
        raise TimeLimitExceeded(f"{what} did not finish within {seconds:g} s") from None
