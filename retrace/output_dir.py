"""The one rule for every command that writes a directory (zoo, train, retrace-export build, triton, ...).

* Ownership is a marker, not a guess: a directory a command creates holds ``.retrace-output.json``
  (``{"kind": KIND, ...}``). A command owns only directories whose marker names its own KIND.
* An existing non-empty directory the command does not own is refused, with or without ``--force``. An
  empty directory is free. ``--force`` replaces only a directory of the command's own kind.
* Directories made before markers existed: the caller passes ``legacy(path) -> bool``, which must say yes
  only when the directory holds nothing but that command's own output, verified (e.g. a bundle whose every
  file matches its manifest and which holds no other file); such a directory counts as owned.
* Whole-directory writers work in a temp sibling ``.NAME.retrace-tmp-PID-XXXX`` and rename it into place at
  the end (``staged_output``). An error, Ctrl-C, SIGTERM or a full disk removes the temp sibling and leaves
  the previous output as it was. Temp siblings of dead processes are swept on the next run.
* In-place writers (training: checkpoints must survive an interrupt) call ``claim_in_place``.

    from retrace.output_dir import staged_output

    with staged_output(out, "engine-bundle", force=force, legacy=is_complete_bundle) as tmp:
        ...write everything under tmp...
    # now `out` holds it (marker included); on any exception `out` is unchanged and tmp is gone

Only the standard library is imported.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import glob
import json
import os
import re
import shutil
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from retrace.errors import RetraceError
from retrace.staging import remove_orphaned

MARKER = ".retrace-output.json"
# temp siblings: ours, and the older per-command names that carried a PID (engine build, zoo)
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(retrace-tmp|retrace-old|building|replaced|tmp)-(?P<pid>\d+)-[^/]*$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

Legacy = Callable[[Path], bool]


class OutputDirError(RetraceError):
    """The output directory may not be written (not ours, another kind, needs --force) or ran out of space."""


def owner(path: str | Path) -> str | None:
    """The KIND recorded in path's marker, or None (no marker / unreadable)."""
    try:
        m = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m.get("kind") if isinstance(m, dict) and isinstance(m.get("kind"), str) else None


def write_marker(path: str | Path, kind: str) -> None:
    from retrace.engines.bundle import retrace_version

    info = {"kind": kind, "written_by": f"retrace {retrace_version()}",
            "created_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "note": "retrace owns this directory: --force may replace it with a new " + kind}
    (Path(path) / MARKER).write_text(json.dumps(info, indent=1) + "\n")


def _a(what: str) -> str:
    return ("an " if what[:1].lower() in "aeiou" else "a ") + what


def _entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def is_owned(path: Path, kind: str, legacy: Legacy | None = None) -> bool:
    """path holds `kind` output: its marker says so, or (no marker) legacy(path) vouches for it."""
    k = owner(path)
    if k is not None:
        return k == kind
    return legacy is not None and legacy(path)


_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR)


def unwritable(e: BaseException) -> bool:
    """An OSError that says the path cannot be written (permissions, read-only file system, a file in the way)."""
    return isinstance(e, OSError) and e.errno in _UNWRITABLE


def _cannot_write(out: Path, e: OSError) -> OutputDirError:
    where = f" ({e.filename})" if e.filename and str(e.filename) != str(out) else ""
    return OutputDirError(f"cannot write {out}: {e.strerror or e}{where}; choose a writable output path")


def _check_writable(out: Path) -> None:
    """Refuse an output path that cannot be written before any work is done: a path below a regular file,
    or below (or at) a directory this process may not write (permissions, a read-only file system)."""
    at = out if out.is_dir() else out.parent
    while not at.exists() and not at.is_symlink() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        raise OutputDirError(f"cannot write {out}: {at} is not a directory; choose another output path")
    if not os.access(at, os.W_OK | os.X_OK):
        raise OutputDirError(f"cannot write {out}: {at} is not writable (permission denied or a read-only file "
                             "system); choose a writable output path")


def _mkdir(path: Path, out: Path, **kw) -> None:
    try:
        path.mkdir(**kw)
    except OSError as e:
        if unwritable(e) or e.errno == errno.EEXIST:  # EEXIST: a file where the directory must be
            raise _cannot_write(out, e) from None
        raise


def check_output(out: str | Path, kind: str, force: bool, legacy: Legacy | None = None,
                 what: str | None = None, exists_hint: str = "pass --force to replace it") -> bool:
    """Apply the rule to `out` before writing; returns True when `out` holds output to be replaced (own kind,
    with force) and False when it is absent or empty. Raises OutputDirError otherwise (also for a path that
    cannot be written)."""
    out = Path(out)
    what = what or kind
    if out.is_symlink():
        raise OutputDirError(f"{out} is a symbolic link; give the real path of the {what} to write")
    _check_writable(out)
    if not out.exists():
        return False
    if not out.is_dir():
        raise OutputDirError(f"{out} exists and is not a directory; choose another output path")
    if not _entries(out):
        return False
    k = owner(out)
    if k is not None and k != kind:
        raise OutputDirError(f"{out} holds a retrace {k}, not {_a(what)}; refusing to replace it even with --force: "
                             "choose another output path")
    if not is_owned(out, kind, legacy):
        raise OutputDirError(f"{out} exists and is not {_a(what)} written by retrace (no owner marker {MARKER}, "
                             "and it holds more than such output); "
                             "refusing to replace it even with --force: choose another output path or empty it")
    if not force:
        raise OutputDirError(f"{out} already exists; {exists_hint} ({_a(what)} retrace wrote)")
    return True


def sweep_stale(out: str | Path) -> None:
    """Remove temp siblings of `out` left by processes that are gone (SIGKILL, power loss)."""
    out = Path(out)
    found = []
    if out.parent.is_dir():
        for p in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
            m = _TEMP_RE.match(p.name)
            if m and m.group("name") == out.name and p.is_dir() and not p.is_symlink():
                found.append((p, int(m.group("pid"))))
    remove_orphaned(found)


def _sibling(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.retrace-{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (a CI timeout, `kill`) cleans up like Ctrl-C does (main thread only)."""
    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        old = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def _signals_blocked() -> Iterator[None]:
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def no_space(e: BaseException) -> bool:
    """A full disk or quota, as OSError or as a library error that wraps one (safetensors)."""
    if isinstance(e, OSError) and e.errno in _NO_SPACE:
        return True
    text = str(e)
    return "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text


def install(tmp: Path, out: Path, kind: str, force: bool, legacy: Legacy | None = None,
            what: str | None = None) -> None:
    """Write the marker into tmp and rename it to out (re-checking the rule: something may have appeared)."""
    write_marker(tmp, kind)
    check_output(out, kind, force, legacy, what)
    with _signals_blocked():  # the two renames are not interrupted half-way
        old = None
        if out.exists():
            old = _sibling(out, "old")
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            if old is not None:
                os.rename(old, out)
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged_output(out: str | Path, kind: str, force: bool = False, legacy: Legacy | None = None,
                  what: str | None = None, exists_hint: str = "pass --force to replace it",
                  installing: Callable[[], contextlib.AbstractContextManager] | None = None) -> Iterator[Path]:
    """Check the rule, sweep stale temp siblings, yield a fresh temp sibling; on a normal exit install it as
    `out` (see the module docstring). Any exception (KeyboardInterrupt, SIGTERM included) removes the temp
    sibling and leaves `out` untouched; a full disk becomes an OutputDirError. `kind` names the output's kind
    in its marker, `what` in messages; `installing()` (optional) wraps the final rename (e.g. a progress
    stage)."""
    out = Path(os.path.abspath(out))
    check_output(out, kind, force, legacy, what, exists_hint)
    _mkdir(out.parent, out, parents=True, exist_ok=True)
    sweep_stale(out)
    tmp = _sibling(out, "tmp")
    _mkdir(tmp, out)
    try:
        with sigterm_as_interrupt():
            try:
                yield tmp
                with installing() if installing is not None else contextlib.nullcontext():
                    install(tmp, out, kind, force, legacy, what)
            except Exception as e:
                if no_space(e):
                    raise OutputDirError(f"no space left on the device while writing {out} ({e}); nothing was "
                                         "changed there: free some space and run again") from None
                if unwritable(e) and str(getattr(e, "filename", "")).startswith(str(tmp)):
                    raise OutputDirError(f"cannot write {out}: {e.strerror} ({e.filename}); nothing was changed "
                                         "there: choose a writable output path") from None
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def claim_in_place(out: str | Path, kind: str, legacy: Legacy | None = None, what: str | None = None) -> bool:
    """For commands that write into `out` itself (training: its checkpoints must survive an interrupt): refuse
    a non-empty directory this kind does not own, create `out` if needed and mark it. Returns True when `out`
    already held this kind's output (the caller decides whether it may be overwritten: --force / --resume)."""
    out = Path(out)
    had = check_output(out, kind, force=True, legacy=legacy, what=what)
    _mkdir(out, out, parents=True, exist_ok=True)
    if owner(out) != kind:
        try:
            write_marker(out, kind)
        except OSError as e:
            if unwritable(e):
                raise _cannot_write(out, e) from None
            raise
    return had


__all__ = ["MARKER", "OutputDirError", "check_output", "claim_in_place", "install", "is_owned", "no_space",
           "owner", "sigterm_as_interrupt", "staged_output", "sweep_stale", "unwritable", "write_marker"]
