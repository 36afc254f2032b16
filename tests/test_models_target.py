"""Qwen3Target (functional forward with explicit K/V) vs transformers' Qwen3ForCausalLM, fp32.

The reference is always HF on the full sequence without a cache; ours builds its cache by concatenating
the new_k/new_v it returned, so prefill, decode and verify are each checked against the same positions
of one HF forward. Tolerance: max abs diff <= 1e-5 on logits and on the tap hidden states.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from helpers import load_hf_target, max_diff, write_target
from torch.utils._python_dispatch import TorchDispatchMode

from retrace.models.target import Qwen3Target

TOL = 1e-5
TAPS = (0, 2, 3)  # 4-layer targets: includes the last layer (HF's last hidden_states entry is post-norm)

# GQA ratio 1, 2, 4; head_dim == hidden/heads and != hidden/heads; tied and untied embeddings.
CONFIGS = {
    "gqa1-hd16-untied": dict(hidden=64, heads=4, kv_heads=4, head_dim=16, tie=False),
    "gqa2-hd32-tied": dict(hidden=64, heads=4, kv_heads=2, head_dim=32, tie=True),
    "gqa4-hd12-untied": dict(hidden=64, heads=8, kv_heads=2, head_dim=12, tie=False),
}


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def models(request, tmp_path_factory):
    """(ours, HF) on one random target per config, shared by this module's tests (read-only)."""
    d = write_target(tmp_path_factory.mktemp("target"), **CONFIGS[request.param], layers=4, vocab=128)
    return Qwen3Target.from_pretrained(d, tap_layers=TAPS), load_hf_target(d)


def hf_ref(hf, ids, attention_mask=None, position_ids=None):
    with torch.no_grad():
        out = hf(ids, attention_mask=attention_mask, position_ids=position_ids, output_hidden_states=True)
    taps = torch.cat([out.hidden_states[i + 1] for i in TAPS], dim=-1)
    return out.logits, taps


def ours_call(model, ids, positions, past_k=None, past_v=None, past_len=None, **kw):
    N = ids.shape[0]
    if past_k is None:
        past_k, past_v = model.empty_past(N)
    if past_len is None:
        past_len = torch.full((N,), past_k[0].shape[2], dtype=torch.long)
    with torch.no_grad():
        return model(ids, positions, past_k, past_v, past_len, **kw)


def cat_cache(a, b):
    return [torch.cat([x, y], dim=2) for x, y in zip(a, b, strict=True)]


def test_tied_embeddings_share_storage(models):
    ours, hf = models
    tied = ours.config.tie_word_embeddings
    assert tied == hf.config.tie_word_embeddings
    assert (ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()) == tied
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight, rtol=0, atol=0)


def test_prefill_decode_verify_match_hf(models):
    ours, hf = models
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (1, 7 + 1 + 16), generator=g)
    ref_logits, ref_taps = hf_ref(hf, ids)
    pos = torch.arange(ids.shape[1])[None]

    # prefill 7
    lg, tp, k, v = ours_call(ours, ids[:, :7], pos[:, :7])
    assert lg.shape == (1, 7, 128) and tp.shape == (1, 7, len(TAPS) * 64)
    assert k[0].shape == (1, ours.config.layers.num_key_value_heads, 7, ours.config.layers.head_dim)
    diffs = {"prefill": (max_diff(lg, ref_logits[:, :7]), max_diff(tp, ref_taps[:, :7]))}

    # decode 1 token on top of the cache
    lg, tp, k1, v1 = ours_call(ours, ids[:, 7:8], pos[:, 7:8], k, v)
    diffs["decode"] = (max_diff(lg, ref_logits[:, 7:8]), max_diff(tp, ref_taps[:, 7:8]))
    k, v = cat_cache(k, k1), cat_cache(v, v1)

    # verify 16 tokens on top of the cache, logits at selected slots only
    idx = torch.tensor([[15, 0, 3, 7]])
    lg, tp, _, _ = ours_call(ours, ids[:, 8:], pos[:, 8:], k, v, logits_index=idx)
    assert lg.shape == (1, 4, 128)
    diffs["verify16"] = (max_diff(lg, ref_logits[:, 8:][:, idx[0]]), max_diff(tp, ref_taps[:, 8:]))
    print("parity", diffs)
    for case, (dl, dt) in diffs.items():
        assert dl <= TOL and dt <= TOL, f"{case}: logits diff {dl:.3g}, taps diff {dt:.3g}"


def test_right_ragged_batch_matches_hf(models):
    """Rows of different lengths: caches from separate batch-1 prefills, padded with garbage beyond
    past_len (as after a partial accept), then one batched 16-token verify at per-row positions."""
    ours, hf = models
    g = torch.Generator().manual_seed(1)
    lens, T = [3, 9, 13], 16
    rows = [torch.randint(0, 128, (1, n + T), generator=g) for n in lens]
    P = max(lens) + 2
    past_k = [torch.randn(len(lens), *k.shape[1:2], P, k.shape[3], generator=g) * 10 for k in ours.empty_past(1, 1)[0]]
    past_v = [torch.randn_like(k) * 10 for k in past_k]
    for n, (row, L) in enumerate(zip(rows, lens, strict=True)):
        _, _, k, v = ours_call(ours, row[:, :L], torch.arange(L)[None])
        for layer in range(len(past_k)):
            past_k[layer][n, :, :L] = k[layer][0]
            past_v[layer][n, :, :L] = v[layer][0]
    past_len = torch.tensor(lens)
    ids = torch.cat([row[:, L:] for row, L in zip(rows, lens, strict=True)])
    positions = past_len[:, None] + torch.arange(T)[None]
    lg, tp, _, _ = ours_call(ours, ids, positions, past_k, past_v, past_len)
    worst_l = worst_t = 0.0
    for n, (row, L) in enumerate(zip(rows, lens, strict=True)):
        ref_logits, ref_taps = hf_ref(hf, row)
        worst_l = max(worst_l, max_diff(lg[n], ref_logits[0, L:]))
        worst_t = max(worst_t, max_diff(tp[n], ref_taps[0, L:]))
    print("parity right-ragged", worst_l, worst_t)
    assert worst_l <= TOL and worst_t <= TOL, (worst_l, worst_t)


def test_left_padded_batch_matches_hf(models):
    """Left padding via input_valid/past_valid vs HF with attention_mask + position_ids:
    prefill, 1-token decode, then a 16-token verify, comparing valid positions only."""
    ours, hf = models
    g = torch.Generator().manual_seed(2)
    lens, S, T = [4, 9, 12], 12, 16
    N = len(lens)
    valid = torch.zeros(N, S, dtype=torch.bool)
    for n, L in enumerate(lens):
        valid[n, S - L:] = True
    ids = torch.randint(0, 128, (N, S), generator=g).masked_fill(~valid, 0)
    pos = (valid.long().cumsum(-1) - 1).clamp_min(0)
    more = torch.randint(0, 128, (N, 1 + T), generator=g)
    more_pos = pos[:, -1:] + 1 + torch.arange(1 + T)[None]
    full_ids = torch.cat([ids, more], 1)
    full_mask = torch.cat([valid, torch.ones(N, 1 + T, dtype=torch.bool)], 1)
    full_pos = torch.cat([pos, more_pos], 1)
    ref_logits, ref_taps = hf_ref(hf, full_ids, full_mask.long(), full_pos)

    lg, tp, k, v = ours_call(ours, ids, pos, input_valid=valid)
    d_pre = (max_diff(lg[valid], ref_logits[:, :S][valid]), max_diff(tp[valid], ref_taps[:, :S][valid]))

    past_len = torch.full((N,), S)
    lg, tp, k1, v1 = ours_call(ours, more[:, :1], more_pos[:, :1], k, v, past_len, past_valid=valid)
    d_dec = (max_diff(lg, ref_logits[:, S:S + 1]), max_diff(tp, ref_taps[:, S:S + 1]))

    k, v = cat_cache(k, k1), cat_cache(v, v1)
    pv = torch.cat([valid, torch.ones(N, 1, dtype=torch.bool)], 1)
    lg, tp, _, _ = ours_call(ours, more[:, 1:], more_pos[:, 1:], k, v, past_len + 1, past_valid=pv)
    d_ver = (max_diff(lg, ref_logits[:, S + 1:]), max_diff(tp, ref_taps[:, S + 1:]))
    print("parity left-padded", d_pre, d_dec, d_ver)
    for case, (dl, dt) in {"prefill": d_pre, "decode": d_dec, "verify16": d_ver}.items():
        assert dl <= TOL and dt <= TOL, f"left-padded {case}: logits diff {dl:.3g}, taps diff {dt:.3g}"


def test_embed_and_lm_head_are_hf_pieces(models):
    ours, hf = models
    ids = torch.arange(10)[None]
    with torch.no_grad():
        torch.testing.assert_close(ours.embed(ids), hf.model.embed_tokens(ids), rtol=0, atol=0)
        h = torch.randn(1, 3, 64)
        torch.testing.assert_close(ours.lm_head(h), hf.lm_head(h), rtol=0, atol=0)


class _Allocations(TorchDispatchMode):
    """Bytes of the new tensors each allocating op makes (uninitialised and converted copies), by dtype."""

    MAKES = ("aten.empty_like.default", "aten.empty.memory_format", "aten.empty_strided.default",
             "aten._to_copy.default", "aten.clone.default")

    def __init__(self):
        super().__init__()
        self.made: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func) in self.MAKES and isinstance(out, torch.Tensor) and out.device.type != "meta":
            self.made[out.dtype] += out.numel() * out.element_size()
        return out


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_bf16_load_makes_bf16_parameters_only(tmp_path, tie):
    """An fp32 checkpoint loaded as bf16 goes straight into bf16 parameters, one tensor at a time: no fp32
    model is made first (a bf16 Qwen3-8B would need a 33 GB fp32 copy in host memory), with the same bits as
    converting the fp32 model."""
    d = write_target(tmp_path, tie=tie)
    with _Allocations() as allocations:
        ours = Qwen3Target.from_pretrained(d, tap_layers=TAPS, dtype=torch.bfloat16)
    params = sum(p.numel() * p.element_size() for p in ours.parameters())
    assert allocations.made[torch.float32] == 0
    assert allocations.made[torch.bfloat16] <= 1.1 * params  # the tied head's placeholder, then the shared one
    wide = Qwen3Target.from_pretrained(d, tap_layers=TAPS).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie
    for (name, p), q in zip(ours.state_dict().items(), wide.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
