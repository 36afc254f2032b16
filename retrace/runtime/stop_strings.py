"""A request's committed tokens and text: EOS and max_new_tokens, then the incremental text
(runtime/detokenize.py) and stop strings.

A round commits several tokens at once; the result must be what one token per round would give. So the
tokens after EOS or the length limit are dropped, and a stop string ends the output right after the token
that completes it (the accepted block's tokens after it are never emitted; the text ends before the stop
string). What is streamed holds back an incomplete UTF-8 tail and anything that might still become a stop
string.
"""

from __future__ import annotations

from retrace.runtime.detokenize import IncrementalText


def append(r, tokens: list[int], eos_ids: set[int], codec) -> str:
    """Append `tokens` to request r's output up to its stops (sets r.finish_reason "stop" / "length"); keep
    r.text current (codec None: no text) -> the new text to stream."""
    p = r.params
    n0 = len(r.output_ids)
    for t in tokens:
        r.output_ids.append(t)
        if t in eos_ids and not p.ignore_eos:
            r.finish_reason = "stop"
            break
        if len(r.output_ids) >= p.max_new_tokens:
            r.finish_reason = "length"
            break
    if codec is None:
        return ""
    r.detok = r.detok or IncrementalText(codec)
    # a stop string not in the earlier (final) text can only end in the new text: search from there
    start = max(0, len(r.detok.stable) - max((len(s) for s in p.stop), default=0))
    r.text = r.detok.update(r.output_ids)
    if p.stop and find_stop(r.text, p.stop, start) >= 0:
        # Stop right after the token that completes the stop string, as one token per round
        # would: the tokens of the accepted block after it are dropped, never emitted.
        for n in range(n0 + 1, len(r.output_ids) + 1):
            text = codec.decode(r.output_ids[:n])
            cut = find_stop(text, p.stop)
            if cut >= 0:
                break
        del r.output_ids[n:]
        r.text = text[:cut]
        r.finish_reason = "stop"
    # hold back an incomplete UTF-8 tail and anything that might still become a stop string
    hold = 0 if r.finish_reason else max([len(s) - 1 for s in p.stop] + [0])
    visible = r.text[: len(r.text) - hold] if hold else r.text
    if not r.finish_reason and visible.endswith("\ufffd"):
        visible = visible.rstrip("\ufffd")
    if len(visible) <= r.emitted_text:
        return ""
    delta = visible[r.emitted_text:]
    r.emitted_text = len(visible)
    return delta


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int:
    """Index of the earliest stop string in text[start:] (an index into text), -1 if none."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
