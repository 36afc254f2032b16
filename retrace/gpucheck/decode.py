"""Greedy decoding of a batch of prompts through the Runtime with one mode, on any device and dtype."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from retrace.models.drafter import load_pair
from retrace.runtime.api import Runtime
from retrace.runtime.sampling import SamplingParams
from retrace.runtime.tokenizer import TextCodec
from retrace.train import common as cm
from retrace.train.rollout import make_backend


def held_out_prompts(zoo: Path, n: int) -> list[list[int]]:
    """The first `n` held-out code prompts of a zoo, as token ids."""
    rows = cm.read_prompts_jsonl(zoo / "prompts" / "code.jsonl")[:n]
    return cm.encode_prompts(rows, TextCodec.find(zoo / "target"))


def load(zoo: Path, dtype: torch.dtype, device: torch.device):
    return load_pair(zoo / "target", zoo / "drafter", dtype=dtype, device=device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy(target, drafter, prompts: list[list[int]], mode: str, batch: int, max_new_tokens: int,
           device: torch.device) -> dict:
    """-> token_ids per prompt, tau (pooled over the run), tokens/s (wall, after one warm-up request)."""
    B = drafter.config.block_size
    max_len = max(len(p) for p in prompts) + max_new_tokens + B + 2
    rt = Runtime(make_backend(target, drafter, batch, max_len, device, static_cache=True), prompt_lookup=False)
    return timed(rt, prompts, mode, max_new_tokens, device)  # the drafter's tau: no prompt lookup rounds


def timed(rt: Runtime, prompts: list[list[int]], mode: str, max_new_tokens: int, device: torch.device) -> dict:
    """greedy() on a ready Runtime (any backend): the same warm-up, timing and result fields."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    rt.generate(prompts[:1], SamplingParams(max_new_tokens=4), mode)  # warm-up (kernels, allocator)
    rt.reset_stats()
    sync(device)
    t = time.perf_counter()
    res = rt.generate(prompts, params, mode)
    sync(device)
    wall = time.perf_counter() - t
    st = rt.run_stats()
    tokens = sum(len(r.token_ids) for r in res)
    return {"token_ids": [r.token_ids for r in res], "tau": st.get("tau"), "tokens": tokens,
            "tokens_per_s": round(tokens / wall, 1) if wall else None, "wall_s": round(wall, 3)}
