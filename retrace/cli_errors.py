"""How every `retrace` / `retrace-export` command reports failures: one line on stderr, no traceback.

Exit codes: 2 for bad input, bad files or environment (RetraceError); 3 for a missing optional dependency
(MissingDependencyError, e.g. tensorrt); 130 for Ctrl-C or SIGTERM, after whatever was being written is
cleaned up (commands that write in place, like training, say what they wrote).
Only click is imported, so the command-line entry points stay fast.
"""

from __future__ import annotations

import functools
import sys

import click

from retrace.errors import MissingDependencyError, RetraceError


def cli_errors(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except MissingDependencyError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(getattr(e, "exit_code", 3))
        except RetraceError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as e:  # commands that write in place attach what they wrote (retrace_message)
            click.echo(getattr(e, "retrace_message", None) or "interrupted: nothing was written", err=True)
            sys.exit(130)

    return wrapper
