"""The one output-directory rule (retrace.output_dir) and every command that writes a directory: a user's
directory is never replaced (with or without --force), --force replaces only the command's own kind of
output, interrupts / SIGTERM / a full disk leave the previous output intact, stale temp dirs are swept."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from retrace.engines.bundle import is_complete_bundle, write_manifest
from retrace.output_dir import (
    MARKER,
    OutputDirError,
    check_output,
    claim_in_place,
    owner,
    staged_output,
    sweep_stale,
)


def user_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "important.txt").write_text("keep me")
    return path


def siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


def write_kind(out: Path, kind: str, text: str = "v1", force: bool = False, legacy=None) -> None:
    with staged_output(out, kind, force=force, legacy=legacy) as tmp:
        (tmp / "data.txt").write_text(text)


# -- the rule -------------------------------------------------------------------------------------------------
def test_new_output_is_marked_and_staged(tmp_path):
    out = tmp_path / "a" / "out"
    write_kind(out, "thing")
    assert (out / "data.txt").read_text() == "v1" and owner(out) == "thing"
    assert json.loads((out / MARKER).read_text())["kind"] == "thing"
    assert not siblings(out)


@pytest.mark.parametrize("force", [False, True])
def test_a_users_directory_is_never_replaced(tmp_path, force):
    out = user_dir(tmp_path / "mine")
    with pytest.raises(OutputDirError, match="not a thing written by retrace"):
        write_kind(out, "thing", force=force)
    with pytest.raises(OutputDirError, match="not a thing written by retrace"):
        claim_in_place(out, "thing")
    assert sorted(p.name for p in out.iterdir()) == ["important.txt"] and not siblings(out)


def test_a_copied_marker_of_another_kind_or_a_legacy_guess_does_not_give_ownership(tmp_path):
    out = tmp_path / "o"
    write_kind(out, "zoo")
    with pytest.raises(OutputDirError, match="holds a retrace zoo, not a thing"):
        write_kind(out, "thing", force=True, legacy=lambda p: True)  # the marker wins over any guess
    assert (out / "data.txt").read_text() == "v1"


def test_force_replaces_only_own_kind(tmp_path):
    out = tmp_path / "o"
    write_kind(out, "thing")
    with pytest.raises(OutputDirError, match="already exists; pass --force"):
        write_kind(out, "thing", "v2")
    assert (out / "data.txt").read_text() == "v1"
    write_kind(out, "thing", "v2", force=True)
    assert (out / "data.txt").read_text() == "v2" and not siblings(out)


def test_empty_dir_is_free_and_files_and_symlinks_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    write_kind(empty, "thing")
    assert owner(empty) == "thing"
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputDirError, match="not a directory"):
        write_kind(f, "thing", force=True)
    link = tmp_path / "link"
    link.symlink_to(empty)
    with pytest.raises(OutputDirError, match="symbolic link"):
        write_kind(link, "thing", force=True)
    assert f.read_text() == "x" and (empty / "data.txt").read_text() == "v1"


def test_legacy_predicate_vouches_for_markerless_output(tmp_path):
    out = tmp_path / "old"
    out.mkdir()
    (out / "data.txt").write_text("old")
    with pytest.raises(OutputDirError):
        write_kind(out, "thing", force=True)
    write_kind(out, "thing", "new", force=True, legacy=lambda p: (p / "data.txt").is_file())
    assert (out / "data.txt").read_text() == "new" and owner(out) == "thing"


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_errors_and_ctrl_c_leave_previous_output_and_nothing_else(tmp_path, exc):
    out = tmp_path / "o"
    write_kind(out, "thing")
    with pytest.raises(type(exc)):
        with staged_output(out, "thing", force=True) as tmp:
            (tmp / "data.txt").write_text("half")
            raise exc
    assert (out / "data.txt").read_text() == "v1" and not siblings(out)


def test_disk_full_is_a_clear_error_and_leaves_previous_output(tmp_path):
    out = tmp_path / "o"
    write_kind(out, "thing")
    for err in (OSError(errno.ENOSPC, "No space left on device"),
                RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")):
        with pytest.raises(OutputDirError, match="no space left on the device"):
            with staged_output(out, "thing", force=True) as tmp:
                (tmp / "data.txt").write_text("half")
                raise err
    assert (out / "data.txt").read_text() == "v1" and not siblings(out)


def test_sigterm_leaves_previous_output_and_nothing_else(tmp_path):
    out = tmp_path / "o"
    write_kind(out, "thing")
    code = textwrap.dedent(f"""
        import sys, time
        from retrace.output_dir import staged_output
        with staged_output({str(out)!r}, "thing", force=True) as tmp:
            (tmp / "data.txt").write_text("half")
            print("ready", flush=True)
            time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert (out / "data.txt").read_text() == "v1" and not siblings(out)


def test_stale_temp_siblings_of_dead_processes_are_swept(tmp_path):
    out = tmp_path / "o"
    dead = [tmp_path / f".o.{tag}-999999999-abcd" for tag in ("retrace-tmp", "retrace-old", "building", "tmp")]
    for d in dead:
        d.mkdir()
        (d / "junk").write_text("x")
    alive = tmp_path / f".o.retrace-tmp-{os.getppid()}-abcd"
    alive.mkdir()
    other = tmp_path / ".other.retrace-tmp-999999999-abcd"  # another output's: not ours to judge here
    other.mkdir()
    sweep_stale(out)
    assert not any(d.exists() for d in dead) and alive.exists() and other.exists()
    write_kind(out, "thing")  # a run sweeps too
    assert siblings(out) == [alive.name]


def test_claim_in_place_marks_and_reports_existing_output(tmp_path):
    out = tmp_path / "d"
    assert claim_in_place(out, "drafter") is False and owner(out) == "drafter"
    (out / "model.safetensors").write_text("x")
    assert claim_in_place(out, "drafter") is True


# -- engine bundles built before markers existed ----------------------------------------------------------------
def fake_bundle(root: Path) -> Path:
    (root / "target").mkdir(parents=True)
    (root / "target" / "model.onnx").write_bytes(b"graph")
    write_manifest(root, {"limits": {"max_batch": 8, "max_seq_len": 64, "block_size": 4}})
    return root


def test_markerless_bundle_is_replaceable_only_when_it_verifies_and_holds_nothing_else(tmp_path):
    b = fake_bundle(tmp_path / "b")
    assert is_complete_bundle(b)
    assert check_output(b, "engine-bundle", True, is_complete_bundle) is True
    (b / "main.py").write_text("user code")  # a user's file beside a bundle: not ours to delete
    assert not is_complete_bundle(b)
    with pytest.raises(OutputDirError, match="not an engine-bundle written by retrace"):
        check_output(b, "engine-bundle", True, is_complete_bundle)
    (b / "main.py").unlink()
    (b / "target" / "model.onnx").write_bytes(b"GRAPH")  # modified: not verifiable as ours either
    assert not is_complete_bundle(b)


# -- the commands ---------------------------------------------------------------------------------------------
def test_zoo_refuses_a_users_directory_even_with_force(tmp_path):
    from retrace.cli import main

    d = user_dir(tmp_path / "w")
    for extra in ([], ["--force"]):
        res = CliRunner().invoke(main, ["zoo", "tiny", "--size", "test", "--out", str(d), "--quiet", *extra])
        assert res.exit_code == 2 and "not a zoo written by retrace" in res.output, res.output
    assert sorted(p.name for p in d.iterdir()) == ["important.txt"] and not siblings(d)


def test_zoo_of_another_size_needs_force(tmp_path):
    from retrace.cli import main

    z = tmp_path / "z"  # a marker-less zoo (an older retrace's): its manifest and nothing else of its own
    (z / "target").mkdir(parents=True)
    (z / "manifest.json").write_text(json.dumps({"key": {"zoo_version": 1}, "size": "small", "seed": 0}))
    res = CliRunner().invoke(main, ["zoo", "tiny", "--size", "test", "--out", str(z), "--quiet"])
    assert res.exit_code == 2 and "holds a zoo of size 'small'" in res.output and "--force" in res.output
    assert json.loads((z / "manifest.json").read_text())["size"] == "small"


def test_triton_force_refuses_a_users_directory(tmp_path):
    from retrace.export.cli import main

    b = fake_bundle(tmp_path / "b")
    u = user_dir(tmp_path / "u")
    res = CliRunner().invoke(main, ["triton", "--engine", str(b), "--out", str(u), "--no-env", "--force"])
    assert res.exit_code == 2 and "not a Triton model repository written by retrace" in res.output
    assert sorted(p.name for p in u.iterdir()) == ["important.txt"] and not siblings(u)


def test_triton_refuses_a_bundle_that_does_not_verify(tmp_path):
    from retrace.export.cli import main

    b = fake_bundle(tmp_path / "b")
    (b / "target" / "model.onnx").write_bytes(b"GRAPH")
    res = CliRunner().invoke(main, ["triton", "--engine", str(b), "--out", str(tmp_path / "r"), "--no-env"])
    assert res.exit_code == 2 and "does not match its manifest" in res.output
    assert not (tmp_path / "r").exists()


def test_build_force_refuses_a_project_with_a_copied_manifest(tiny_pair, tmp_path):
    from retrace.export.cli import main

    pair = tiny_pair()
    b = fake_bundle(tmp_path / "b")
    proj = user_dir(tmp_path / "proj")
    (proj / "manifest.json").write_bytes((b / "manifest.json").read_bytes())
    before = sorted(p.name for p in proj.iterdir())
    args = ["build", "--target", str(pair.target_dir), "--drafter", str(pair.drafter_dir), "-q"]
    res = CliRunner().invoke(main, [*args, "--out", str(proj), "--force"])
    assert res.exit_code == 2 and "not an engine bundle written by retrace" in res.output, res.output
    assert sorted(p.name for p in proj.iterdir()) == before
    # --triton-repo is checked before the (long) build: a user's directory is refused at once
    res = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "nb"), "--force", "--triton-repo", str(proj)])
    assert res.exit_code == 2 and "not a Triton model repository written by retrace" in res.output
    assert not (tmp_path / "nb").exists()


def test_zoo_sigterm_leaves_nothing_and_a_rerun_sweeps_what_a_kill_left(tmp_path):
    out = tmp_path / "z"
    killed = tmp_path / ".z.tmp-999999999-abcd1234"  # what a SIGKILLed older zoo left behind
    killed.mkdir()
    code = "import sys; from retrace.cli import main; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code, "zoo", "tiny", "--size", "test", "--out", str(out),
                             "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".z.retrace-tmp-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()
    assert not killed.exists()  # swept before building
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err, err
    assert not out.exists() and not siblings(out)


# -- an output path that cannot be written: one clear line before any work, never a traceback ------------------
def _fake_zoo(root: Path) -> Path:
    for f in ("target/config.json", "target/model.safetensors", "drafter/config.json", "drafter/model.safetensors",
              "drafter/retrace_config.json", "drafter/retrace.safetensors", "prompts/code.jsonl"):
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("{}")
    return root


def _command(which: str, tmp_path: Path, tiny_pair):
    from retrace.cli import main as retrace_main
    from retrace.export.cli import main as export_main

    nowhere = str(tmp_path / "absent")
    if which == "export build":
        return export_main, ["build", "--target", str(tiny_pair(layers=2).target_dir), "-q"]
    if which == "triton":
        return export_main, ["triton", "--engine", str(fake_bundle(tmp_path / "b")), "--no-env"]
    if which == "zoo inflate":
        return retrace_main, ["zoo", "inflate", "--from", str(_fake_zoo(tmp_path / "zoo")), "--shape", "qwen3-0.6b",
                              "--quiet"]
    if which == "zoo tiny":
        return retrace_main, ["zoo", "tiny", "--size", "test", "--quiet"]
    if which == "train dflash":
        return retrace_main, ["train", "dflash", "--target", nowhere, "--data", nowhere, "--quiet"]
    return retrace_main, ["train", "conditioner", "--target", nowhere, "--drafter", nowhere, "--data", nowhere,
                          "--quiet"]


COMMANDS = ["export build", "triton", "zoo tiny", "zoo inflate", "train dflash", "train conditioner"]


@pytest.mark.parametrize("why", ["below-a-file", "permission-denied"])
@pytest.mark.parametrize("which", COMMANDS)
def test_an_unwritable_output_path_is_one_clear_error(tmp_path, tiny_pair, monkeypatch, which, why):
    """As root every directory is writable, so "permission denied" is os.access saying no (what it says for
    another user's directory or a read-only file system); "below a file" is real."""
    main, args = _command(which, tmp_path, tiny_pair)
    parent = tmp_path / "ro"
    if why == "below-a-file":
        parent.write_text("a file, not a directory")
        needle = f"{parent} is not a directory"
    else:
        parent.mkdir()
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: False if Path(p) == parent else real(p, mode, **k))
        needle = f"{parent} is not writable"
    out = parent / "out" / "deeper"
    res = CliRunner().invoke(main, [*args, "--out", str(out)])
    assert res.exit_code == 2 and f"error: cannot write {out}: {needle}" in res.output, res.output
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    assert parent.is_file() or not any(parent.iterdir())  # nothing created, no temp sibling


def test_an_os_error_deep_in_a_command_is_one_line(tmp_path, monkeypatch):
    """Whatever a command may not read or write later on (here: a file training opens) is one line naming the
    path, exit 2, not a traceback."""
    import retrace.train.dflash as dflash
    from retrace.cli import main

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "locked.jsonl"))

    monkeypatch.setattr(dflash, "_train_dflash", denied)
    res = CliRunner().invoke(main, ["train", "dflash", "--target", "t", "--data", "p", "--out", str(tmp_path / "d"),
                                    "--quiet"])
    assert res.exit_code == 2 and res.output.strip() == f"error: {tmp_path / 'locked.jsonl'}: Permission denied"
    assert not (tmp_path / "d").exists()  # the fresh OUT it had claimed is gone again
