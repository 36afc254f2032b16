"""Incremental detokenization equals decoding the whole output, after every round's tokens: on a
byte-level BPE (tokens that split UTF-8 characters: CJK, emoji) and on the tests' word-level tokenizer."""

from __future__ import annotations

import random

import pytest
from runtime_fixtures import write_word_tokenizer

from retrace.runtime.detokenize import IncrementalText
from retrace.runtime.tokenizer import TextCodec

TEXT = ["Speculative decoding drafts a block and the target verifies it.", "速度很快，结果不变。",
        "emoji 🚀🔥 and accents: café, naïve, Zürich", "def f(x):\n    return x * 2  # code"] * 20


def _byte_level(tmp_path) -> TextCodec:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    return TextCodec(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("kind", ["byte-level", "word-level"])
def test_incremental_text_equals_the_full_decode_after_every_round(tmp_path, kind):
    codec = _byte_level(tmp_path) if kind == "byte-level" else TextCodec(write_word_tokenizer(tmp_path, 50))
    vocab = codec.tok.get_vocab_size()
    rng = random.Random(0)
    sequences = [codec.encode(t) for t in TEXT[:4]] + [[rng.randrange(vocab) for _ in range(80)] for _ in range(4)]
    for ids in sequences:
        inc, upto = IncrementalText(codec), 0
        while upto < len(ids):
            upto = min(len(ids), upto + rng.randint(1, 4))  # a round commits 1..4 tokens
            assert inc.update(ids[:upto]) == codec.decode(ids[:upto]), (kind, ids[:upto])
        if kind == "byte-level" and ids in sequences[:4]:
            assert inc.text in TEXT  # real text comes back exactly
