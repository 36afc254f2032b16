"""Where `retrace train dflash|conditioner` may write, and an honest account of what an interrupted run wrote.

Training writes into its output directory in place (its checkpoint, OUT/train_state for the drafter and
OUT/conditioner_state for the conditioner, must survive an interrupt so that --resume can continue), so it
follows retrace.output_dir's rule through `claim_in_place` (kind "drafter"): OUT must be absent, empty or a
drafter directory retrace wrote (its marker, or, marker-less, nothing but drafter/conditioner/training
files). On top of that:

* a finished drafter (model.safetensors) or conditioner (retrace.safetensors), or a checkpoint, already in
  OUT is overwritten only with --force (start over) or --resume (continue the checkpoint); with --force the
  new run trains in a temp sibling that replaces OUT only when it ends, so an interrupt keeps the old one;
* --resume without a checkpoint is an error (it never silently starts fresh);
* a new DFlash drafter removes a conditioner left beside it (it was trained for the old drafter);
* `retrace train conditioner` without --out adds its files to the drafter directory (it deletes nothing
  there, so that directory need not be retrace's); its checkpoint goes to conditioner_state/, so the
  drafter's train_state/ stays as it was and `train dflash --resume` still continues it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from retrace.errors import RetraceError
from retrace.output_dir import (
    MARKER,
    OutputDirError,
    claim_in_place,
    no_space,
    sigterm_as_interrupt,
    staged_output,
    sweep_stale,
)

KIND = "drafter"
CONDITIONER_FILES = ("retrace_config.json", "retrace.safetensors", "conditioner_train.json")
DRAFTER_FILES = {"config.json", "model.safetensors", "generation_config.json", "dflash_train.json", "train_state",
                 "train_data", "conditioner_state", *CONDITIONER_FILES}
STATE_DIRS = ("train_state", "conditioner_state")


def is_legacy_drafter(path: Path) -> bool:
    """A marker-less directory holding nothing but what `retrace train` writes (an older retrace's output)."""
    names = {p.name for p in path.iterdir() if not p.name.startswith((".train_state.", ".conditioner_state."))}
    names -= {MARKER}
    return "config.json" in names and names <= DRAFTER_FILES


def _check_resume(out: Path, resume: bool, state: str) -> None:
    from retrace.train.common import has_train_state

    sweep_stale(out / state)  # temp dirs of checkpoints whose writer was killed
    if resume and not has_train_state(out, state):
        raise RetraceError(f"--resume: {out} has no training checkpoint ({state}/) to continue; run without "
                           "--resume to start a new training run")


def prepare_dflash_out(out: Path, force: bool, resume: bool) -> bool:
    """Apply the rules above for `train dflash --out OUT` before anything is written. True when --force is to
    replace a finished drafter, conditioner or checkpoint there (the new run is then staged: see dflash_out)."""
    from retrace.train.common import STATE_DIR

    had = claim_in_place(out, KIND, is_legacy_drafter, "drafter directory")
    _check_resume(out, resume, STATE_DIR)
    what = [w for w, f in (("a trained drafter", "model.safetensors"), ("a conditioner", "retrace.safetensors"),
                           ("a training checkpoint", "train_state"),
                           ("a conditioner checkpoint", "conditioner_state")) if (out / f).exists()]
    if had and what and not (force or resume):
        raise RetraceError(f"{out} already holds {' and '.join(what)}; pass --resume to continue its training "
                           "or --force to train a new drafter there (it replaces them)")
    return bool(had and what and force and not resume)


@contextlib.contextmanager
def dflash_out(out: Path, force: bool, resume: bool, d) -> Iterator[Path]:
    """The directory `train dflash` trains into (d: the torchrun world, retrace.train.distributed.Dist).

    * --force over finished output: a temp sibling (the responses cache in OUT/train_data linked in, so equal
      settings do not regenerate), installed as OUT when the run ends; an error, Ctrl-C or SIGTERM removes it
      and leaves the previous drafter as it was.
    * otherwise OUT itself (checkpoints survive an interrupt for --resume); a run that fails before writing
      anything leaves no directory holding only the owner marker behind.
    Interrupts carry the account of what was written in OUT (report_interrupt)."""
    fresh = not out.exists() or (out.is_dir() and not out.is_symlink() and not any(out.iterdir()))
    existed = out.exists()

    def unclaim() -> None:  # OUT was absent or empty and holds nothing but the marker: as it was
        if d.is_main and fresh and out.is_dir() and {p.name for p in out.iterdir()} <= {MARKER}:
            (out / MARKER).unlink(missing_ok=True)
            if not existed:
                out.rmdir()

    try:
        replacing = d.main_first(lambda: prepare_dflash_out(out, force, resume))
    except BaseException:
        unclaim()
        raise
    if replacing:
        if not d.is_main:
            yield Path(d.broadcast(None))
            d.barrier()
            return
        with report_interrupt(out), staged_output(out, KIND, force=True, legacy=is_legacy_drafter,
                                                  what="drafter directory") as tmp:
            _link_tree(out / "train_data", tmp / "train_data")
            d.broadcast(str(tmp))
            yield tmp
            d.barrier()
        return
    try:
        with report_interrupt(out) if d.is_main else contextlib.nullcontext():
            yield out
    except BaseException:
        unclaim()
        raise


def _link_tree(src: Path, dst: Path) -> None:
    """Hard links (copies where links fail) of src's files under dst; written files are replaced, never
    rewritten in place, so the links never change the original."""
    if not src.is_dir():
        return
    for f in src.rglob("*"):
        if f.is_file() and not f.is_symlink():
            t = dst / f.relative_to(src)
            t.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, t)
            except OSError:
                shutil.copy2(f, t)


def prepare_conditioner_out(out: Path, drafter_dir: Path, force: bool, resume: bool) -> None:
    """Apply the rules above for `train conditioner` (OUT defaults to the drafter directory)."""
    from retrace.train.common import conditioner_state_dir

    if out.resolve() != drafter_dir.resolve():
        claim_in_place(out, KIND, is_legacy_drafter, "drafter directory")
    _check_resume(out, resume, conditioner_state_dir(out))
    if not (force or resume) and (out / "retrace.safetensors").exists():
        raise RetraceError(f"{out} already holds a trained conditioner (retrace.safetensors); pass --force to "
                           "train a new one there (it starts from that conditioner unless --reinit) or --resume "
                           "to continue its checkpoint")


def drop_stale_conditioner(out: Path) -> None:
    """A new DFlash drafter was written to out: a conditioner beside it belonged to the old one."""
    for name in CONDITIONER_FILES:
        with contextlib.suppress(FileNotFoundError):
            (out / name).unlink()
    shutil.rmtree(out / "conditioner_state", ignore_errors=True)


# -- what an interrupted run wrote -----------------------------------------------------------------------------
def snapshot(out: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under out (empty when out does not exist)."""
    if not out.is_dir():
        return {}
    return {p.relative_to(out).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in out.rglob("*") if p.is_file() and p.name != MARKER}


def describe_changes(out: Path, before: dict[str, tuple[int, int]]) -> str:
    after = snapshot(out)
    changed = sorted(k for k, v in after.items() if before.get(k) != v)
    removed = sorted(k for k in before if k not in after)
    if not changed and not removed:
        return f"interrupted: nothing in {out} was changed"
    tops = sorted({k.split("/")[0] + ("/" if "/" in k else "") for k in changed})
    text = f"interrupted: wrote {', '.join(tops)} in {out}"
    if removed:
        text += f"; removed {', '.join(removed)}"
    for name in STATE_DIRS:
        state = out / name / "state.json"
        if any(k.startswith(f"{name}/") for k in changed) and state.is_file():
            try:
                step = json.loads(state.read_text()).get("step")
            except (OSError, ValueError, AttributeError):
                step = None
            text += f"; the checkpoint {name}/ (step {step}) continues with --resume"
    return text


@contextlib.contextmanager
def report_interrupt(out: Path) -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C; the KeyboardInterrupt carries `retrace_message` saying what was written
    (retrace.cli_errors prints it). A full disk becomes a RetraceError that says the same."""
    before = snapshot(out)
    try:
        with sigterm_as_interrupt():
            yield
    except KeyboardInterrupt as e:
        e.retrace_message = describe_changes(out, before)
        raise
    except Exception as e:
        if not no_space(e) or isinstance(e, OutputDirError):  # staged: already says nothing changed in out
            raise
        wrote = describe_changes(out, before).replace("interrupted: ", "")
        raise RetraceError(f"no space left on the device while training into {out} ({e}); {wrote}") from None
