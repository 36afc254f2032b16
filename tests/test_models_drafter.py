"""DFlashDrafter: z-lab checkpoint I/O, parity with transformers' own DFlash assistant, block semantics."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TinyPair, load_hf_target, max_diff, write_drafter, write_target
from safetensors.torch import load_file

from retrace.models.config import DrafterConfig
from retrace.models.convert import hf_assistant_to_zlab, zlab_to_hf_assistant
from retrace.models.drafter import DFlashDrafter

TOL = 1e-5

# (drafter layers, target_layer_ids or None for z-lab's default, target kwargs)
DRAFTERS = {
    "1layer-default-taps": dict(draft_layers=1, target_layer_ids=None),
    "2layers-taps-incl-last-hd32": dict(draft_layers=2, target_layer_ids=[1, 3], head_dim=32, kv_heads=1),
}


def zero_past(drafter, n):
    pk, pv = drafter.empty_past(n)
    return pk, pv, torch.zeros(n, dtype=torch.long)


def context_taps(target, n, C, seed=0):
    """Real target taps for a random prompt (what the runtime feeds the drafter)."""
    ids = torch.randint(0, target.config.vocab_size, (n, C), generator=torch.Generator().manual_seed(seed))
    pk, pv = target.empty_past(n)
    with torch.no_grad():
        _, taps, _, _ = target(ids, torch.arange(C).expand(n, C), pk, pv, torch.zeros(n, dtype=torch.long))
    return taps


def block(drafter, anchors):
    B, mask = drafter.config.block_size, drafter.config.mask_token_id
    ids = torch.full((len(anchors), B), mask, dtype=torch.long)
    ids[:, 0] = torch.tensor(anchors)
    return ids


def draft(drafter, ctx, ctx_pos, ids, bpos, past=None, suffix=None):
    pk, pv, pl = past if past is not None else zero_past(drafter, ids.shape[0])
    with torch.no_grad():
        return drafter(ctx, ctx_pos, pk, pv, pl, ids, bpos, suffix)


def load_hf_assistant(directory):
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, info = AutoModel.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager",
                                            output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


# -- loading and saving --------------------------------------------------------------------------------


def test_loads_zlab_directory(tiny_pair):
    pair = tiny_pair(draft_layers=2, target_layer_ids=[1, 3], block_size=16, mask_token_id=100)
    raw = json.loads((pair.drafter_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and "dflash_config" in raw and "rope_theta" in raw
    target, drafter = pair.load()
    c = drafter.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.num_target_layers) == (16, 100, (1, 3), 4)
    assert c.layers.num_hidden_layers == 2 and c.hidden_size == 64
    assert target.tap_layers == (1, 3)  # load_pair gives the target the drafter's taps
    file = load_file(str(pair.drafter_dir / "model.safetensors"))
    sd = drafter.drafter_state_dict()
    assert sorted(sd) == sorted(file)
    assert all(torch.equal(sd[k], file[k]) for k in file)
    # the drafter shares the target's embedding and LM head and saves neither
    assert not any("embed" in k or "lm_head" in k for k in sd)
    assert drafter.target is target


def test_save_load_round_trip_bitwise(tiny_pair, tmp_path):
    pair = tiny_pair(draft_layers=2, target_layer_ids=[0, 2])
    target, drafter = pair.load()
    drafter.save_pretrained(tmp_path / "saved")
    again = DFlashDrafter.from_pretrained(tmp_path / "saved", target)
    assert again.config == drafter.config
    a, b = drafter.drafter_state_dict(), again.drafter_state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    orig = load_file(str(pair.drafter_dir / "model.safetensors"))
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert sorted(orig) == sorted(saved) and all(torch.equal(orig[k], saved[k]) for k in orig)
    ctx = context_taps(target, 1, 6)
    ids = block(drafter, [3])
    bpos = torch.arange(6, 14)[None]
    h1, l1, k1, _ = draft(drafter, ctx, torch.arange(6)[None], ids, bpos)
    h2, l2, k2, _ = draft(again, ctx, torch.arange(6)[None], ids, bpos)
    assert torch.equal(h1, h2) and torch.equal(l1, l2) and all(torch.equal(x, y) for x, y in zip(k1, k2, strict=True))


# -- parity with transformers' DFlash assistant -------------------------------------------------------


@pytest.fixture(scope="module", params=list(DRAFTERS), ids=list(DRAFTERS))
def with_hf(request, tmp_path_factory):
    """(pair, target, drafter, HF assistant, its dir), shared by this module's tests (read-only)."""
    kw = dict(DRAFTERS[request.param])
    root = tmp_path_factory.mktemp("with_hf")
    draft_kw = dict(layers=kw.pop("draft_layers"), target_layer_ids=kw.pop("target_layer_ids"))
    target_dir = write_target(root / "target", **kw)
    pair = TinyPair(target_dir, write_drafter(root / "drafter", target_dir, **draft_kw))
    target, drafter = pair.load()
    hf_dir = zlab_to_hf_assistant(pair.drafter_dir, pair.target_dir, root / "hf_assistant")
    return pair, target, drafter, load_hf_assistant(hf_dir), hf_dir


def test_logits_match_transformers_assistant(with_hf):
    pair, target, drafter, hf, _ = with_hf
    N, C, B = 2, 11, drafter.config.block_size
    ctx = context_taps(target, N, C)
    ids = block(drafter, [5, 77])
    hidden, logits, new_k, _ = draft(drafter, ctx, torch.arange(C).expand(N, C), ids,
                                     torch.arange(C, C + B).expand(N, B))
    assert hidden.shape == (N, B, 64) and logits.shape == (N, B - 1, 128)
    assert len(new_k) == drafter.config.layers.num_hidden_layers and new_k[0].shape[2] == C
    with torch.no_grad():
        ref_h = hf(noise_embeds=target.embed(ids), context_hidden_states=ctx,
                   position_ids=torch.arange(C + B)[None]).last_hidden_state
        ref_logits = target.lm_head(ref_h[:, 1:])
    dh, dl = max_diff(hidden, ref_h), max_diff(logits, ref_logits)
    print("drafter parity vs transformers assistant: hidden", dh, "logits", dl)
    assert dh <= TOL and dl <= TOL, (dh, dl)


def test_context_in_two_calls_equals_one_call(with_hf):
    """Past context K/V from a first call (its new_k/new_v) + the rest of the context == all context at once.
    Also batched with per-row past_len (row 1's past has stale entries beyond its length)."""
    _, target, drafter, _, _ = with_hf
    C, C1, B = 12, 7, drafter.config.block_size
    ctx = context_taps(target, 1, C, seed=4)
    ids = block(drafter, [9])
    bpos = torch.arange(C, C + B)[None]
    h_all, l_all, k_all, v_all = draft(drafter, ctx, torch.arange(C)[None], ids, bpos)
    _, _, k1, v1 = draft(drafter, ctx[:, :C1], torch.arange(C1)[None], ids, torch.arange(C1, C1 + B)[None])
    h2, l2, k2, v2 = draft(drafter, ctx[:, C1:], torch.arange(C1, C)[None], ids, bpos,
                           past=(k1, v1, torch.tensor([C1])))
    dh, dl = max_diff(h2, h_all), max_diff(l2, l_all)
    dk = max(max_diff(torch.cat([a, b], 2), c) for a, b, c in zip(k1, k2, k_all, strict=True))
    print("drafter two-call vs one-call: hidden", dh, "logits", dl, "ctx K", dk)
    assert dh <= TOL and dl <= TOL and dk <= TOL

    # batch: row 0 = the split above; row 1 has only 4 valid past entries + garbage, context 4..C-1
    g = torch.Generator().manual_seed(5)
    pk = [torch.cat([a, torch.randn(a.shape, generator=g) * 5]) for a in k1]
    pv = [torch.cat([a, torch.randn(a.shape, generator=g) * 5]) for a in v1]
    for layer in range(len(pk)):
        pk[layer][1, :, :4] = k_all[layer][0, :, :4]
        pv[layer][1, :, :4] = v_all[layer][0, :, :4]
    # row 0 feeds context C1..C-1 padded with zeros, row 1 feeds context 4..C-1
    n_new = C - 4
    ctx_rows = torch.zeros(2, n_new, ctx.shape[-1])
    ctx_rows[0, : C - C1] = ctx[0, C1:]
    ctx_rows[1] = ctx[0, 4:]
    pos_rows = torch.stack([torch.arange(C1, C1 + n_new), torch.arange(4, C)])
    # row 0's extra columns sit at positions >= its anchor, so they are masked out
    hb, lb, _, _ = draft(drafter, ctx_rows, pos_rows, block(drafter, [9, 9]), bpos.expand(2, B),
                         past=(pk, pv, torch.tensor([C1, 4])))
    db = max(max_diff(hb[0], h_all[0]), max_diff(hb[1], h_all[0]), max_diff(lb[1], l_all[0]))
    print("drafter ragged batch vs one-call:", db)
    assert db <= TOL


def test_hf_assistant_round_trip(with_hf, tmp_path):
    pair, target, drafter, _, hf_dir = with_hf
    hf_cfg = json.loads((hf_dir / "config.json").read_text())
    assert hf_cfg["model_type"] == "muse_glimmer_assistant"
    assert hf_cfg["layer_types"] == ["full_attention"] * drafter.config.layers.num_hidden_layers
    assert hf_cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": drafter.config.layers.rope_theta}
    assert hf_cfg["rms_norm_eps"] == drafter.config.layers.rms_norm_eps
    hf_w = load_file(str(hf_dir / "model.safetensors"))
    assert "encoder.fc.weight" in hf_w and "encoder.output_norm_enc.weight" in hf_w and "fc.weight" not in hf_w

    back = hf_assistant_to_zlab(hf_dir, tmp_path / "back", num_target_layers=target.config.num_hidden_layers)
    assert DrafterConfig.from_dir(back) == drafter.config
    orig = load_file(str(pair.drafter_dir / "model.safetensors"))
    again = load_file(str(back / "model.safetensors"))
    assert sorted(orig) == sorted(again) and all(torch.equal(orig[k], again[k]) for k in orig)
    reloaded = DFlashDrafter.from_pretrained(back, target)
    a, b = drafter.drafter_state_dict(), reloaded.drafter_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_transformers_dflash_generate_equals_greedy(tiny_pair, tmp_path):
    """The converted assistant runs in transformers' own DFlash loop (which is lossless: equals greedy)."""
    pair = tiny_pair(draft_layers=2, target_layer_ids=[1, 3], block_size=8)
    hf_dir = zlab_to_hf_assistant(pair.drafter_dir, pair.target_dir, tmp_path / "hf_assistant")
    assistant = load_hf_assistant(hf_dir)
    target_hf = load_hf_target(pair.target_dir)
    ids = torch.randint(0, 120, (1, 10), generator=torch.Generator().manual_seed(7))
    kw = dict(do_sample=False, max_new_tokens=32, pad_token_id=0)
    calls = []
    assistant.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        greedy = target_hf.generate(ids, **kw)
        spec = target_hf.generate(ids, assistant_model=assistant, speculation_type="dflash", **kw)
    assert greedy.shape[1] == 10 + 32
    assert torch.equal(spec, greedy)
    assert 1 <= len(calls) <= 32  # the assistant drafted (one call per round)


# -- block semantics ------------------------------------------------------------------------------------


def test_block_attention_is_bidirectional(tiny_pair):
    target, drafter = tiny_pair(block_size=8).load()
    C = 5
    ctx = context_taps(target, 1, C)
    ids = block(drafter, [4])
    bpos = torch.arange(C, C + 8)[None]
    h, logits, _, _ = draft(drafter, ctx, torch.arange(C)[None], ids, bpos)
    ids2 = ids.clone()
    ids2[0, 3] = 17  # a later slot
    h2, logits2, _, _ = draft(drafter, ctx, torch.arange(C)[None], ids2, bpos)
    assert max_diff(h[:, 1], h2[:, 1]) > 1e-4, "slot 1 must see slot 3 (non-causal block)"
    assert max_diff(logits[:, 0], logits2[:, 0]) > 1e-4
    assert max_diff(h[:, 0], h2[:, 0]) > 1e-4  # even the anchor slot sees the block


def test_context_at_or_after_anchor_is_masked(tiny_pair):
    target, drafter = tiny_pair(block_size=8).load()
    C, anchor_pos = 10, 7  # ctx entries at positions 7, 8, 9 are at/after the anchor
    ctx = context_taps(target, 1, C)
    ids = block(drafter, [4])
    bpos = torch.arange(anchor_pos, anchor_pos + 8)[None]
    cpos = torch.arange(C)[None]
    h, logits, _, _ = draft(drafter, ctx, cpos, ids, bpos)
    junk = ctx.clone()
    junk[:, anchor_pos:] = torch.randn(junk[:, anchor_pos:].shape, generator=torch.Generator().manual_seed(0)) * 50
    h2, logits2, _, _ = draft(drafter, junk, cpos, ids, bpos)
    assert torch.equal(h, h2) and torch.equal(logits, logits2)
    # while context before the anchor does matter
    junk = ctx.clone()
    junk[:, anchor_pos - 1] += 1.0
    h3, _, _, _ = draft(drafter, junk, cpos, ids, bpos)
    assert max_diff(h, h3) > 1e-4
    # and masked-out context equals not passing it at all
    h4, logits4, _, _ = draft(drafter, ctx[:, :anchor_pos], cpos[:, :anchor_pos], ids, bpos)
    assert max_diff(h4, h) <= TOL and max_diff(logits4, logits) <= TOL


def test_hf_assistant_config_forms(tiny_pair, tmp_path):
    """hf_assistant_to_zlab reads what transformers reads: top-level rope_theta, and refuses what it would
    run differently (no layer_types = sliding windows) or what only has another model's defaults."""
    from helpers import patch_json

    from retrace.errors import CheckpointError, UnsupportedConfigError

    pair = tiny_pair(rope_theta=123456.0)
    hf_dir = zlab_to_hf_assistant(pair.drafter_dir, pair.target_dir, tmp_path / "hf")
    patch_json(hf_dir / "config.json", drop=("rope_parameters",), rope_theta=123456.0)
    back = hf_assistant_to_zlab(hf_dir, tmp_path / "back", num_target_layers=4)
    assert DrafterConfig.from_dir(back).layers.rope_theta == 123456.0

    patch_json(hf_dir / "config.json", drop=("layer_types",))
    with pytest.raises(UnsupportedConfigError, match="no layer_types.*sliding-window"):
        hf_assistant_to_zlab(hf_dir, tmp_path / "back2", num_target_layers=4)
    patch_json(hf_dir / "config.json", layer_types=["full_attention"], drop=("mask_token_id", "head_dim"))
    with pytest.raises(CheckpointError, match=r"missing required config keys \['head_dim', 'mask_token_id'\]"):
        hf_assistant_to_zlab(hf_dir, tmp_path / "back3", num_target_layers=4)
