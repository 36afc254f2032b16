"""Training at user scale: torchrun data parallel (gloo on CPU) equals gradient accumulation, chat data through
the target's chat template, data files of every supported kind, and clear errors."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import write_target
from safetensors.torch import load_file

from retrace.errors import RetraceError
from retrace.train import datasets_io as dio
from retrace.train.batches import data_streams
from retrace.train.datasets_io import prepare_prompts
from retrace.train.dflash import DFlashConfig, train_dflash
from retrace.train.distributed import grad_accum_for

pytestmark = pytest.mark.usefixtures("one_thread")


OPTS = dict(block_size=8, mask_token_id=127, steps=12, batch_size=4, blocks_per_seq=6, val_prompts=8, max_new_tokens=16,
            gen_batch=40, eval_every=0, save_every=0, warmup=2, lr=3e-3, device="cpu", threads=1, eval_tau_prompts=0)


def _cli_args(**kw) -> list[str]:
    return [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    target = write_target(d / "target", vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
    r = random.Random(0)
    with open(d / "p.jsonl", "w") as f:
        for _ in range(40):
            f.write(json.dumps({"prompt_ids": [r.randrange(3, 127) for _ in range(r.randint(4, 12))]}) + "\n")
    return target, d / "p.jsonl"


def _launch(*args: str) -> dict:
    """`torchrun --nproc-per-node 2 --no-python retrace train ARGS --quiet --json` on CPU (gloo); its metrics."""
    exe = Path(sys.executable).parent / "retrace"
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
           str(exe), "train", *args, "--quiet", "--json"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    for _ in range(2):
        if run.returncode == 0 or "terminate called without an active exception" not in run.stderr:
            break
        # gloo's threads aborting a rank (SIGABRT) on a loaded CI machine under pytest-xdist, twice in a row once,
        # before the workers ended with retrace.train.distributed.end_worker: retries (replacing what the aborted
        # run left at --out, unless it resumes from there), then the failure
        again = cmd if "--resume" in cmd else [*cmd, "--force"]
        run = subprocess.run(again, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"stdout: {run.stdout[-500:]}\nstderr: {run.stderr[-3000:]}"
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints
    assert lines[0]["world_size"] == 2
    return lines[0]


def _torchrun(target, prompts, out: Path, *extra: str) -> dict:
    """2-process `retrace train dflash` with OPTS."""
    cli = {k: v for k, v in OPTS.items() if k not in ("eval_tau_prompts",)}
    m = _launch("dflash", "--target", str(target), "--data", str(prompts), "--out", str(out), *_cli_args(**cli),
                *extra)
    assert m["global_batch"] == 8
    return m


@pytest.fixture(scope="module")
def one_process(setup, tmp_path_factory):
    """One process with --grad-accum 2 (the same batches as 2 processes x 1), 4 (as 2 processes x 2) and 1
    (other batches)."""
    target, prompts = setup
    d = tmp_path_factory.mktemp("one")
    for a in (2, 4, 1):
        train_dflash(target, d / f"accum{a}", prompts, DFlashConfig(**OPTS, grad_accum=a), progress=False)
    return {a: load_file(str(d / f"accum{a}" / "model.safetensors")) for a in (2, 4, 1)}


def _same_as_accumulation(out: Path, one_process: dict, what: str, accum: int = 2) -> None:
    """out's weights == one process with `accum` (to rounding), far from one with other batches."""
    w, ref, far = load_file(str(out / "model.safetensors")), one_process[accum], one_process[1]
    same, other = _max_diff(w, ref), _max_diff(ref, far)
    print(f"max |w_{what} - w_accum{accum}| = {same:.3e}; max |w_accum{accum} - w_accum1| = {other:.3e}")
    assert same < 1e-4
    assert other > 1000 * same


def _resume_in_one_process(target, prompts, out: Path) -> None:
    """The 2-process checkpoint resumes in one process (2 data shards -> 1) and continues from step 12."""
    m = train_dflash(target, out, prompts, DFlashConfig(**{**OPTS, "steps": 14}), resume=True, progress=False)
    assert m["steps"] == 14 and m["world_size"] == 1 and not m["fsdp"]
    state = json.loads((out / "train_state" / "state.json").read_text())
    assert state["step"] == 14 and state["info"]["streams"] and len(state["info"]["streams"]) == 1


def test_two_gloo_processes_equal_one_process_with_twice_the_accumulation(setup, one_process, tmp_path):
    """torchrun --nproc-per-node 2 (gloo, CPU) for 12 steps == one process with --grad-accum 2 and the same seed,
    to rounding; a different batch (one process, --grad-accum 1) lands far away. Then the 2-process
    checkpoint resumes in one process (a change of world size)."""
    target, prompts = setup
    assert not _torchrun(target, prompts, tmp_path / "ddp")["fsdp"]
    assert sorted(p.name for p in (tmp_path / "ddp" / "train_data").iterdir()) == [
        "responses.json", "taps-rank0-of-2.safetensors", "taps-rank1-of-2.safetensors"]
    _same_as_accumulation(tmp_path / "ddp", one_process, "ddp2")
    _resume_in_one_process(target, prompts, tmp_path / "ddp")


def test_fsdp_equals_one_process_and_its_checkpoint_is_a_full_one(setup, one_process, tmp_path):
    """--fsdp (FSDP2 on gloo: the drafter, its gradients and AdamW moments sharded over 2 processes) trains the
    same weights as one process with twice the accumulation (every step's gradient norm, 1.1-2.2, is above
    --grad-clip 1, so this also shows clipping takes the global norm, not each shard's); its checkpoint holds
    the full, unsharded tensors in the one-process format and resumes in one process; a one-process checkpoint
    resumes under --fsdp with accumulation (sharded on load) and continues exactly."""
    target, prompts = setup
    assert _torchrun(target, prompts, tmp_path / "fsdp", "--fsdp")["fsdp"]
    _same_as_accumulation(tmp_path / "fsdp", one_process, "fsdp2")
    ref = tmp_path / "ref"
    train_dflash(target, ref, prompts, DFlashConfig(**{**OPTS, "steps": 1}), progress=False)
    got, want = (load_file(str(p / "train_state" / "state.safetensors")) for p in (tmp_path / "fsdp", ref))
    assert {k: v.shape for k, v in got.items() if not k.startswith("rng.")} == {
        k: v.shape for k, v in want.items() if not k.startswith("rng.")}
    meta = json.loads((tmp_path / "fsdp" / "train_state" / "state.json").read_text())
    assert meta["info"]["fsdp"] and meta["step"] == 12
    _resume_in_one_process(target, prompts, tmp_path / "fsdp")

    # one process with --grad-accum 4, stopped after 6 of 12 steps -> resumed by 2 processes with --fsdp and
    # --grad-accum 2 (the same 4 data streams; the gradients reduce-scattered on the last micro-batch only)
    half = tmp_path / "half"
    train_dflash(target, half, prompts, DFlashConfig(**OPTS, grad_accum=4, stop_after=6), progress=False)
    assert json.loads((half / "train_state" / "state.json").read_text())["step"] == 6
    m = _launch("dflash", "--target", str(target), "--data", str(prompts), "--out", str(half), "--fsdp", "--resume",
                *_cli_args(**{k: v for k, v in OPTS.items() if k != "eval_tau_prompts"}), "--grad-accum", "2")
    assert m["steps"] == 12 and m["global_batch"] == 16
    _same_as_accumulation(half, one_process, "1proc6+fsdp6", accum=4)


def test_fsdp_conditioner_equals_ddp(setup, tmp_path):
    """train conditioner under --fsdp (the conditioner sharded, the frozen drafter ignored by FSDP and
    replicated) gives the weights and the checkpoint of DDP, and that checkpoint resumes in one process."""
    from helpers import write_drafter

    from retrace.train.conditioner import ConditionerConfig, train_conditioner

    target, prompts = setup
    drafter = write_drafter(tmp_path / "drafter", target, layers=1, block_size=8)
    opts = dict(phases=1, steps_per_phase=4, rollout_prompts=12, rollout_batch=12, max_new_tokens=20, val_prompts=8,
                eval_prompts=0, batch_size=4, blocks_per_seq=6, warmup=1, device="cpu", threads=1)
    args = ["conditioner", "--target", str(target), "--drafter", str(drafter), "--data", str(prompts), "--reinit",
            *_cli_args(**opts)]
    for kind in ("ddp", "fsdp"):
        m = _launch(*args, "--out", str(tmp_path / kind), *(["--fsdp"] if kind == "fsdp" else []))
        assert m["fsdp"] == (kind == "fsdp") and m["steps"] == 4
    for f in ("retrace.safetensors", "conditioner_state/state.safetensors"):
        a, b = (load_file(str(tmp_path / k / f)) for k in ("ddp", "fsdp"))
        a, b = ({k: v for k, v in x.items() if not k.startswith("rng.")} for x in (a, b))
        assert _max_diff(a, b) < 1e-5, f
    m = train_conditioner(target, drafter, prompts, tmp_path / "fsdp", ConditionerConfig(**{**opts, "phases": 2},
                          reinit=True), resume=True, progress=False)
    assert m["phases"] == 2 and m["steps"] == 8 and m["world_size"] == 1


def _chat_target(root: Path, template: bool = True) -> Path:
    """A tiny target with a byte-level tokenizer (the zoo's, with or without its chat template)."""
    from retrace.train import tokenizer as tk

    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(50)] + ["hello world, how are you?"] * 5
    tok = tk.train_bpe(texts, 300)
    t = write_target(root / "target", vocab=300, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48)
    tk.save_tokenizer(tok, t)
    if not template:
        cfg = json.loads((t / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (t / "tokenizer_config.json").write_text(json.dumps(cfg))
        for f in t.glob("chat_template*"):
            f.unlink()
    return t


CONVS = [
    [{"role": "user", "content": "def f1(x):"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
     {"role": "assistant", "content": "world"}, {"role": "user", "content": "how are you?"},
     {"role": "assistant", "content": "fine (dropped: the target regenerates it)"}],
] * 6


def test_chat_data_from_jsonl_parquet_and_datasets_dirs(tmp_path):
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer

    t = _chat_target(tmp_path)
    rows = [{"messages": c, "id": i} for i, c in enumerate(CONVS)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "chat.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved_dict"))
    tok = AutoTokenizer.from_pretrained(str(t))
    want_text = ["def f1(x):", "be briefhelloworld<|endoftext|>how are you?"] * 6  # the zoo's minimal template
    want = [tok(w, add_special_tokens=False)["input_ids"] for w in want_text]
    for src in ("chat.jsonl", "chat.parquet", "saved", "saved_dict"):
        tr, va = prepare_prompts(t, tmp_path / src, 256, None, 3, 0, chat=True)
        assert sorted(tr + va) == sorted(want), src
    # plain prompts from Parquet too
    datasets.Dataset.from_list([{"prompt": "hello"}] * 8).to_parquet(str(tmp_path / "plain.parquet"))
    tr, va = prepare_prompts(t, tmp_path / "plain.parquet", 256, None, 0, 0)
    assert tr == [tok("hello", add_special_tokens=False)["input_ids"]] * 8

    # end to end: a drafter trained on chat data (the responses regenerated by the target)
    m = train_dflash(t, tmp_path / "d", tmp_path / "chat.parquet",
                     DFlashConfig(**{**OPTS, "mask_token_id": 2, "steps": 2, "val_prompts": 2}, chat=True),
                     progress=False)
    assert m["steps"] == 2 and m["train_sequences"] >= 8


def test_clear_errors(tmp_path):
    datasets = pytest.importorskip("datasets")
    t = _chat_target(tmp_path, template=False)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS))
    with pytest.raises(RetraceError, match="no chat template"):
        prepare_prompts(t, tmp_path / "chat.jsonl", 256, None, 0, 0, chat=True)
    with pytest.raises(RetraceError, match="'prompt' or 'prompt_ids' column.*--chat"):
        prepare_prompts(t, tmp_path / "chat.jsonl", 256, None, 0, 0)
    datasets.Dataset.from_list([{"text": "x"}] * 4).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(RetraceError, match="'messages' column"):
        dio.chat_prompts(dio.read_rows(tmp_path / "t.parquet"), t)
    with pytest.raises(RetraceError, match="no user turn"):
        dio.chat_prompts([{"messages": [{"role": "system", "content": "x"}]}], _chat_target(tmp_path / "b"))
    with pytest.raises(RetraceError, match="not found"):
        dio.read_rows(tmp_path / "missing.parquet")
    # batch / world size that do not divide; shards left empty
    assert grad_accum_for(4, None, 64, 8) == 2
    with pytest.raises(RetraceError, match="not a multiple"):
        grad_accum_for(4, None, 60, 8)
    with pytest.raises(RetraceError, match="!="):
        grad_accum_for(4, 3, 64, 8)
    with pytest.raises(RetraceError, match="cannot be split into 8"):
        data_streams([0, 1, 2], 3, 8, "d.jsonl")
    with pytest.raises(RetraceError, match="shard 1 of 2 .* no usable"):
        data_streams([0, 2], 4, 2, "d.jsonl")


def test_cli_errors_have_no_traceback(setup, tmp_path):
    from click.testing import CliRunner

    from retrace.cli import main

    target, prompts = setup
    r = CliRunner().invoke(main, ["train", "dflash", "--target", str(target), "--data", str(prompts), "--out",
                                  str(tmp_path / "o"), "--batch-size", "4", "--global-batch", "6", "--device", "cpu"])
    assert r.exit_code != 0 and "not a multiple" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["train", "dflash", "--target", str(target), "--data", str(prompts), "--out",
                                  str(tmp_path / "o"), "--chat", "--device", "cpu", "--mask-token-id", "127"])
    assert r.exit_code != 0 and "Traceback" not in r.output and "messages" in r.output
