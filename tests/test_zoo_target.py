"""Tiny model zoo, target stage: corpus, tokenizer, Qwen3 target, prompt sets (``test`` size, CPU only).

torch is imported inside the tests, after ``retrace.train.target_lm``, so that (when this file runs alone)
libgomp starts with OMP_WAIT_POLICY=PASSIVE, which keeps 2-thread training usable on a busy machine.
"""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from retrace.train import corpus, prompts, target_lm, tokenizer
from retrace.train.zoo_target import MANIFEST_NAME, build_target_stage, cached_metrics, read_manifest


@pytest.fixture(scope="module")
def built(zoo_target_stage):
    """The session's target stage (conftest.zoo_target_stage; test_zoo_pair reuses it)."""
    return zoo_target_stage


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_layout_and_metrics(built):
    out, m = built
    assert m["cached"] is False
    for rel in [
        "target/config.json",
        "target/model.safetensors",
        "target/generation_config.json",
        "target/tokenizer.json",
        "target/tokenizer_config.json",
        "target/zoo_manifest.json",
        "prompts/code.jsonl",
        "prompts/docs.jsonl",
        "data/train_prompts.jsonl",
        "data/split.json",
    ]:
        assert (out / rel).is_file(), rel
    assert not [p for p in out.iterdir() if p.name.startswith(".zoo-target-tmp")]
    assert m["vocab_size"] == 512 and m["uniform_ppl"] == 512
    assert m["params_total"] == sum(m["params"][k] for k in ("embedding", "lm_head", "non_embedding"))
    # clearly better than uniform (and than a unigram-ish model)
    assert math.isfinite(m["ppl"]) and m["ppl"] < m["vocab_size"] / 4
    assert 0 < m["bits_per_byte"] < 8
    assert m["weights_sha256"] == _sha(out / "target" / "model.safetensors")
    assert isinstance(m["sample"], str) and m["sample"]
    man = read_manifest(out)
    assert man["mask_token_id"] == tokenizer.MASK_ID and man["trained_context_length"] == 128


def test_cache_hit_does_not_train(built, monkeypatch):
    import retrace.train.zoo_target as zt

    out, m = built
    mtime = (out / "target" / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(zt, "_build", lambda *a, **k: pytest.fail("a cache hit must not train"))
    again = build_target_stage(out, size="test", seed=0, progress=False)
    assert again["cached"] is True and again["weights_sha256"] == m["weights_sha256"]
    assert (out / "target" / "model.safetensors").stat().st_mtime_ns == mtime
    assert cached_metrics(out, size="test", seed=1) is None  # another seed is another build
    assert cached_metrics(out, size="test", seed=0, steps=3) is None  # so is another preset


def test_tokenizer_loads_and_roundtrips(built):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out, _ = built
    tdir = out / "target"
    split = corpus.load_corpus("test")
    for tok in (AutoTokenizer.from_pretrained(tdir), PreTrainedTokenizerFast.from_pretrained(tdir)):
        assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == tokenizer.EOS_ID
        assert tok.pad_token == "<|pad|>" and tok.pad_token_id == tokenizer.PAD_ID
        assert tok.convert_tokens_to_ids("<|mask|>") == tokenizer.MASK_ID
        assert len(tok) == 512
        for f in split.eval:
            ids = tok(f.text, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == f.text, f.relpath
        odd = "x = 'é “quotes” \t tabs'\r\n  trailing  \n\n\u00a0\U0001f600"
        assert tok.decode(tok(odd, add_special_tokens=False)["input_ids"]) == odd
    assert (
        json.loads((tdir / "tokenizer_config.json").read_text())["tokenizer_class"]
        == "PreTrainedTokenizerFast"
    )


def test_target_loads_with_transformers(built):
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    out, m = built
    tdir = out / "target"
    model = Qwen3ForCausalLM.from_pretrained(tdir).eval()
    cfg = json.loads((tdir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (
        cfg["bos_token_id"] == cfg["eos_token_id"] == tokenizer.EOS_ID
        and cfg["pad_token_id"] == tokenizer.PAD_ID
    )
    assert cfg["max_position_embeddings"] == 512 and cfg["vocab_size"] == 512
    assert cfg["rope_parameters"]["rope_theta"] == 1_000_000.0
    gen = GenerationConfig.from_pretrained(tdir)
    assert gen.eos_token_id == tokenizer.EOS_ID and gen.pad_token_id == tokenizer.PAD_ID
    tok = AutoTokenizer.from_pretrained(tdir)
    ids = tok("def main(argv):\n    ", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()
    # the never-trained mask row was reset to a typical-norm vector, not left ~0
    emb = model.get_input_embeddings().weight.detach()
    norms = emb.norm(dim=1)
    assert norms[tokenizer.MASK_ID] == pytest.approx(float(norms[3:].mean()), rel=0.05)
    assert not torch.equal(emb, model.get_output_embeddings().weight.detach())  # untied


def test_prompt_files(built):
    out, m = built
    split = json.loads((out / "data" / "split.json").read_text())
    eval_paths, train_paths = set(split["eval_paths"]), set(split["train_paths"])
    assert eval_paths and train_paths and not eval_paths & train_paths
    code = prompts.read_jsonl(out / "prompts" / "code.jsonl")
    docs = prompts.read_jsonl(out / "prompts" / "docs.jsonl")
    train = prompts.read_jsonl(out / "data" / "train_prompts.jsonl")
    assert len(code) == 32 and len(docs) == 32 and len(train) == 256
    for rows, domain, (lo, hi) in (
        (code, "code", prompts.CODE_TOKENS),
        (docs, "docs", prompts.DOCS_TOKENS),
        (train, "code", prompts.TRAIN_TOKENS),
    ):
        assert {r["domain"] for r in rows} == {domain}
        assert len({r["prompt"] for r in rows}) == len(rows)
        for r in rows:
            assert isinstance(r["prompt"], str) and r["prompt"] == r["prompt"].rstrip()  # ends at a line end
            assert lo <= r["n_tokens"] <= hi
            assert "<|" not in r["prompt"]
    assert all(r["source"].split(":")[0] in eval_paths for r in code)  # held out
    assert all(r["source"].split(":")[0] in train_paths for r in train)
    assert all(r["prompt"].lstrip().startswith(("def ", "async def ", "class ", "@")) for r in code)
    assert len({r["source"].split(":")[0] for r in code}) >= 5  # spread over files


def test_corpus_split_and_tokenizer_deterministic(built):
    out, _ = built
    a, b = corpus.load_corpus("test"), corpus.load_corpus("test")
    assert a.fingerprint == b.fingerprint and [f.relpath for f in a.train] == [f.relpath for f in b.train]
    assert not {f.relpath for f in a.train} & {f.relpath for f in a.eval}
    full = corpus.load_corpus("small")
    assert {f.relpath for f in a.eval} <= {f.relpath for f in full.eval}  # the split does not depend on caps
    assert all(
        not p.startswith(("test/", "idlelib/", "lib2to3/", "site-packages/")) and "/test/" not in p
        for p in (f.relpath for f in full.train)
    )
    # retraining the tokenizer gives a byte-identical tokenizer.json
    tok = tokenizer.train_bpe([f.text for f in a.train], 512)
    tokenizer.save_tokenizer(tok, out / "tok_again")
    assert _sha(out / "tok_again" / "tokenizer.json") == _sha(out / "target" / "tokenizer.json")


def test_training_deterministic():
    import torch

    preset = target_lm.get_preset("test", steps=6, warmup_steps=2, batch_size=4, seq_len=32)
    stream = torch.arange(5000) % 97 + 3
    shas = []
    for _ in range(2):
        with target_lm.torch_threads(2):
            model = target_lm.build_model(target_lm.make_config(preset), seed=7)
            stats = target_lm.train_target(model, stream, preset, seed=7, progress=False)
        h = hashlib.sha256()
        for k, v in sorted(model.state_dict().items()):
            h.update(k.encode())
            h.update(v.detach().contiguous().numpy().tobytes())
        shas.append((h.hexdigest(), stats["final_loss_ema"]))
    assert shas[0] == shas[1]


def test_failed_compile_trains_eagerly_with_the_same_result(monkeypatch, capsys):
    """preset.compile: if the compiled model fails (no C++ compiler, unsupported op), training goes on eagerly
    from the same batch and gives exactly the weights of an eager run."""
    import torch

    def state(compile_flag: bool) -> list:
        preset = target_lm.get_preset("test", steps=3, warmup_steps=1, batch_size=2, seq_len=16, compile=compile_flag)
        with target_lm.torch_threads(1):
            model = target_lm.build_model(target_lm.make_config(preset), seed=3)
            target_lm.train_target(model, torch.arange(2000) % 89 + 3, preset, seed=3, progress=False)
        return [v.clone() for _, v in sorted(model.state_dict().items())]

    def broken(model):
        def fail(*args, **kwargs):
            raise RuntimeError("no compiler here")

        return fail

    eager = state(False)
    monkeypatch.setattr(target_lm, "compiled", broken)
    fallback = state(True)
    assert "torch.compile failed (RuntimeError: no compiler here)" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(eager, fallback, strict=True))


def test_lr_schedule_and_reset_guard():
    p = target_lm.get_preset("test", steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert target_lm.lr_at(0, p) == pytest.approx(1e-4)
    assert target_lm.lr_at(9, p) == pytest.approx(1e-3)
    assert target_lm.lr_at(99, p) == pytest.approx(1e-4, rel=0.01)
    tied = target_lm.build_model(target_lm.make_config(target_lm.get_preset("test", tie_embeddings=True)), 0)
    with pytest.raises(ValueError):
        target_lm.reset_untrained_rows(tied, [tokenizer.MASK_ID])


def test_cut_at_tokens_line_aligned():
    text = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(200))
    tok = tokenizer.train_bpe([text], 300)
    cut = prompts.cut_at_tokens(tok, text, 20, 40, 30)
    assert cut is not None and text.startswith(cut) and text[len(cut)] == "\n" and cut == cut.rstrip()
    ids = tok.encode(cut).ids
    assert 20 <= len(ids) <= 40
    assert tok.encode(text).ids[: len(ids)] == ids  # the cut is on a token boundary of the source
    assert prompts.cut_at_tokens(tok, "def f(x):\n    return x\n", 20, 40, 30) is None  # too short
    assert prompts.cut_at_tokens(tok, "x" * 500, 20, 40, 30) is None  # no line end


def test_prompt_only_rebuild_keeps_weights(built, tmp_path):
    """A manifest whose prompt key is stale (here: the version-1 flat key) regenerates prompts, not weights."""
    import shutil

    src, m = built
    out = tmp_path / "zoo"
    for sub in ("target", "prompts", "data"):
        shutil.copytree(src / sub, out / sub)
    man = read_manifest(out)
    legacy = dict(man["train_key"], stage_version=man["train_key"]["target_version"], prompt_counts={})
    del legacy["target_version"]
    (out / "target" / MANIFEST_NAME).write_text(json.dumps({"key": legacy, "metrics": man["metrics"]}))
    (out / "prompts" / "code.jsonl").write_text("")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = out / f".zoo-target-tmp-{dead.pid}-deadbeef"
    (stale / "target").mkdir(parents=True)
    assert cached_metrics(out, size="test", seed=0) is None
    again = build_target_stage(out, size="test", seed=0, progress=False)
    assert again["prompts_rebuilt"] is True and again["cached"] is False
    assert _sha(out / "target" / "model.safetensors") == m["weights_sha256"]
    assert (out / "prompts" / "code.jsonl").read_bytes() == (src / "prompts" / "code.jsonl").read_bytes()
    assert build_target_stage(out, size="test", seed=0, progress=False)["cached"] is True
    assert not stale.exists()  # left by a dead build: removed
