"""Chunked prefill: a long prompt enters the cache over several steps, at most `prefill_chunk` prompt tokens a
step over all the prompts not yet in it, so the requests already running go on with their rounds between its
chunks instead of waiting for the whole prompt (vLLM's and TensorRT-LLM's chunked prefill; `--prefill-chunk N`,
RuntimeOptions.prefill_chunk). None or 0: each prompt whole in the step that admits it (the default of
`generate`, `bench` and the Python API); "auto" (`retrace serve`'s default): AUTO_CHUNK by device, 256 tokens on
a CPU and 2048 on CUDA, where a prefill stays memory-bound for longer and each chunk streams the weights once
more (vLLM's long-standing default budget; not measured here). The chunks are calls of their own, not fused with
the rounds' decode rows as vLLM fuses them, so small chunks cost throughput: at the 0.6B shape, int4, 16 requests
through 4 slots, 128 tokens a step lost 5-9% of the tokens per second and 256 nothing measurable, while a running
request's longest stall behind a 400-token prompt went from 1.3 s to 0.46 s (128) and 0.77 s (256)
(docs/serving.md).

Every cache is indexed by absolute position, so a chunk is a target call at positions [start, stop) on top of
the chunks before it, like a verify. The drafter's context gets each chunk's taps in turn
(proposers/context.py `continue_context`), and only the call that completes a prompt samples its first token:
on ONNX Runtime's row-invariant calls the chunked prompt's K/V and first token are bit for bit the whole
prompt's, and a seeded request draws the same numbers. A chunk costs one more pass over the weights: on a CPU,
where a prefill row costs a few ms, nothing at chunks of a hundred tokens or more.
"""

from __future__ import annotations

import torch

AUTO_CHUNK = {"cpu": 256, "cuda": 2048}  # prompt tokens a step for prefill_chunk="auto", by device type


def budget_for(chunk: int | str | None, device: torch.device) -> int | None:
    """RuntimeOptions.prefill_chunk on `device` -> the step's prompt-token budget (None: whole prompts)."""
    if chunk == "auto":
        return AUTO_CHUNK.get(device.type, AUTO_CHUNK["cpu"])
    return chunk or None


def next_chunks(pending: list, budget: int | None) -> list[tuple[object, int, int]]:
    """pending: requests whose prompt is not all in the cache yet, in admission order (`prefilled` tokens of
    `prompt_ids` are) -> (request, start, stop) for this step's prefill: each prompt's whole rest without a
    budget, else at most `budget` tokens over all of them, first admitted first."""
    out = []
    left = budget
    for r in pending:
        n = len(r.prompt_ids) - r.prefilled
        if left is not None:
            if left <= 0:
                break
            n = min(n, left)
            left -= n
        out.append((r, r.prefilled, r.prefilled + n))
    return out
