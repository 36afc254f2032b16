"""DFlash distillation: loss goes down on a tiny target; checkpoints resume to the identical run; format."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import write_target
from safetensors.torch import load_file

from retrace.errors import RetraceError
from retrace.models.config import DrafterConfig
from retrace.train.dflash import DFlashConfig, find_mask_token_id, train_dflash

pytestmark = pytest.mark.usefixtures("one_thread")


def write_prompts(path, n=40, vocab=128, seed=0):
    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt_ids": [r.randrange(3, vocab - 1) for _ in range(r.randint(4, 12))]}) + "\n")
    return path


def small_cfg(**kw):
    base = dict(block_size=8, num_layers=1, mask_token_id=127, steps=12, batch_size=4, blocks_per_seq=6,
                val_prompts=8, max_new_tokens=16, gen_batch=40, eval_every=12, save_every=0, eval_tau_prompts=4,
                eval_tau_new_tokens=12, warmup=2, lr=3e-3, device="cpu", threads=1)
    base.update(kw)
    return DFlashConfig(**base)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    target = write_target(d / "target", vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96)
    return target, write_prompts(d / "p.jsonl")


def test_training_reduces_loss_and_writes_zlab_format(setup, tmp_path):
    target, prompts = setup
    m = train_dflash(target, tmp_path / "d", prompts, small_cfg(steps=24, eval_every=12), progress=False)
    hist = m["history"]
    assert hist[0]["step"] == 0 and hist[-1]["step"] == 24
    assert hist[-1]["val_loss"] < hist[0]["val_loss"] - 0.1
    cfg = DrafterConfig.from_dir(tmp_path / "d")
    assert cfg.block_size == 8 and cfg.mask_token_id == 127
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and "dflash_config" in raw
    names = set(load_file(str(tmp_path / "d" / "model.safetensors")))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's, never saved with the drafter
    assert m["mask_row"]["ratio"] > 0.1
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "d").iterdir() if f.is_file()}
    assert len(set(modes.values())) == 1, modes  # no 0600 files among the 0644 ones
    assert m["val_runtime_tau"]["tau_mean"] >= 1.0


def test_resume_gives_identical_continuation(setup, tmp_path):
    target, prompts = setup
    cfg = small_cfg(steps=8, eval_every=0, eval_tau_prompts=0)
    train_dflash(target, tmp_path / "full", prompts, cfg, progress=False)
    cfg_a = small_cfg(steps=8, eval_every=0, eval_tau_prompts=0, stop_after=5)
    m = train_dflash(target, tmp_path / "split", prompts, cfg_a, progress=False)
    assert m["stopped"] and m["steps"] == 5
    state = json.loads((tmp_path / "split" / "train_state" / "state.json").read_text())
    assert state["step"] == 5
    assert not list((tmp_path / "split" / "train_state").glob("*.pt*"))  # no pickles
    train_dflash(target, tmp_path / "split", prompts, cfg, resume=True, progress=False)
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # a checkpoint made with other settings is refused
    with pytest.raises(RetraceError, match="different settings"):
        train_dflash(target, tmp_path / "split", prompts, small_cfg(steps=8, lr=1e-2), resume=True, progress=False)


def test_mask_token_lookup(tmp_path):
    tok = {"added_tokens": [{"id": 0, "content": "<|endoftext|>"}, {"id": 2, "content": "<|mask|>"}],
           "model": {"vocab": {}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    assert find_mask_token_id(tmp_path, 100) == 2
    assert find_mask_token_id(tmp_path, 100, 7) == 7
    with pytest.raises(RetraceError, match="--mask-token-id"):
        find_mask_token_id(tmp_path / "nowhere", 100)
    with pytest.raises(RetraceError, match="outside"):
        find_mask_token_id(tmp_path, 100, 100)


def test_taps_captured_while_generating_equal_clean_taps(setup):
    from retrace.models.target import Qwen3Target
    from retrace.train.rollout import generate
    from retrace.train.taps import compute_taps

    target_dir, _ = setup
    t = Qwen3Target.from_pretrained(target_dir, tap_layers=(1,))
    ps = [[5, 6, 7], [9, 10, 11, 12, 13, 14], [20]]
    outs, taps = generate(t, ps, 10, max_batch=2, return_taps=True)
    clean = compute_taps(t, [p + o for p, o in zip(ps, outs, strict=True)], 3, torch.device("cpu"),
                         store_dtype=torch.float32)
    for p, o, a, b in zip(ps, outs, taps, clean, strict=True):
        assert a.shape[0] == len(p) + len(o) - 1  # the last token is never fed
        assert (a.float() - b[:-1]).abs().max() < 1e-2  # fp16 storage


def test_generation_in_worker_processes_matches(setup):
    from retrace.models.target import Qwen3Target
    from retrace.train import common as cm
    from retrace.train.rollout import generate, generate_shard

    target_dir, _ = setup
    ps = [[5, 6, 7], [9, 10, 11, 12], [20], [30, 31]]
    t = Qwen3Target.from_pretrained(target_dir, tap_layers=(1,))
    outs, taps = generate(t, ps, 8, max_batch=4, return_taps=True)
    parts = cm.parallel_map(generate_shard, [(str(target_dir), (1,), ps[r.start : r.stop], 8, 4, 0.0, r.start, True)
                                             for r in cm.shards(len(ps), 2)], workers=2)
    assert [o for p in parts for o in p[0]] == outs
    for a, b in zip([x for p in parts for x in p[1]], taps, strict=True):
        assert a.shape == b.shape and (a.float() - b.float()).abs().max() < 1e-2
    assert [i for r in cm.shards(5, 2) for i in r] == list(range(5)) and len(cm.shards(5, 2)) == 2


def test_soft_label_loss_is_kl_to_the_target():
    """KL(target || drafter) per slot: 0 when the drafter's logits equal the target's (up to a shift), and the
    same as cross-entropy minus the target's entropy, so a one-hot target gives plain CE."""
    from retrace.train import blocks as bl

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, 50, generator=g)
    labels = torch.randint(0, 50, (2, 3, 7), generator=g)
    w = bl.loss_weights(8, 7.0)
    assert bl.block_loss(logits, labels, w, target_logits=logits + 3.0)[0].item() == pytest.approx(0.0, abs=1e-5)
    one_hot = torch.full_like(logits, -1e4).scatter(-1, labels.unsqueeze(-1), 0.0)
    ce = bl.block_loss(logits, labels, w)[0]
    assert bl.block_loss(logits, labels, w, target_logits=one_hot)[0].item() == pytest.approx(ce.item(), rel=1e-5)


def test_soft_labels_training_matches_the_target_distribution_better(setup, tmp_path):
    """--soft-labels: the drafter learns the target's distribution at each slot; after the same steps its
    validation KL to the target is lower than a hard-label drafter's (what raises T=1 acceptance)."""
    from retrace.models.drafter import load_pair
    from retrace.train import blocks as bl
    from retrace.train.batches import sample_anchors
    from retrace.train.dflash import _batch_forward, _Data

    target, prompts = setup
    kls = {}
    for soft in (False, True):
        out = tmp_path / f"d{int(soft)}"
        m = train_dflash(target, out, prompts, small_cfg(steps=40, eval_every=40, soft_labels=soft), progress=False)
        assert m["history"][-1]["val_loss"] < m["history"][0]["val_loss"]
        tgt, drafter = load_pair(target, out)
        seqs = [list(range(3, 40)), list(range(10, 50))]
        anchors, bw = sample_anchors([len(s) for s in seqs], [4, 4], 4, torch.Generator().manual_seed(1))
        cfg = small_cfg(soft_labels=True)
        with torch.no_grad():
            kls[soft] = _batch_forward(drafter, tgt, _Data(seqs, [4, 4], None), [0, 1], anchors, bw, cfg,
                                       torch.device("cpu"), bl.loss_weights(8, 7.0), False)[0].item()
    assert kls[True] < kls[False]
