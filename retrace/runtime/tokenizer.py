"""Text <-> ids with the `tokenizers` library (tokenizer.json of the target or bundle)."""

from __future__ import annotations

from pathlib import Path

from retrace.errors import RetraceError


class TextCodec:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer

        self.path = Path(path)
        try:
            self.tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception subclasses
            raise RetraceError(f"{self.path}: cannot load tokenizer ({e})") from None

    @classmethod
    def find(cls, *dirs: str | Path | None) -> TextCodec | None:
        for d in dirs:
            if d is not None and (Path(d) / "tokenizer.json").is_file():
                return cls(Path(d) / "tokenizer.json")
        return None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
