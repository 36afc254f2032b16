"""Where training may write (retrace.train.outputs): a finished drafter, conditioner or checkpoint is never
overwritten without --force or --resume, --resume without a checkpoint is an error, a user's directory is
refused, a new drafter drops the stale conditioner beside it, and an interrupted run says exactly what it
wrote. The checks run before any model is loaded, so these tests train nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from retrace.errors import RetraceError
from retrace.output_dir import MARKER, OutputDirError
from retrace.train import outputs


def finished_drafter(d: Path, conditioner: bool = False, checkpoint: bool = False) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights")
    if conditioner:
        (d / "retrace_config.json").write_text("{}")
        (d / "retrace.safetensors").write_bytes(b"cond")
    if checkpoint:
        (d / "train_state").mkdir()
        (d / "train_state" / "state.json").write_text(json.dumps({"version": 1, "step": 7}))
        (d / "train_state" / "state.safetensors").write_bytes(b"s")
    return d


def test_dflash_never_overwrites_a_finished_drafter_without_force_or_resume(tmp_path):
    d = finished_drafter(tmp_path / "d", conditioner=True)
    with pytest.raises(RetraceError, match="already holds a trained drafter and a conditioner.*--resume.*--force"):
        outputs.prepare_dflash_out(d, force=False, resume=False)
    assert (d / "model.safetensors").read_bytes() == b"weights"
    outputs.prepare_dflash_out(d, force=True, resume=False)  # allowed, and the dir is now marked ours
    assert (d / MARKER).is_file()


def test_a_checkpoint_is_not_silently_discarded(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "train_state").mkdir()
    (d / "train_state" / "state.json").write_text("{}")
    (d / "train_state" / "state.safetensors").write_bytes(b"s")
    with pytest.raises(RetraceError, match="a training checkpoint"):
        outputs.prepare_dflash_out(d, force=False, resume=False)
    outputs.prepare_dflash_out(d, force=False, resume=True)


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    for d in (tmp_path / "new", finished_drafter(tmp_path / "old")):
        with pytest.raises(RetraceError, match="no training checkpoint"):
            outputs.prepare_dflash_out(d, force=False, resume=True)


@pytest.mark.parametrize("force", [False, True])
def test_a_users_directory_is_refused_even_with_force(tmp_path, force):
    d = finished_drafter(tmp_path / "d")
    (d / "README.md").write_text("my notes")  # not something training writes
    with pytest.raises(OutputDirError, match="not a drafter directory written by retrace"):
        outputs.prepare_dflash_out(d, force=force, resume=False)
    with pytest.raises(OutputDirError):
        outputs.prepare_conditioner_out(d, tmp_path / "elsewhere", force=force, resume=False)
    assert not (d / MARKER).exists()


def test_conditioner_never_overwrites_a_finished_conditioner_without_force(tmp_path):
    d = finished_drafter(tmp_path / "d", conditioner=True)
    (d / "README.md").write_text("a downloaded drafter: the conditioner only adds files beside it")
    with pytest.raises(RetraceError, match="already holds a trained conditioner"):
        outputs.prepare_conditioner_out(d, d, force=False, resume=False)
    outputs.prepare_conditioner_out(d, d, force=True, resume=False)
    plain = finished_drafter(tmp_path / "plain")
    outputs.prepare_conditioner_out(plain, plain, force=False, resume=False)  # nothing to overwrite
    assert not (plain / MARKER).exists()  # adding files does not claim someone's directory


def test_a_new_drafter_drops_the_stale_conditioner(tmp_path):
    d = finished_drafter(tmp_path / "d", conditioner=True)
    (d / "conditioner_train.json").write_text("{}")
    outputs.drop_stale_conditioner(d)
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]


def test_interrupt_message_says_what_was_written(tmp_path):
    d = finished_drafter(tmp_path / "d")
    with pytest.raises(KeyboardInterrupt) as e:
        with outputs.report_interrupt(d):
            pass
            raise KeyboardInterrupt
    assert e.value.retrace_message == f"interrupted: nothing in {d} was changed"
    with pytest.raises(KeyboardInterrupt) as e:
        with outputs.report_interrupt(d):
            (d / "train_state").mkdir()
            (d / "train_state" / "state.json").write_text(json.dumps({"step": 12}))
            (d / "model.safetensors").write_bytes(b"new weights")
            raise KeyboardInterrupt
    msg = e.value.retrace_message
    assert "wrote model.safetensors, train_state/" in msg and "step 12" in msg and "--resume" in msg


def test_cli_refuses_before_loading_anything_and_prints_the_interrupt_account(tmp_path, monkeypatch):
    from retrace.cli import main

    d = finished_drafter(tmp_path / "d", conditioner=True)
    args = ["train", "dflash", "--target", str(tmp_path / "no-target"), "--data", str(tmp_path / "no.jsonl"),
            "--out", str(d), "--quiet"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "already holds a trained drafter" in res.output, res.output
    assert "Traceback" not in res.output and (d / "retrace.safetensors").read_bytes() == b"cond"

    import retrace.train.dflash as dflash

    def interrupted(target_dir, out, *a, **k):
        (out / "model.safetensors").write_bytes(b"half-trained")
        raise KeyboardInterrupt

    monkeypatch.setattr(dflash, "_train_dflash", interrupted)
    fresh = tmp_path / "fresh"  # a new run trains in place: its checkpoints must survive for --resume
    res = CliRunner().invoke(main, [*args[:-3], "--out", str(fresh), "--quiet"])
    assert res.exit_code == 130 and "interrupted: wrote model.safetensors" in res.output, res.output
    assert "nothing was written" not in res.output and (fresh / "model.safetensors").read_bytes() == b"half-trained"


def test_sigterm_during_force_keeps_the_previous_drafter(tmp_path, monkeypatch):
    """`train dflash --force` over a finished drafter trains in a temp sibling: SIGTERM (or any error) part
    way leaves the previous drafter, its conditioner and checkpoint exactly as they were; the end of the run
    replaces them all at once."""
    import os
    import signal

    import retrace.train.dflash as dflash
    from retrace.cli import main

    d = finished_drafter(tmp_path / "d", conditioner=True, checkpoint=True)
    (d / "train_data").mkdir()
    (d / "train_data" / "responses.json").write_text('{"key": "k", "responses": []}')
    before = {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file()}
    seen = []

    def train(target_dir, out, *a, **k):
        seen.append(out)
        assert out != d and out.parent == d.parent  # a sibling of OUT, not OUT
        assert (out / "train_data" / "responses.json").read_bytes() == before["train_data/responses.json"]
        (out / "model.safetensors").write_bytes(b"half-trained")
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("SIGTERM did not interrupt")

    monkeypatch.setattr(dflash, "_train_dflash", train)
    args = ["train", "dflash", "--target", str(tmp_path / "t"), "--data", str(tmp_path / "p.jsonl"), "--out", str(d),
            "--quiet", "--force"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 130 and f"interrupted: nothing in {d} was changed" in res.output, res.output
    after = {p.relative_to(d).as_posix(): p.read_bytes() for p in d.rglob("*") if p.is_file() and p.name != MARKER}
    assert after == before and not seen[0].exists()  # (the unmarked drafter directory is now marked ours)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no temp sibling left

    def finish(target_dir, out, *a, **k):
        (out / "config.json").write_text('{"new": 1}')
        (out / "model.safetensors").write_bytes(b"new weights")
        return {"steps": 1, "train_loss": 0.0, "val": {}, "val_runtime_tau": {}}

    monkeypatch.setattr(dflash, "_train_dflash", finish)
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in d.iterdir()) == [MARKER, "config.json", "model.safetensors", "train_data"]
    assert (d / "model.safetensors").read_bytes() == b"new weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_a_failed_run_leaves_no_marker_only_directory(tmp_path):
    """A run that fails before writing anything (here: a target that does not exist) leaves OUT as it was:
    absent stays absent, empty stays empty."""
    from retrace.train.dflash import DFlashConfig, train_dflash

    for out, existed in ((tmp_path / "new", False), (tmp_path / "empty", True)):
        if existed:
            out.mkdir()
        with pytest.raises(RetraceError, match="not found"):
            train_dflash(tmp_path / "no-target", out, tmp_path / "p.jsonl", DFlashConfig(device="cpu"), progress=False)
        assert out.exists() == existed and (not existed or not any(out.iterdir()))
        with pytest.raises(RetraceError, match="no training checkpoint"):
            train_dflash(tmp_path / "no-target", out, tmp_path / "p.jsonl", DFlashConfig(device="cpu"), resume=True,
                         progress=False)
        assert out.exists() == existed and (not existed or not any(out.iterdir()))


def test_a_full_disk_during_training_is_a_clear_error(tmp_path):
    import errno

    d = finished_drafter(tmp_path / "d")
    with pytest.raises(RetraceError, match="no space left on the device.*wrote model.safetensors"):
        with outputs.report_interrupt(d):
            (d / "model.safetensors").write_bytes(b"part")
            raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_a_forced_run_keeps_the_previous_drafter(tmp_path, monkeypatch):
    import errno

    import retrace.train.dflash as dflash
    from retrace.train.dflash import DFlashConfig, train_dflash

    d = finished_drafter(tmp_path / "d", conditioner=True)

    def full(target_dir, out, *a, **k):
        (out / "model.safetensors").write_bytes(b"part")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dflash, "_train_dflash", full)
    with pytest.raises(OutputDirError) as e:
        train_dflash(tmp_path / "t", d, tmp_path / "p.jsonl", DFlashConfig(device="cpu"), force=True, progress=False)
    assert (str(e.value).startswith(f"no space left on the device while writing {d}")
            and "nothing was changed" in str(e.value))
    assert (d / "model.safetensors").read_bytes() == b"weights" and (d / "retrace.safetensors").read_bytes() == b"cond"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]
