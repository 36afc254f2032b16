"""llama.cpp's `convert_hf_to_gguf.py` for targets whose tokenizer llama.cpp's converter does not recognise.

    LLAMA_CPP_SRC=DIR python -m retrace.bench.llamacpp_convert MODEL_DIR --outfile F.gguf --outtype f16

The converter names a byte-level BPE tokenizer's pre-tokenizer (the regex that splits text before the
merges) by hashing the ids of a fixed test string, and refuses hashes it does not list: every tokenizer we
train has a new vocabulary, so a new hash. This runs the converter unchanged (its own main, its own tensor
mapping) with two hooks on its `TextModel`:
- `get_vocab_base_pre`: when the hash is unknown, the llama.cpp name read from the tokenizer.json's
  `pre_tokenizer` instead (`pre_tokenizer_name`: GPT-2's ByteLevel regex -> "gpt-2", Qwen2's Split regex
  + ByteLevel -> "qwen2"); any other pre-tokenizer stays the converter's error.
- `_set_vocab_gpt2`: a WordLevel vocabulary split on whitespace (the random 0.6B-shape test targets') has
  no merges, which llama.cpp's BPE tokenizers need; it is written as llama.cpp's "whitespace" tokenizer
  with merges that rebuild each word from its characters, left to right (`word_merges`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from retrace.errors import RetraceError

# tokenizer.json pre-tokenizer regexes and the llama.cpp names whose split is the same
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
log = logging.getLogger("retrace.llamacpp_convert")


def pre_tokenizer_name(tokenizer_json: dict) -> str:
    """The llama.cpp pre-tokenizer name (`tokenizer.ggml.pre`) that splits text as this tokenizer.json does."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    kind = pre.get("type")
    if tokenizer_json.get("model", {}).get("type") == "WordLevel" and kind == "WhitespaceSplit":
        return "whitespace"
    if kind == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False):
        return "gpt-2"  # tokenizers' ByteLevel regex is GPT-2's
    steps = pre.get("pretokenizers", []) if kind == "Sequence" else []
    if (len(steps) == 2 and steps[0].get("type") == "Split"
            and steps[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT and steps[0].get("behavior") == "Isolated"
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True)):
        return "qwen2"
    raise RetraceError(f"no llama.cpp pre-tokenizer is known to split text like this tokenizer's pre_tokenizer "
                       f"({json.dumps(pre)[:200]}): llama.cpp cannot tokenize for it")


def word_merges(tokens: list[str]) -> list[str]:
    """BPE merges ("left right") that build every token from its characters, left to right (WordLevel)."""
    out, seen = [], set()
    for tok in sorted(tokens, key=len):
        for i in range(1, len(tok)):
            m = f"{tok[:i]} {tok[i]}"
            if m not in seen:
                seen.add(m)
                out.append(m)
    return out


def word_vocab(tokenizer_json: dict, vocab_size: int, token_type) -> tuple[list[str], list[int]]:
    """A WordLevel vocabulary's tokens by id, padded to the model's rows (read from tokenizer.json itself:
    AutoTokenizer would add the model type's default specials past the vocabulary)."""
    by_id = {i: t for t, i in tokenizer_json["model"]["vocab"].items()}
    special = {a["id"]: a["content"] for a in tokenizer_json.get("added_tokens", [])}
    if max([*by_id, *special], default=-1) >= vocab_size:
        raise RetraceError(f"the tokenizer has ids past the model's vocab_size {vocab_size}")
    tokens = [special.get(i, by_id.get(i, f"[PAD{i}]")) for i in range(vocab_size)]
    types = [token_type.CONTROL if i in special else token_type.NORMAL if i in by_id else token_type.UNUSED
             for i in range(vocab_size)]
    return tokens, [int(t) for t in types]


def _tokenizer_json(model_dir: Path) -> dict:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise RetraceError(f"{model_dir} has no tokenizer.json: the GGUF needs the target's tokenizer")
    return json.loads(path.read_text(encoding="utf-8"))


def _hook(text_model, gguf) -> None:
    original_pre, original_gpt2 = text_model.get_vocab_base_pre, text_model._set_vocab_gpt2

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original_pre(self, tokenizer)
        except NotImplementedError:
            name = pre_tokenizer_name(_tokenizer_json(Path(self.dir_model)))
            log.warning("pre-tokenizer hash unknown to llama.cpp; from tokenizer.json: %r", name)
            return name

    def set_vocab_gpt2(self) -> None:
        tj = _tokenizer_json(Path(self.dir_model))
        if tj.get("model", {}).get("type") != "WordLevel":
            return original_gpt2(self)
        tokens, toktypes = word_vocab(tj, self.hparams["vocab_size"], gguf.TokenType)
        self.gguf_writer.add_tokenizer_model("whitespace")
        self.gguf_writer.add_tokenizer_pre(pre_tokenizer_name(tj))
        self.gguf_writer.add_token_list(tokens)
        self.gguf_writer.add_token_types(toktypes)
        self.gguf_writer.add_token_merges(word_merges(list(tj["model"]["vocab"])))
        gguf.SpecialVocab(self.dir_model, load_merges=False).add_to_gguf(self.gguf_writer)

    text_model.get_vocab_base_pre = get_vocab_base_pre
    text_model._set_vocab_gpt2 = set_vocab_gpt2


def main(argv: list[str] | None = None) -> None:
    src = Path(os.environ.get("LLAMA_CPP_SRC", ""))
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise SystemExit(f"LLAMA_CPP_SRC={src} has no convert_hf_to_gguf.py")
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import convert_hf_to_gguf  # the converter's own module (its main is not run on import)
    import gguf
    from conversion import TextModel

    _hook(TextModel, gguf)
    sys.argv = [str(script), *(sys.argv[1:] if argv is None else argv)]
    try:
        convert_hf_to_gguf.main()
    except RetraceError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
