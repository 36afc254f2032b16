"""Byte-level BPE tokenizer for the tiny model zoo, trained offline with the ``tokenizers`` library.

Special tokens come first, in this order, so their ids are fixed whatever the vocabulary size:

====  ==================  ==============================================================
id    token               use
====  ==================  ==============================================================
0     ``<|endoftext|>``   EOS (and BOS, as in Qwen3 base models); document separator
1     ``<|pad|>``         padding; never seen in training
2     ``<|mask|>``        DFlash mask token: an existing embedding row that is never trained
====  ==================  ==============================================================

The tokenizer is byte-level without a prefix space and without normalisation, so
``decode(encode(text)) == text`` for any text (checked by :func:`roundtrip_ok`).  It is saved as a
transformers fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) that
``AutoTokenizer.from_pretrained`` and ``PreTrainedTokenizerFast.from_pretrained`` load with eos, pad and
mask set.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)
EOS_ID, PAD_ID, MASK_ID = 0, 1, 2

# The zoo target is a base LM of plain text, so its chat template is minimal: a user (or system) turn is its
# text, an assistant turn its text and EOS, and the generation prompt is empty. A conversation of one user
# message renders to exactly that message: the zoo trains through `--chat` on the same tokens as before.
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{ m['content'] }}" + EOS_TOKEN + "{%- else -%}{{ m['content'] }}{%- endif -%}"
    "{%- endfor -%}"
)


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2, show_progress: bool = False):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab_size`` entries (if the text allows).

    Deterministic for a given text sequence and vocab size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE")
    tok = Tokenizer(models.BPE())  # no unk token: every byte has a token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    return tok


def to_hf(tok):
    """Wrap a ``tokenizers.Tokenizer`` as a ``transformers.PreTrainedTokenizerFast`` with the zoo's specials."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
        padding_side="right",
        chat_template=CHAT_TEMPLATE,
    )


def save_tokenizer(tok, out_dir: str | Path, model_max_length: int | None = None) -> list[str]:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (+ whatever else transformers writes)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = to_hf(tok)
    if model_max_length is not None:
        hf.model_max_length = int(model_max_length)
    files = hf.save_pretrained(str(out_dir))
    # transformers 5 writes its own class name ("TokenizersBackend"), which transformers 4.x cannot resolve;
    # "PreTrainedTokenizerFast" loads in both.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return sorted({Path(f).name for f in files} | {"tokenizer_config.json"})


def ensure_chat_template(tok_dir: str | Path) -> bool:
    """Add the zoo's chat template to a saved tokenizer that predates it; True when the file changed."""
    cfg_path = Path(tok_dir) / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("chat_template") or (Path(tok_dir) / "chat_template.jinja").is_file():
        return False
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return True


def load_tokenizer(path: str | Path):
    """Load a saved zoo tokenizer as a ``PreTrainedTokenizerFast`` (the directory or its tokenizer.json)."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if path.is_dir():
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from tokenizers import Tokenizer

    return to_hf(Tokenizer.from_file(str(path)))


def encode_batch(tok, texts: Sequence[str]) -> list[list[int]]:
    """Token ids for each text (no specials added), for a ``tokenizers.Tokenizer`` or a HF fast tokenizer."""
    raw = getattr(tok, "backend_tokenizer", tok)
    return [e.ids for e in raw.encode_batch(list(texts), add_special_tokens=False)]


def roundtrip_ok(tok, texts: Iterable[str]) -> tuple[bool, str | None]:
    """Check ``decode(encode(t)) == t`` for every text; returns (ok, first failing text prefix)."""
    raw = getattr(tok, "backend_tokenizer", tok)
    for t in texts:
        ids = raw.encode(t, add_special_tokens=False).ids
        if raw.decode(ids, skip_special_tokens=False) != t:
            return False, t[:80]
    return True, None
