"""`retrace zoo inflate`: a zoo pair (target, DFlash drafter, ReTrace conditioner) expanded function-preservingly
to a bigger shape: greedy ar / dflash / retrace token-identical, real-id logits equal, padded ids never
produced, cached and atomic. The pair here is random (its conditioner random too, so it changes drafts)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from helpers import write_drafter, write_target

from retrace.cli import main
from retrace.models.drafter import load_pair
from retrace.models.layers import rope_cos_sin
from retrace.train import inflate as inf
from retrace.train.inflate_check import logit_parity

SMALL = dict(vocab=128, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=96)
# As the small zoo -> Qwen3-0.6B: hidden x4, head_dim x2; also layers +2, heads x2, vocab x3.
BIG = dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
           intermediate_size=192, vocab_size=384)
OPTS = {"hidden_size": "--hidden-size", "num_hidden_layers": "--layers", "num_attention_heads": "--heads",
        "num_key_value_heads": "--kv-heads", "head_dim": "--head-dim", "intermediate_size": "--intermediate-size",
        "vocab_size": "--vocab-size"}


def _args(shape: dict) -> list[str]:
    return [x for k, v in shape.items() for x in (OPTS[k], str(v))]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("inflate")
    t = write_target(root / "pair" / "target", **SMALL)
    d = write_drafter(root / "pair" / "drafter", t, layers=2, block_size=8, target_layer_ids=[1, 3],
                      conditioner="random", seed=1)
    z = root / "zoo"
    shutil.copytree(t, z / "target")
    shutil.copytree(d, z / "drafter")
    (z / "prompts").mkdir()
    g = torch.Generator().manual_seed(0)
    for name in ("code", "docs"):
        rows = [{"prompt_ids": torch.randint(0, SMALL["vocab"], (int(n),), generator=g).tolist()}
                for n in torch.randint(3, 20, (8,), generator=g)]
        (z / "prompts" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return z


def _inflate(zoo, out, shape, *extra):
    return CliRunner().invoke(main, ["zoo", "inflate", "--from", str(zoo), "--out", str(out), *_args(shape),
                                     "--quiet", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def inflated(zoo):
    out = zoo.parent / "big"
    res = _inflate(zoo, out, BIG, "--check-prompts", "8", "--check-new-tokens", "16", "--sample-tokens", "10000")
    assert res.exit_code == 0, res.output
    return out


def rms_norm(x, w, eps):
    """The models' RMSNorm formula, in float64 (theirs computes in float32)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_rms_norm_compensation_is_exact():
    """x * rsqrt(mean(x^2) + eps) * w over [x, beta*x, c, 0] with eps' and w * sqrt(K d / D) == the original."""
    small = inf.Shape(64, 4, 4, 2, 16, 96, 128)
    p = inf.make_plan(small, inf.Shape(**BIG), 1e-6)
    x = torch.randn(5, 64, dtype=torch.float64) * torch.tensor([1e-4, 1e-2, 1.0, 30.0, 1e3]).double()[:, None]
    w = torch.randn(64, dtype=torch.float64)
    wide = torch.zeros(5, 256, dtype=torch.float64)
    wide[:, :64], wide[:, 64:128], wide[:, p.const_channel] = x, p.beta * x, p.const
    got = rms_norm(wide, inf.stream_norm(w, p, p.stream_scale).double(), p.new_eps)[:, :64]
    torch.testing.assert_close(got, rms_norm(x, w, 1e-6), rtol=1e-12, atol=0)  # float64: exact up to rounding
    # the drafter's context stream [u, beta_ctx * u, 0] with its own factor
    ctx = torch.zeros(5, 256, dtype=torch.float64)
    ctx[:, :64], ctx[:, 64:128] = x, p.ctx_beta * x
    got = rms_norm(ctx, inf.stream_norm(w, p, p.ctx_scale).double(), p.new_eps)[:, :64]
    torch.testing.assert_close(got, rms_norm(x, w, 1e-6), rtol=1e-12, atol=0)
    # a head: zero-padded dims with eps * hd / hd'; q keeps its weight (x sqrt(r) = the attention-scale change)
    q, wq = x[:, :16], w[:16]
    pad = torch.zeros(5, 32, dtype=torch.float64)
    pad[:, p.dim_index()] = q
    got = rms_norm(pad, inf.head_norm(wq, p, 1.0).double(), p.new_eps)[:, p.dim_index()]
    torch.testing.assert_close(got / 2 ** 0.5, rms_norm(q, wq, 1e-6), rtol=1e-12, atol=0)


def test_rope_frequencies_of_moved_head_dims_are_identical():
    p = inf.make_plan(inf.Shape(64, 4, 4, 2, 16, 96, 128), inf.Shape(**BIG), 1e-6)
    pos = torch.arange(50).unsqueeze(0)
    cos, sin = rope_cos_sin(pos, 16, 1e6, torch.float32)
    cos2, sin2 = rope_cos_sin(pos, 32, 1e6, torch.float32)
    assert torch.equal(cos2[..., p.dim_index()], cos) and torch.equal(sin2[..., p.dim_index()], sin)


def test_inflated_pair_is_exact(zoo, inflated):
    man = json.loads((inflated / "manifest.json").read_text())
    ex = man["exactness"]
    g = ex["greedy"]
    assert g["all_identical"] and g["prompts"] == 8
    for mode in ("ar", "dflash", "retrace"):
        m = g["modes"][mode]
        assert m["outputs_identical"] and m["acceptance_identical"] and m["tokens"] == 8 * 16
        for kind, d in m["logits"].items():
            assert d["rel_diff"] < 1e-5, (mode, kind, d)
    assert set(g["modes"]["retrace"]["logits"]) == {"target", "draft"}
    assert ex["logits"]["rel_diff"] < 1e-5
    s = ex["sampled"]
    assert s["tokens"] >= 10_000 and s["padded_ids"] == 0 and s["temperature"] == 1.0
    assert s["pad_margin_min"]["target"] > 100 and min(g["pad_margin_min"].values()) > 100
    assert man["shape"] == BIG


def test_layout_and_configs(zoo, inflated):
    for f in ("target/config.json", "target/model.safetensors", "drafter/config.json", "drafter/model.safetensors",
              "drafter/retrace_config.json", "drafter/retrace.safetensors", "prompts/code.jsonl", "manifest.json"):
        assert (inflated / f).is_file(), f
    assert not list(inflated.parent.glob(".big.tmp-*"))
    t = json.loads((inflated / "target" / "config.json").read_text())
    assert (t["hidden_size"], t["num_hidden_layers"], t["head_dim"], t["vocab_size"]) == (256, 6, 32, 384)
    assert t["rms_norm_eps"] == pytest.approx(1e-6 * 16 / 32)
    d = json.loads((inflated / "drafter" / "config.json").read_text())
    small_d = json.loads((zoo / "drafter" / "config.json").read_text())
    # original layers 0..3 sit at 0, 2, 3, 5 (the last stays last); taps 1, 3 follow them
    assert d["dflash_config"]["target_layer_ids"] == [2, 5] and d["num_target_layers"] == 6
    assert d["dflash_config"]["mask_token_id"] == small_d["dflash_config"]["mask_token_id"] < SMALL["vocab"]
    assert d["num_hidden_layers"] == 2
    man = json.loads((inflated / "manifest.json").read_text())
    assert man["params"]["target_non_embedding"] == 6 * (256 * 8 * 32 * 2 + 256 * 4 * 32 * 2 + 3 * 256 * 192
                                                         + 2 * 256 + 2 * 32) + 256


def test_logits_of_real_ids_on_fresh_prompts(zoo, inflated):
    small, big = load_pair(zoo / "target", zoo / "drafter"), load_pair(inflated / "target", inflated / "drafter")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, SMALL["vocab"], (40,), generator=g).tolist() for _ in range(3)]
    rep = logit_parity(small[0], big[0], prompts)
    assert rep["rel_diff"] < 1e-5 and rep["pad_margin_min"] > 100


def test_rerun_is_a_cache_hit(zoo, inflated):
    before = (inflated / "manifest.json").read_text()
    res = _inflate(zoo, inflated, BIG, "--check-prompts", "8", "--check-new-tokens", "16", "--sample-tokens", "10000")
    assert res.exit_code == 0, res.output
    assert "cache hit" in res.output
    assert (inflated / "manifest.json").read_text() == before


def test_same_head_dim_and_copied_kv_heads(zoo, tmp_path):
    """head_dim kept, one K/V head per query head (each original K/V head copied twice), no new layers."""
    shape = dict(BIG, hidden_size=192, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, head_dim=16)
    res = _inflate(zoo, tmp_path / "b2", shape, "--check-prompts", "6", "--check-new-tokens", "16",
                   "--sample-tokens", "0")
    assert res.exit_code == 0, res.output
    man = json.loads((tmp_path / "b2" / "manifest.json").read_text())
    assert man["exactness"]["greedy"]["all_identical"]
    assert man["plan"]["kv_src"] == [0, 0, 1, 1, None, None, None, None]


def test_bad_shape_is_refused_and_leaves_nothing(zoo, tmp_path):
    res = _inflate(zoo, tmp_path / "b3", dict(BIG, hidden_size=100))
    assert res.exit_code != 0
    assert "hidden_size 100 < 2 * 64 + 1" in res.output
    assert not list(tmp_path.iterdir())
    res = CliRunner().invoke(main, ["zoo", "inflate", "--from", str(zoo), "--out", str(tmp_path / "b4"),
                                    "--hidden-size", "256"])
    assert res.exit_code != 0 and "--layers" in res.output


def test_padded_rows_stay_finite_in_float16():
    """The padded ids' LM-head weight is capped where float16 (an fp16 bundle, a GGUF's blocks) still holds it;
    the cap leaves padded logits far below the real ones at the Qwen3-0.6B shape's own factor."""
    p = inf.make_plan(inf.Shape(64, 4, 4, 2, 16, 96, 128), inf.Shape(**BIG), 1e-6)
    free = inf.pad_scale_for(p, 1e3)
    assert free < inf.PAD_SCALE_MAX and inf.pad_gap(p, 1e3, free) == pytest.approx(1000.0)
    tiny_rho = 1e-3  # a final norm that lets the constant channel arrive weak
    capped = inf.pad_scale_for(p, tiny_rho)
    assert capped == inf.PAD_SCALE_MAX and torch.isfinite(torch.tensor(capped).half())
    assert inf.pad_gap(p, tiny_rho, capped) < 1000.0
    head = inf.lm_head(torch.randn(128, 64), p, capped)
    assert torch.isfinite(head.half()).all() and head.abs().max() == inf.PAD_SCALE_MAX
