"""How every `retrace` / `retrace-export` command reports failures: one line on stderr, no traceback.

Exit codes: 2 for bad input, bad files or environment (RetraceError, and a path the command may not read or
write: permission denied, a read-only file system, a file where a directory must be); 3 for a missing optional
dependency
(MissingDependencyError, e.g. tensorrt); 130 for Ctrl-C or SIGTERM, after whatever was being written is
cleaned up (commands that write in place, like training, say what they wrote).
Only click is imported, so the command-line entry points stay fast.
"""

from __future__ import annotations

import errno
import functools
import sys

import click

from retrace.errors import MissingDependencyError, RetraceError

_PATH_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR)


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
        except OSError as e:  # a path the command may not use (permissions, read-only, a file in the way)
            if e.errno not in _PATH_ERRNOS or not e.filename:
                raise
            click.echo(f"error: {e.filename}: {e.strerror}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as e:  # commands that write in place attach what they wrote (retrace_message)
            click.echo(getattr(e, "retrace_message", None) or "interrupted: nothing was written", err=True)
            sys.exit(130)

    return wrapper
