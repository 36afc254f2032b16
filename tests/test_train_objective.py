"""The drafter's training objectives (retrace.train.objectives): slot weights on hand-computed blocks, the loss
they give through blocks.block_loss, finite gradients, a default that is today's loss bit for bit, and the
setting's record (absent from a default run's config, so its checkpoints and digests stay as they were)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import write_target

from retrace.errors import RetraceError
from retrace.train import blocks as bl
from retrace.train import objectives as ob
from retrace.train.config import ConditionerConfig, DFlashConfig
from retrace.train.dflash import train_dflash

pytestmark = pytest.mark.usefixtures("one_thread")

P = [0.5, 0.25, 0.8]  # the drafter's probability of each slot's label, one block of three slots


def _logp(ps):
    return torch.tensor(ps).log().view(1, 1, -1)


def test_weights_on_a_hand_computed_block():
    decay = torch.tensor([1.0, 0.5, 0.25])
    present = torch.ones(1, 1, 3)
    lp = _logp(P)
    assert ob.slot_weights("decay", decay, present).flatten().tolist() == [1.0, 0.5, 0.25]
    # slot k weighs the probability that slots 1..k-1 were all accepted
    assert ob.slot_weights("accept", decay, present, lp).flatten().tolist() == pytest.approx([1.0, 0.5, 0.125])
    assert ob.slot_weights("accept-decay", decay, present, lp).flatten().tolist() == pytest.approx(
        [1.0, 0.25, 0.03125])
    assert ob.slot_weights("first-error", decay, present, lp).flatten().tolist() == pytest.approx(
        [0.25, 0.5 * 0.75**2, 0.125 * 0.2**2])
    # expected accepted slots: 0.5 + 0.5*0.25 + 0.5*0.25*0.8
    assert ob.expected_accepted(lp, present).item() == pytest.approx(0.725)
    # a missing label (past the sequence) weighs nothing and is not counted as accepted
    cut = torch.tensor([[[1.0, 1.0, 0.0]]])
    assert ob.slot_weights("accept", decay, cut, lp).flatten().tolist() == pytest.approx([1.0, 0.5, 0.0])
    assert ob.expected_accepted(lp, cut).item() == pytest.approx(0.625)


def test_unknown_objective_and_missing_probabilities_are_named():
    w, present = torch.ones(3), torch.ones(1, 1, 3)
    with pytest.raises(ValueError, match="unknown drafter objective 'tau'"):
        ob.slot_weights("tau", w, present, _logp(P))
    with pytest.raises(ValueError, match="'accept' needs the labels' log-probabilities"):
        ob.slot_weights("accept", w, present)


def _case(seed=3):
    g = torch.Generator().manual_seed(seed)
    N, nb, K, V = 2, 3, 5, 11
    logits = torch.randn(N, nb, K, V, generator=g)
    labels = torch.randint(0, V, (N, nb, K), generator=g)
    labels[0, 1, 3:] = bl.IGNORE
    bw = torch.ones(N, nb)
    bw[1, 2] = 0  # a padding block
    return logits, labels, bw, bl.loss_weights(K + 1, 2.0)


@pytest.mark.parametrize("objective", ["accept", "accept-decay", "first-error"])
def test_block_loss_is_the_objective_weighted_mean(objective):
    logits, labels, bw, decay = _case()
    loss, st = bl.block_loss(logits, labels, decay, bw, objective=objective)
    num = den = 0.0
    for n in range(logits.shape[0]):
        for b in range(logits.shape[1]):
            reach = 1.0
            for k in range(logits.shape[2]):
                if labels[n, b, k] == bl.IGNORE or bw[n, b] == 0:
                    break
                logp = torch.log_softmax(logits[n, b, k], -1)[labels[n, b, k]].item()
                p = math.exp(logp)
                w = {"accept": reach, "accept-decay": reach * decay[k].item(),
                     "first-error": reach * (1 - p) ** 2}[objective]
                num += w * -logp
                den += w
                reach *= p
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    assert st["weight_sum"] == pytest.approx(den, rel=1e-5)


@pytest.mark.parametrize("objective", list(ob.OBJECTIVES))
@pytest.mark.parametrize("soft", [False, True])
def test_gradients_are_finite_and_flow_through_the_label_slots_only(objective, soft):
    logits, labels, bw, decay = _case()
    logits = (logits * 8).requires_grad_()  # confident: label probabilities near 0 and 1
    target = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9)) if soft else None
    loss, _ = bl.block_loss(logits, labels, decay, bw, target, objective)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert logits.grad[1, 2].abs().sum() == 0  # the padding block
    assert logits.grad[0, 1, 3:].abs().sum() == 0  # slots without a label


def test_accept_overlap_weighs_slots_by_their_t1_acceptance():
    # the overlap sum_x min(p, q): the chance that a draft sampled from q survives T=1 verification against p
    q, p = torch.tensor([0.8, 0.1, 0.1]).log(), torch.tensor([0.5, 0.5, 0.0]).log()
    assert ob.overlap_logp(q, p).exp().item() == pytest.approx(0.6)
    logits, labels, bw, decay = _case()
    # hard labels: the overlap of a one-hot label and q is q(label), so the objective is `accept`
    assert torch.equal(bl.block_loss(logits, labels, decay, bw, objective="accept-overlap")[0],
                       bl.block_loss(logits, labels, decay, bw, objective="accept")[0])
    # soft labels: slot k weighs prod_{j<k} overlap_j, the loss stays the KL to the target
    target = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9))
    loss, st = bl.block_loss(logits, labels, decay, bw, target, "accept-overlap")
    q, p = logits.softmax(-1), target.softmax(-1)
    ov = torch.minimum(p, q).sum(-1)
    kl = (p * (p.log() - q.log())).sum(-1)
    present = (labels != bl.IGNORE).float() * bw.unsqueeze(-1)
    reach = torch.cumprod(torch.cat([torch.ones_like(ov[..., :1]), (ov * present)[..., :-1]], -1), -1) * present
    assert st["weight_sum"] == pytest.approx(reach.sum().item(), rel=1e-5)
    assert loss.item() == pytest.approx(((kl * reach).sum() / reach.sum()).item(), rel=1e-5)
    assert loss.item() != pytest.approx(bl.block_loss(logits, labels, decay, bw, target, "accept")[0].item())


def test_the_default_objective_is_todays_loss_bit_for_bit():
    logits, labels, bw, decay = _case()
    present = (labels != bl.IGNORE).float() * bw.unsqueeze(-1)
    per_slot = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).clamp_min(0),
                                                 reduction="none").view_as(labels)
    w = decay.view(1, 1, -1) * present  # the expression block_loss used before objectives existed
    old = (per_slot * w).sum() / w.sum().clamp_min(1e-8)
    assert torch.equal(bl.block_loss(logits, labels, decay, bw)[0], old)
    assert torch.equal(bl.block_loss(logits, labels, decay, bw, objective="decay")[0], old)


def test_a_default_run_records_no_objective_and_another_is_recorded():
    for config in (DFlashConfig, ConditionerConfig):
        assert "objective" not in config().to_dict()
        assert config(objective="accept").to_dict()["objective"] == "accept"


def test_training_with_the_accept_objective_records_it_and_resumes_only_with_it(tmp_path):
    target = write_target(tmp_path / "target", vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, intermediate=48)
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(24):
            f.write(json.dumps({"prompt_ids": [3 + (i * 7 + j) % 58 for j in range(6)]}) + "\n")
    base = dict(block_size=6, num_layers=1, mask_token_id=63, steps=6, batch_size=4, blocks_per_seq=4, val_prompts=6,
                max_new_tokens=12, gen_batch=24, eval_every=3, save_every=0, eval_tau_prompts=0, warmup=2, lr=3e-3,
                device="cpu", threads=1)
    out, data = tmp_path / "d", tmp_path / "p.jsonl"
    train_dflash(target, out, data, DFlashConfig(**base, objective="accept", stop_after=3), progress=False)
    state = json.loads((out / "train_state" / "state.json").read_text())
    assert state["info"]["config"]["objective"] == "accept"
    with pytest.raises(RetraceError, match="settings"):  # another objective is another run
        train_dflash(target, out, data, DFlashConfig(**base), resume=True, progress=False)
    m = train_dflash(target, out, data, DFlashConfig(**base, objective="accept"), resume=True, progress=False)
    assert m["steps"] == 6 and m["objective"] == "accept" and m["config"]["objective"] == "accept"
    assert m["history"][-1]["val_loss"] < m["history"][0]["val_loss"]


LEGACY_RECIPE_SHA256 = "ec3e4b39c7b736dab4929dde45f02018ea38bef5bb6250f34062b6003f2fad1d"  # the zoo shipped before


def test_zoo_recipes_change_only_the_trainers_settings_and_the_shipped_one_is_the_presets():
    from retrace.engines.bundle import manifest_digest
    from retrace.errors import RetraceError as Err
    from retrace.train import zoo, zoo_release

    assert zoo.preset("small") is zoo.PRESETS["small"]  # the shipped zoo's key and release record
    assert zoo.PRESETS["small"] == zoo.preset("small", zoo.SHIPPED_AS["small"])  # built by a named recipe
    # `--recipe legacy` is exactly the recipe of the zoo shipped before (its release record's digest)
    assert manifest_digest(zoo_release.recipe("small", 0, "legacy")) == LEGACY_RECIPE_SHA256
    base = zoo.preset("small", "legacy")
    others = [n for n in zoo.RECIPES if n != zoo.DEFAULT_RECIPE]
    for name in others:
        change, got = zoo.RECIPES[name], zoo.preset("small", name)
        assert set(change) <= {"dflash", "conditioner"} and got["eval"] == base["eval"]
        for stage in ("dflash", "conditioner"):
            assert got[stage] == dict(base[stage], **change.get(stage, {}))
        DFlashConfig(**got["dflash"])  # every recipe is valid trainer configs
        ConditionerConfig(**got["conditioner"])
    keys = [zoo.zoo_key("small", 0, zoo.preset("small", n), "portable") for n in others]
    assert all(keys.count(k) == 1 for k in keys)  # each recipe's zoo is its own cache entry
    with pytest.raises(Err, match="unknown zoo recipe 'best'"):
        zoo.preset("small", "best")


def test_zoo_tiny_installs_only_the_shipped_recipe(tmp_path):
    from click.testing import CliRunner

    from retrace.cli import main
    from retrace.train import zoo

    other = next(n for n in zoo.RECIPES if n != zoo.DEFAULT_RECIPE)
    res = CliRunner().invoke(main, ["zoo", "tiny", "--out", str(tmp_path / "z"), "--recipe", other])
    assert res.exit_code == 2 and f"--recipe {other}: only the shipped recipe's zoo is installed; add --train" in (
        res.output)
    assert not (tmp_path / "z").exists()
