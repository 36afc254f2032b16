"""The llama.cpp peer's GGUF (retrace.bench.llamacpp_convert, llamacpp_build.build_gguf): llama.cpp's own converter
takes the zoo's tokenizer (whose pre-tokenizer hash it does not list), the GGUF tokenizes the zoo prompts
exactly as our tokenizer does, and the f16 GGUF's greedy decode follows the target's own. The conversion
needs llama-cpp-python and a llama.cpp source tree (LLAMA_CPP_SRC, or `make llama-src`): skipped without."""

from __future__ import annotations

import importlib.util
import json

import pytest

from retrace.bench import llamacpp_convert as lc
from retrace.errors import RetraceError


def test_pre_tokenizer_names_follow_the_tokenizer_json():
    gpt2 = {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                                                        "use_regex": True}}
    qwen2 = {"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": lc.QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}}
    words = {"model": {"type": "WordLevel"}, "pre_tokenizer": {"type": "WhitespaceSplit"}}
    assert [lc.pre_tokenizer_name(t) for t in (gpt2, qwen2, words)] == ["gpt-2", "qwen2", "whitespace"]
    with pytest.raises(RetraceError, match="no llama.cpp pre-tokenizer .*Metaspace"):
        lc.pre_tokenizer_name({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Metaspace"}})


def test_word_merges_rebuild_each_word_left_to_right():
    assert lc.word_merges(["t1x", "t12x", "a"]) == ["t 1", "t1 x", "t1 2", "t12 x"]


@pytest.fixture(scope="module")
def zoo_gguf(zoo_target_stage, tmp_path_factory):
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("needs llama-cpp-python (the llamacpp extra)")
    from retrace.bench.llamacpp_build import build_gguf, converter

    try:
        converter()
    except RetraceError as e:
        pytest.skip(str(e))
    out, _ = zoo_target_stage
    q8 = build_gguf(out / "target", tmp_path_factory.mktemp("gguf"), "Q8_0", lambda msg: None)
    return out, q8


def test_zoo_gguf_tokenizes_the_zoo_prompts_as_our_tokenizer(zoo_gguf):
    import llama_cpp

    from retrace.train.tokenizer import load_tokenizer

    out, q8 = zoo_gguf
    assert q8.is_file() and (q8.parent / "model-f16.gguf").is_file()
    tok = load_tokenizer(out / "target").backend_tokenizer
    texts = [json.loads(line)["prompt"] for f in ("code", "docs") for line in (out / "prompts" / f"{f}.jsonl").open()]
    texts += ["a\nb", "  x  y\n\n z ", "I've 'RE 333 3.3 \U0001f680 ", "\t\ttab", "end "]
    llm = llama_cpp.Llama(str(q8), vocab_only=True, verbose=False)
    try:
        ours = [tok.encode(t, add_special_tokens=False).ids for t in texts]
        assert [llm.tokenize(t.encode(), add_bos=False, special=False) for t in texts] == ours
    finally:
        llm.close()


def test_zoo_gguf_f16_greedy_follows_the_target(zoo_gguf):
    """Numerics differ (f16 weights, llama.cpp's kernels): most, not all, tokens must agree; a wrong tensor
    mapping agrees on almost none."""
    import llama_cpp
    import torch
    from transformers import AutoModelForCausalLM

    out, q8 = zoo_gguf
    model = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    llm = llama_cpp.Llama(str(q8.parent / "model-f16.gguf"), n_ctx=256, n_threads=1, verbose=False)
    from retrace.train.tokenizer import load_tokenizer

    tok = load_tokenizer(out / "target").backend_tokenizer
    n, agree, total = 16, 0, 0
    try:
        for line in list((out / "prompts" / "docs.jsonl").open())[:3]:
            ids = tok.encode(json.loads(line)["prompt"], add_special_tokens=False).ids[:64]
            with torch.no_grad():
                ref = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                     eos_token_id=None)[0, len(ids):].tolist()
            got = []
            for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
                got.append(int(t))
                if len(got) == len(ref):
                    break
            agree += sum(a == b for a, b in zip(ref, got, strict=True))
            total += len(ref)
    finally:
        llm.close()
    assert total and agree / total >= 0.8, (agree, total)


def test_ar_and_ngram_systems_share_one_model_and_agree(zoo_gguf):
    """The bench's llama.cpp systems of one GGUF share its model and context (retrace.bench.llamacpp_peers):
    prompt lookup is lossless greedy, so its tokens equal plain decoding's, run after run, whatever ran
    before on the shared context."""
    from retrace.bench.llamacpp_peers import LlamaCppSystem, load_llama
    from retrace.train.tokenizer import load_tokenizer

    out, q8 = zoo_gguf
    tok = load_tokenizer(out / "target").backend_tokenizer
    prompts = [tok.encode(json.loads(line)["prompt"], add_special_tokens=False).ids[:48]
               for line in list((out / "prompts" / "code.jsonl").open())[:2]]
    llm = load_llama(q8, 1, 48 + 24 + 10)
    try:
        ar, ngram = LlamaCppSystem(llm, "llamacpp-ar-q8_0"), LlamaCppSystem(llm, "llamacpp-ngram-q8_0", 4)
        first = ar.run(prompts, 24, 1).outputs
        assert [len(o) for o in first] == [24, 24]
        assert ngram.run(prompts, 24, 1).outputs == first
        assert ar.run(prompts, 24, 1).outputs == first
    finally:
        llm.close()
