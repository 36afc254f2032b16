"""Resuming training safely: a checkpoint is checked (kind, settings, step, whole files) before the target
generates a single response or train_data/ is touched; a conditioner trained beside its drafter (no --out)
keeps the drafter's own checkpoint resumable. Tiny target, the smallest settings the training tests use."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import write_target
from safetensors.torch import load_file
from test_train_dflash import small_cfg, write_prompts

from retrace.errors import RetraceError
from retrace.train import dflash as dflash_mod
from retrace.train import rollout as rollout_mod
from retrace.train.conditioner import ConditionerConfig, train_conditioner
from retrace.train.dflash import train_dflash

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = dict(steps=8, eval_every=0, eval_tau_prompts=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("resume")
    target = write_target(d / "target", vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
    prompts = write_prompts(d / "p.jsonl")
    split = d / "split"
    train_dflash(target, split, prompts, small_cfg(**CFG, stop_after=5), progress=False)
    return target, prompts, split


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _files(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_conditioner_beside_the_drafter_keeps_its_checkpoint_resumable(setup, tmp_path):
    """`train conditioner --drafter D` (no --out) used to overwrite D/train_state with its own checkpoint: a
    later `train dflash --out D --resume` failed ("checkpoint lacks parameters ['fc.weight', ...]"). Now the
    conditioner checkpoints into D/conditioner_state and the drafter's run continues to the very weights of
    an uninterrupted run."""
    target, prompts, split = setup
    d = _copy(split, tmp_path / "d")
    state = (d / "train_state" / "state.safetensors").read_bytes()
    ccfg = ConditionerConfig(phases=1, steps_per_phase=2, rollout_prompts=8, rollout_batch=8, max_new_tokens=12,
                             val_prompts=8, eval_prompts=0, batch_size=4, blocks_per_seq=4, warmup=1, device="cpu",
                             threads=1)
    train_conditioner(target, d, prompts, None, ccfg, progress=False)
    assert (d / "retrace.safetensors").is_file() and (d / "conditioner_state" / "state.json").is_file()
    assert (d / "train_state" / "state.safetensors").read_bytes() == state
    assert json.loads((d / "conditioner_state" / "state.json").read_text())["info"]["kind"] == "conditioner"

    train_dflash(target, d, prompts, small_cfg(**CFG), resume=True, progress=False)
    full = tmp_path / "full"
    train_dflash(target, full, prompts, small_cfg(**CFG), progress=False)
    _same_weights(full, d)
    # the new drafter's conditioner and its checkpoint were for the old drafter: both gone
    assert not (d / "retrace.safetensors").exists() and not (d / "conditioner_state").exists()

    # --force over it: a staged run (its responses cache linked in: nothing regenerated) that replaces it
    forced = _copy(d, tmp_path / "forced")
    (forced / "retrace.safetensors").write_bytes(b"a stale conditioner")
    generate = rollout_mod.generate  # the target's generation (retrace.train.response_cache calls it there)
    rollout_mod.generate = lambda *a, **k: pytest.fail("regenerated the cached responses")
    try:
        train_dflash(target, forced, prompts, small_cfg(**CFG), force=True, progress=False)
    finally:
        rollout_mod.generate = generate
    _same_weights(full, forced)
    assert not (forced / "retrace.safetensors").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp sibling left


def _same_weights(a_dir, b_dir):
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("change", [dict(num_prompts=30), dict(max_new_tokens=12)], ids=["num-prompts", "max-new"])
def test_refused_resume_generates_nothing_and_keeps_train_data(setup, tmp_path, monkeypatch, change):
    target, prompts, split = setup
    d = _copy(split, tmp_path / "d")
    before = _files(d)
    assert "train_data/responses.json" in before and "train_data/taps.safetensors" in before

    def no_generation(*a, **k):
        raise AssertionError("the target generated responses before the resume was refused")

    monkeypatch.setattr(rollout_mod, "generate", no_generation)
    monkeypatch.setattr(dflash_mod, "load_target", no_generation)
    with pytest.raises(RetraceError, match="made with different settings"):
        train_dflash(target, d, prompts, small_cfg(**CFG, **change), resume=True, progress=False)
    assert _files(d) == before


def _patch_state(d, **kw):
    p = d / "train_state" / "state.json"
    meta = json.loads(p.read_text())
    meta.update(kw)
    p.write_text(json.dumps(meta))


@pytest.mark.parametrize("case,needle", [
    ("step-negative", "step -5 is not a step count"),
    ("step-huge", "step 1000000000000 is beyond this run's 8 steps"),
    ("step-float", "step 5.5 is not a step count"),
    ("json-garbage", "state.json: not a readable training checkpoint"),
    ("json-list", "training checkpoint version None"),
    ("tensors-truncated", "state.safetensors: cannot read the training checkpoint"),
    ("kind-conditioner", "is a 'conditioner' one, not 'dflash'"),
])
def test_a_damaged_checkpoint_is_refused_before_generation(setup, tmp_path, monkeypatch, case, needle):
    target, prompts, split = setup
    d = _copy(split, tmp_path / "d")
    st = d / "train_state"
    if case == "step-negative":
        _patch_state(d, step=-5)
    elif case == "step-huge":
        _patch_state(d, step=10**12)
    elif case == "step-float":
        _patch_state(d, step=5.5)
    elif case == "json-garbage":
        (st / "state.json").write_bytes(b"\x00{not json")
    elif case == "json-list":
        (st / "state.json").write_text("[1, 2]")
    elif case == "tensors-truncated":
        b = (st / "state.safetensors").read_bytes()
        (st / "state.safetensors").write_bytes(b[: len(b) // 2])
    else:
        meta = json.loads((st / "state.json").read_text())
        meta["info"]["kind"] = "conditioner"
        (st / "state.json").write_text(json.dumps(meta))
    before = _files(d)
    monkeypatch.setattr(dflash_mod, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(RetraceError) as e:
        train_dflash(target, d, prompts, small_cfg(**CFG), resume=True, progress=False)
    assert needle in str(e.value), str(e.value)
    assert _files(d) == before


def test_cli_prints_the_damaged_checkpoint_error_without_a_traceback(setup, tmp_path):
    from click.testing import CliRunner

    from retrace.cli import main

    target, prompts, split = setup
    d = _copy(split, tmp_path / "d")
    (d / "train_state" / "state.json").write_text("garbage")
    res = CliRunner().invoke(main, ["train", "dflash", "--target", str(target), "--data", str(prompts), "--out",
                                    str(d), "--resume", "--quiet", "--device", "cpu", "--steps", "8"])
    assert res.exit_code == 2 and "not a readable training checkpoint" in res.output, res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("damage,needle", [
    ("garbage", "conditioner_state/state.json: not a readable training checkpoint"),
    ("step", "step -5 is not a step count"),
])
def test_conditioner_resume_of_a_damaged_checkpoint_is_refused_before_loading(setup, tmp_path, monkeypatch, damage,
                                                                              needle):
    import retrace.train.conditioner as cond_mod

    target, prompts, split = setup
    d = _copy(split, tmp_path / "d")
    st = d / "conditioner_state"
    st.mkdir()
    (st / "state.safetensors").write_bytes((d / "train_state" / "state.safetensors").read_bytes())
    meta = json.loads((d / "train_state" / "state.json").read_text())
    meta["info"]["kind"] = "conditioner"
    meta["step"] = -5
    (st / "state.json").write_text("{oops" if damage == "garbage" else json.dumps(meta))
    monkeypatch.setattr(cond_mod, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(RetraceError, match=needle):
        train_conditioner(target, d, prompts, None, ConditionerConfig(device="cpu"), resume=True, progress=False)
