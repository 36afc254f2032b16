"""Config parsing: both RoPE forms give the same model; unsupported features are refused clearly."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import patch_json

from retrace.errors import CheckpointError, UnsupportedConfigError
from retrace.models.config import DrafterConfig, Qwen3Config, default_target_layer_ids
from retrace.models.drafter import DFlashDrafter
from retrace.models.target import Qwen3Target

THETA = 1_000_000.0  # Qwen3's; a silent fallback to 10000 must be caught


def test_rope_forms_target_identical(tiny_pair, tmp_path):
    pair = tiny_pair(rope_theta=THETA, rope_form="rope_parameters")
    new_form = pair.target_dir
    old_form = tmp_path / "old_form"
    shutil.copytree(new_form, old_form)
    cfg = patch_json(old_form / "config.json", drop=("rope_parameters",), rope_theta=THETA, rope_scaling=None)
    assert "rope_parameters" not in cfg
    assert Qwen3Config.from_dir(new_form).layers.rope_theta == THETA
    assert Qwen3Config.from_dir(old_form).layers.rope_theta == THETA

    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9).expand(2, 9) + 300  # large positions make theta matter
    outs = []
    for d in (new_form, old_form):
        m = Qwen3Target.from_pretrained(d, tap_layers=(1,))
        pk, pv = m.empty_past(2)
        with torch.no_grad():
            outs.append(m(ids, pos, pk, pv, torch.zeros(2, dtype=torch.long)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])

    # and transformers reads the old form the same way (it is what hub checkpoints carry)
    from helpers import load_hf_target

    hf = load_hf_target(old_form)
    with torch.no_grad():
        ref = hf(ids, position_ids=pos).logits
    assert (ref - outs[1][0]).abs().max().item() <= 1e-5


def test_rope_forms_drafter_identical(tiny_pair):
    a = tiny_pair(rope_theta=THETA, draft_rope_form="rope_theta")
    b = tiny_pair(rope_theta=THETA, draft_rope_form="rope_parameters", rope_form="rope_theta")
    for p in (a, b):
        assert DrafterConfig.from_dir(p.drafter_dir).layers.rope_theta == THETA
    ta, da = a.load()
    tb, db = b.load()
    g = torch.Generator().manual_seed(3)
    ctx = torch.randn(1, 6, da.config.num_taps * 64, generator=g)
    ctx_pos = torch.arange(6)[None] + 200
    block = torch.tensor([[5] + [127] * 7])
    bpos = torch.arange(8)[None] + 206
    pk, pv = da.empty_past(1)
    with torch.no_grad():
        ha, la, _, _ = da(ctx, ctx_pos, pk, pv, torch.zeros(1, dtype=torch.long), block, bpos)
        hb, lb, _, _ = db(ctx, ctx_pos, pk, pv, torch.zeros(1, dtype=torch.long), block, bpos)
    assert torch.equal(ha, hb) and torch.equal(la, lb)


def test_drafter_save_writes_zlab_rope_form(tiny_pair, tmp_path):
    pair = tiny_pair(rope_theta=THETA, draft_rope_form="rope_parameters")
    target, drafter = pair.load()
    drafter.save_pretrained(tmp_path / "saved")
    saved = DrafterConfig.from_dir(tmp_path / "saved")
    assert saved.layers.rope_theta == THETA
    assert saved.raw.get("rope_theta") == THETA  # z-lab / transformers 4.x readers only know this key


def test_missing_rope_theta_is_an_error(tiny_pair):
    pair = tiny_pair()
    patch_json(pair.target_dir / "config.json", drop=("rope_parameters", "rope_theta"))
    with pytest.raises(CheckpointError, match="rope_theta"):
        Qwen3Config.from_dir(pair.target_dir)


UNSUPPORTED = {
    "rope_parameters-yarn": (
        dict(rope_parameters={"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0,
                              "original_max_position_embeddings": 128}),
        "rope_type='yarn'",
    ),
    "rope_scaling-linear": (
        dict(rope_theta=THETA, rope_scaling={"type": "linear", "factor": 2.0}),
        "rope_scaling type 'linear'",
    ),
    "use_sliding_window": (dict(use_sliding_window=True, sliding_window=64, max_window_layers=0), "use_sliding_window"),
    "layer_types-sliding": (
        dict(layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"],
             sliding_window=64),
        "sliding_attention",
    ),
    "attention_bias": (dict(attention_bias=True), "attention_bias"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_target_config(tiny_pair, case):
    pair = tiny_pair()
    updates, needle = UNSUPPORTED[case]
    drop = ("rope_parameters",) if "rope_scaling" in updates else ()
    patch_json(pair.target_dir / "config.json", drop=drop, **updates)
    with pytest.raises(UnsupportedConfigError) as e:
        Qwen3Target.from_pretrained(pair.target_dir)
    msg = str(e.value)
    assert str(pair.target_dir / "config.json") in msg and needle in msg, msg
    assert "not supported" in msg


@pytest.mark.parametrize("case", ["rope_parameters-yarn", "layer_types-sliding", "attention_bias"])
def test_unsupported_drafter_config(tiny_pair, case):
    updates, needle = UNSUPPORTED[case]
    if case == "layer_types-sliding":
        updates = dict(layer_types=["sliding_attention"], sliding_window=64)
    pair = tiny_pair(draft_overrides=updates)
    target = Qwen3Target.from_pretrained(pair.target_dir)
    with pytest.raises(UnsupportedConfigError) as e:
        DFlashDrafter.from_pretrained(pair.drafter_dir, target)
    msg = str(e.value)
    assert str(pair.drafter_dir / "config.json") in msg and needle in msg, msg


def test_default_rope_type_and_full_attention_accepted(tiny_pair):
    pair = tiny_pair()
    patch_json(pair.target_dir / "config.json", use_sliding_window=False, sliding_window=4096,
               layer_types=["full_attention"] * 4, rope_scaling=None, attention_bias=False)
    assert Qwen3Target.from_pretrained(pair.target_dir).config.layers.rope_theta == 10000.0


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(7, 1) == [3]
    assert default_target_layer_ids(28, 5) == [1, 7, 13, 19, 25]


def test_default_target_layer_ids_from_config(tiny_pair):
    pair = tiny_pair()
    raw = {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": THETA, "vocab_size": 128,
        "num_target_layers": 36, "block_size": 16, "dflash_config": {"mask_token_id": 127},
        "architectures": ["DFlashDraftModel"],
    }
    from pathlib import Path

    assert DrafterConfig.from_dict(raw, Path("x")).target_layer_ids == (1, 9, 17, 25, 33)
    raw["num_hidden_layers"] = 1
    assert DrafterConfig.from_dict(raw, Path("x")).target_layer_ids == (18,)
    # the tiny pair's drafter has no target_layer_ids: 1 drafter layer on a 4-layer target -> [2]
    assert DrafterConfig.from_dir(pair.drafter_dir).target_layer_ids == (2,)


@torch.no_grad()
def _our_greedy(target: Qwen3Target, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards of our target (no cache): what the runtime's verify must match."""
    ids = list(prompt)
    for _ in range(n):
        x = torch.tensor([ids])
        pk, pv = target.empty_past(1)
        logits = target(x, torch.arange(len(ids))[None], pk, pv, torch.zeros(1, dtype=torch.long))[0]
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_tied_config_with_its_own_lm_head_decodes_like_transformers(tiny_pair):
    """`tie_word_embeddings: true` but the file carries an lm_head.weight that differs from the embedding:
    transformers keeps that lm_head (untied); so do we, token for token."""
    from helpers import load_hf_target
    from runtime_fixtures import hf_greedy
    from safetensors.torch import load_file

    pair = tiny_pair(layers=2)
    d = pair.target_dir
    w = load_file(str(d / "model.safetensors"))
    assert not torch.equal(w["lm_head.weight"], w["model.embed_tokens.weight"])
    patch_json(d / "config.json", tie_word_embeddings=True)
    ours, hf = Qwen3Target.from_pretrained(d), load_hf_target(d)
    assert torch.equal(ours.lm_head.weight, w["lm_head.weight"]) and torch.equal(hf.lm_head.weight, w["lm_head.weight"])
    for prompt in ([5, 9, 17, 3], [100, 2, 2, 40, 7, 61]):
        assert _our_greedy(ours, prompt, 12) == hf_greedy(hf, prompt, 12)


def test_tied_config_with_an_equal_lm_head_stays_tied(tiny_pair):
    from safetensors.torch import load_file, save_file

    pair = tiny_pair(layers=2)
    d = pair.target_dir
    w = load_file(str(d / "model.safetensors"))
    w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    patch_json(d / "config.json", tie_word_embeddings=True)
    t = Qwen3Target.from_pretrained(d)
    assert t.config.tie_word_embeddings and t.lm_head.weight.data_ptr() == t.model.embed_tokens.weight.data_ptr()


def test_linear_rope_scaling_beside_rope_parameters_is_refused(tiny_pair):
    """transformers merges a legacy `rope_scaling` into `rope_parameters` and applies it; we do not implement
    scaled RoPE, so the checkpoint is refused naming the key instead of decoding differently."""
    pair = tiny_pair(layers=2)
    cfg = patch_json(pair.target_dir / "config.json", rope_scaling={"type": "linear", "factor": 2.0})
    assert cfg["rope_parameters"]["rope_type"] == "default"
    with pytest.raises(UnsupportedConfigError, match="rope_scaling type 'linear' is not supported"):
        Qwen3Target.from_pretrained(pair.target_dir)


@pytest.mark.parametrize("updates,needle", [
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -1}),
     "rope_parameters.rope_theta=-1 must be a positive"),
    (dict(rope_parameters=None, rope_theta=-1), "rope_theta=-1 must be a positive"),
    (dict(rope_parameters=None, rope_theta="1e6"), "rope_theta='1e6' must be a positive"),
    (dict(hidden_size="64"), "hidden_size='64' must be a positive integer"),
    (dict(num_hidden_layers=2.7), "num_hidden_layers=2.7 must be a positive integer"),
    (dict(num_attention_heads=True), "num_attention_heads=True must be a positive integer"),
    (dict(intermediate_size=-96), "intermediate_size=-96 must be a positive integer"),
    (dict(rms_norm_eps=0), "rms_norm_eps=0 must be a positive number"),
], ids=["theta-neg", "theta-neg-legacy", "theta-str", "hidden-str", "layers-float", "heads-bool", "inter-neg", "eps-0"])
def test_malformed_sizes_are_refused_naming_the_key(tiny_pair, updates, needle):
    pair = tiny_pair(layers=2)
    patch_json(pair.target_dir / "config.json", **updates)
    with pytest.raises(CheckpointError) as e:
        Qwen3Config.from_dir(pair.target_dir)
    assert needle in str(e.value) and str(pair.target_dir / "config.json") in str(e.value), str(e.value)
