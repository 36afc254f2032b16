"""On-policy conditioner training: rollout records are exactly what the Scheduler fed the drafter (same
alignment, features and correction taps), a zero-init conditioner trains from exactly the DFlash loss, and
a few steps move it."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import max_diff

from retrace.runtime.suffix_memory import align, suffix_features
from retrace.train import blocks as bl
from retrace.train.conditioner import ConditionerConfig, Examples, block_losses, collate, train_conditioner
from retrace.train.rollout import rollout
from retrace.train.taps import compute_taps

pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(n=12, vocab=128, seed=0):
    r = random.Random(seed)
    return [[r.randrange(3, vocab - 1) for _ in range(r.randint(4, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target + drafter with a random (active) conditioner; drafts are often partly right because the
    drafter's context is the target's own taps, so there are rejected suffixes to remember."""
    from conftest import TinyPair
    from helpers import write_drafter, write_target

    d = tmp_path_factory.mktemp("cond")
    t = write_target(d / "target", vocab=128, hidden=64, layers=2)
    dr = write_drafter(d / "drafter", t, layers=1, block_size=8, conditioner="random")
    return TinyPair(t, dr)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rollout_records_match_the_runtime_alignment(pair, temperature):
    target, drafter = pair.load()
    B = drafter.config.block_size
    rolls = rollout(target, drafter, prompts(), 24, max_batch=5, temperature=temperature, seed=3,
                    keep_debug=True, keep_empty=True)
    checked = 0
    for r in rolls:
        assert len(r.rounds) == len(r.verify)  # one draft call per verify in retrace mode
        for prev, cur, vprev in zip(r.rounds, r.rounds[1:], r.verify, strict=False):
            a = cur.anchor_pos - prev.anchor_pos - 1
            assert vprev["anchor_pos"] == prev.anchor_pos
            old, valid, corr = align(torch.tensor([a]), B)
            assert torch.equal(cur.valid, valid[0].float())
            assert torch.equal(cur.corr_index, corr[0])
            v = valid[0].float().unsqueeze(-1)
            # memory = the drafter's hidden state at old slot j = k + a + 1 of the previous round
            assert torch.equal(cur.memory, prev.hidden[old[0]] * v)
            # features from the previous verify pass (target at j-1) and the previous draft (slot j)
            feats = suffix_features(vprev["block"].unsqueeze(0), vprev["logits"].unsqueeze(0),
                                    prev.draft_logits.unsqueeze(0))[0]
            assert torch.allclose(cur.features, feats[old[0]] * v)
            # correction source = the previous verify's taps at slot j-1 (index k + a in the next call's context)
            assert torch.equal(cur.corr_taps[valid[0]], vprev["taps"][corr[0][valid[0]]])
            assert torch.equal(cur.target_tokens[valid[0]], vprev["logits"].argmax(-1)[corr[0][valid[0]]])
            if temperature == 0:
                assert torch.equal(vprev["block"][1:], prev.draft_logits.argmax(-1))
            checked += int(valid[0].any())
    assert checked > 5


def test_training_forward_reproduces_the_served_draft(pair):
    """A recorded round, replayed through the training forward (clean taps of the final sequence as context),
    gives the logits the Scheduler's drafter produced at serving time: training sees what serving saw."""
    target, drafter = pair.load()
    rolls = rollout(target, drafter, prompts(), 24, max_batch=4, keep_debug=True)
    ex = Examples(rolls, compute_taps(target, [r.tokens for r in rolls], 8, torch.device("cpu"),
                                      store_dtype=torch.float32))
    use = ex.usable()
    assert use
    B = drafter.config.block_size
    picks = [list(range(len(ex.rolls[i].rounds))) for i in use]
    taps, block_ids, labels, anchors, bw, suffix = collate(ex, use, picks, B, "cpu", drafter.config.mask_token_id)
    with torch.no_grad():
        _, logits = bl.block_forward(drafter, taps, anchors, block_ids, suffix)
    n = 0
    for row, i in enumerate(use):
        for b, k in enumerate(picks[row]):
            rec = ex.rolls[i].rounds[k]
            assert int(block_ids[row, b, 0]) == rec.anchor
            assert max_diff(logits[row, b], rec.draft_logits) < 1e-3
            n += 1
    assert n > 5


def test_zero_init_starts_exactly_at_dflash(pair):
    target, drafter = pair.load()
    drafter.conditioner.reset("zero", seed=0)
    rolls = rollout(target, drafter, prompts(), 24, max_batch=6)
    ex = Examples(rolls, compute_taps(target, [r.tokens for r in rolls], 8, torch.device("cpu")))
    use = ex.usable()
    picks = [list(range(len(ex.rolls[i].rounds))) for i in use]
    w = bl.loss_weights(8, 3.0)
    with torch.no_grad():
        loss, st, base, _ = block_losses(drafter, ex, use, picks, 8, w, torch.device("cpu"), False, True)
    assert st["weight_sum"] > 0
    assert st["loss_sum"] == base["loss_sum"]  # identical, not just close: W_v = 0 makes the op the identity


def test_train_conditioner_end_to_end(pair, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt_ids": x}) + "\n" for x in prompts(40, seed=1)))
    out = tmp_path / "out"
    cfg = ConditionerConfig(phases=2, steps_per_phase=4, rollout_prompts=12, rollout_batch=12, max_new_tokens=20,
                            val_prompts=8, eval_prompts=4, eval_new_tokens=12, batch_size=4, blocks_per_seq=6,
                            warmup=1, reinit=True, device="cpu", threads=1, rollout_temperatures=(0.0, 1.0))
    m = train_conditioner(pair.target_dir, pair.drafter_dir, p, out, cfg, progress=False)
    assert m["phases"] == 2 and m["steps"] == 8
    assert 0.0 < m["mean_gate"] < 1.0
    h = m["history"][-1]
    assert h["rollout_rounds"] > 0 and h["val_runtime"]["tau_mean"] >= 1.0
    for f in ("config.json", "model.safetensors", "retrace_config.json", "retrace.safetensors"):
        assert (out / f).is_file()
    from retrace.models.conditioner import ReTraceConditioner

    cond = ReTraceConditioner.from_dir(out, 64)
    assert cond.value.weight.abs().sum() > 0  # trained away from the zero init


def test_make_backend_is_the_runtime_torch_backend(pair):
    """Rollouts run on the runtime's own torch backend with a device (no separate GPU backend; over a dense
    past, the numerics the zoo was trained with: runtime/torch_concat.py): the same rounds as a TorchBackend
    built directly, and the records are host tensors (training data)."""
    from retrace.runtime.torch_concat import ConcatTorchBackend
    from retrace.train.rollout import TorchBackend, make_backend, run_requests

    target, drafter = pair.load()
    ps = prompts(6)
    outs = []
    backends = (TorchBackend(target, drafter, 3, 64), make_backend(target, drafter, 3, 64, device="cpu"))
    assert [type(be) for be in backends] == [TorchBackend, ConcatTorchBackend]
    for be in backends:
        assert be.device == torch.device("cpu")
        rolls, sched = run_requests(be, ps, "retrace", 16, block_size=8, record=True)
        outs.append(([r.output_ids for r in rolls], [len(r.rounds) for r in rolls], sched.stats["retrace"].rounds))
        assert all(rec.memory.device.type == "cpu" for r in rolls for rec in r.rounds)
    assert outs[0] == outs[1]
