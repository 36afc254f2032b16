"""Incremental detokenization: a request's text kept up to date as tokens are committed, decoding only a
short window each round instead of the whole output (the prefix/read-offset scheme of vLLM and TGI).

The window starts one stable step back (`prefix`), so decoders that treat the first token specially
(a stripped leading space, byte-level merges across tokens) see the same context in both decodes and the
difference is exactly the new text. While the window's text ends in U+FFFD (an incomplete UTF-8
sequence) it stays pending: `text` then ends in that pending tail, as a full decode would.
"""

from __future__ import annotations

from retrace.runtime.tokenizer import TextCodec


class IncrementalText:
    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.stable = ""  # text of ids[:read], final
        self.prefix = 0  # ids[prefix:read]: the context the next window starts with
        self.read = 0
        self.text = ""  # stable + the pending tail == codec.decode(ids)

    def update(self, ids: list[int]) -> str:
        """ids: every token so far (the last call's plus the new ones) -> the text of all of them."""
        before = self.codec.decode(ids[self.prefix:self.read])
        window = self.codec.decode(ids[self.prefix:])
        tail = window[len(before):] if window.startswith(before) else None
        if tail is None:  # a decoder that rewrote its context: fall back to the whole output (never seen)
            self.stable, self.prefix, self.read = self.codec.decode(ids), len(ids), len(ids)
            self.text = self.stable
        elif tail and not tail.endswith("\ufffd"):
            self.stable += tail
            self.prefix, self.read = self.read, len(ids)
            self.text = self.stable
        else:
            self.text = self.stable + tail
        return self.text
