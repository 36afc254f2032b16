"""ReTrace conditioner: zero init is exactly DFlash, the fusion op leaves invalid slots alone, I/O, CLI."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import max_diff, write_conditioner
from safetensors.torch import load_file

from retrace.cli import main as cli
from retrace.models.conditioner import CONFIG_NAME, FEATURES, WEIGHTS_NAME, ReTraceConditioner
from retrace.models.drafter import DFlashDrafter, SuffixInputs
from retrace.plugins.gated_suffix_fusion import gated_suffix_fusion, gated_suffix_fusion_reference

D, B, C = 64, 8, 10


def suffix_inputs(n=2, valid_slots=(1, 2, 5), seed=0) -> SuffixInputs:
    g = torch.Generator().manual_seed(seed)
    valid = torch.zeros(n, B)
    valid[:, list(valid_slots)] = 1.0
    return SuffixInputs(
        memory=torch.randn(n, B, D, generator=g) * 3,
        features=torch.rand(n, B, len(FEATURES), generator=g),
        valid=valid,
        corr_index=torch.randint(0, C, (n, B), generator=g),
    )


def run(drafter, suffix=None, n=2):
    target = drafter.target
    ids = torch.randint(0, 128, (n, C), generator=torch.Generator().manual_seed(1))
    pk, pv = target.empty_past(n)
    with torch.no_grad():
        _, taps, _, _ = target(ids, torch.arange(C).expand(n, C), pk, pv, torch.zeros(n, dtype=torch.long))
        block = torch.full((n, B), drafter.config.mask_token_id)
        block[:, 0] = ids[:, -1]
        dk, dv = drafter.empty_past(n)
        h, logits, _, _ = drafter(taps, torch.arange(C).expand(n, C), dk, dv, torch.zeros(n, dtype=torch.long),
                                  block, torch.arange(C, C + B).expand(n, B), suffix)
    return h, logits


def test_zero_init_is_exactly_dflash(tiny_pair):
    pair = tiny_pair(block_size=B, conditioner="zero")
    target, with_cond = pair.load()
    assert with_cond.conditioner is not None
    assert torch.count_nonzero(with_cond.conditioner.value.weight) == 0
    _, plain = pair.load(load_conditioner=False)
    assert plain.conditioner is None
    h0, l0 = run(plain)
    for s in (None, suffix_inputs(), suffix_inputs(valid_slots=range(1, B), seed=3)):
        h, lg = run(with_cond, s)
        assert torch.equal(h, h0) and torch.equal(lg, l0)
    # a drafter without a conditioner ignores suffix inputs
    h, lg = run(plain, suffix_inputs())
    assert torch.equal(h, h0) and torch.equal(lg, l0)


def test_random_init_changes_outputs_only_with_valid_slots(tiny_pair):
    pair = tiny_pair(block_size=B, conditioner="random")
    _, drafter = pair.load()
    assert torch.count_nonzero(drafter.conditioner.value.weight) > 0
    h0, l0 = run(drafter, None)
    h, lg = run(drafter, suffix_inputs(valid_slots=()))
    assert torch.equal(h, h0) and torch.equal(lg, l0)
    h, lg = run(drafter, suffix_inputs(valid_slots=(2,)))
    assert max_diff(h, h0) > 1e-3 and max_diff(lg, l0) > 1e-3


def _op_args(seed=0, n=2, F=3):
    g = torch.Generator().manual_seed(seed)
    x, m, c = (torch.randn(n, B, D, generator=g) for _ in range(3))
    f = torch.rand(n, B, F, generator=g)
    w = (torch.randn(D, 2 * D, generator=g) * 0.1, torch.randn(D, 2 * D + F, generator=g) * 0.1,
         torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g), torch.randn(D, D, generator=g) * 0.5)
    return x, m, c, f, w


def test_fusion_op_leaves_slot0_and_invalid_slots_exactly():
    x, m, c, f, w = _op_args()
    valid = torch.zeros(2, B)
    valid[0, [1, 4]] = 1
    valid[1, [2, 3, 7]] = 1
    out = gated_suffix_fusion(x, m, c, f, valid, *w)
    keep = valid == 0
    assert keep[:, 0].all()
    assert torch.equal(out[keep], x[keep])
    assert (out[~keep] - x[~keep]).abs().amax(-1).min() > 1e-3
    # reference formula, written out independently
    r = m + torch.cat([m, c], -1) @ w[0].T
    gate = torch.sigmoid(torch.cat([x, r, f], -1) @ w[1].T + w[2])
    rn = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-6) * w[3]
    ref = x + valid[..., None] * gate * (rn @ w[4].T)
    assert max_diff(out, ref) <= 1e-5
    # with W_v == 0 the op is the identity even on valid slots
    out0 = gated_suffix_fusion_reference(x, m, c, f, torch.ones(2, B), *w[:4], torch.zeros(D, D))
    assert torch.equal(out0, x)


def test_conditioner_save_load_round_trip(tmp_path):
    cond = ReTraceConditioner(D, rms_norm_eps=1e-5)
    cond.reset(init="random", seed=4)
    cond.save(tmp_path)
    cfg = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert cfg["hidden_size"] == D and cfg["features"] == list(FEATURES) and cfg["rms_norm_eps"] == 1e-5
    again = ReTraceConditioner.from_dir(tmp_path, D)
    a, b = cond.state_dict(), again.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert again.eps == cond.eps and again.num_features == cond.num_features
    x, m, c, f, _ = _op_args()
    valid = torch.ones(2, B)
    with torch.no_grad():
        assert torch.equal(cond(x, m, c, f, valid), again(x, m, c, f, valid))


def test_drafter_with_conditioner_round_trip(tiny_pair, tmp_path):
    pair = tiny_pair(block_size=B, conditioner="random")
    target, drafter = pair.load()
    drafter.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / WEIGHTS_NAME).is_file() and (tmp_path / "saved" / CONFIG_NAME).is_file()
    # the drafter file holds no conditioner tensors (DFlash-only tools still load it)
    assert not any(k.startswith("conditioner") for k in load_file(str(tmp_path / "saved" / "model.safetensors")))
    again = DFlashDrafter.from_pretrained(tmp_path / "saved", target)
    a, b = drafter.state_dict(), again.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    s = suffix_inputs()
    h1, l1 = run(drafter, s)
    h2, l2 = run(again, s)
    assert torch.equal(h1, h2) and torch.equal(l1, l2)


def test_cli_init_conditioner(tiny_pair):
    pair = tiny_pair()
    d = str(pair.drafter_dir)
    runner = CliRunner()
    res = runner.invoke(cli, ["init-conditioner", "--drafter", d, "--init", "random", "--seed", "1"])
    assert res.exit_code == 0, res.output
    assert (pair.drafter_dir / CONFIG_NAME).is_file() and (pair.drafter_dir / WEIGHTS_NAME).is_file()
    first = load_file(str(pair.drafter_dir / WEIGHTS_NAME))
    assert torch.count_nonzero(first["value.weight"]) > 0
    # loads with the drafter
    _, drafter = pair.load()
    assert drafter.conditioner is not None and drafter.conditioner.hidden_size == 64

    res = runner.invoke(cli, ["init-conditioner", "--drafter", d, "--init", "zero"])
    assert res.exit_code != 0
    assert "already has a conditioner" in res.output and "--force" in res.output
    assert torch.equal(load_file(str(pair.drafter_dir / WEIGHTS_NAME))["value.weight"], first["value.weight"])

    res = runner.invoke(cli, ["init-conditioner", "--drafter", d, "--init", "zero", "--force"])
    assert res.exit_code == 0, res.output
    assert torch.count_nonzero(load_file(str(pair.drafter_dir / WEIGHTS_NAME))["value.weight"]) == 0

    # same seed, same weights
    res = runner.invoke(cli, ["init-conditioner", "--drafter", d, "--init", "random", "--seed", "1", "--force"])
    assert res.exit_code == 0
    again = load_file(str(pair.drafter_dir / WEIGHTS_NAME))
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_cli_init_conditioner_bad_drafter(tmp_path):
    res = CliRunner().invoke(cli, ["init-conditioner", "--drafter", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "drafter directory not found" in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("init", ["zero", "random"])
def test_write_conditioner_helper_inits(tmp_path, init):
    write_conditioner(tmp_path, D, init=init)
    cond = ReTraceConditioner.from_dir(tmp_path, D)
    assert (torch.count_nonzero(cond.value.weight) == 0) == (init == "zero")
