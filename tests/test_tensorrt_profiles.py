"""The TensorRT optimisation profiles cover every call the loop makes: a long generate with the adaptive
verify policy (which sits the drafter out for 8, 16, 32 ... rounds) and prompt lookup, with more requests
than slots (a request admitted into a running batch drafts its whole prompt next to rows with a past),
recorded through a backend wrapper as the shapes the TensorRT backend binds (tensorrt_backend.bound_past),
each of which must fit a profile of the table `retrace.export.tensorrt` builds."""

from __future__ import annotations

import pytest
import torch
from runtime_fixtures import LinearCost, write_pair

from retrace.export import tensorrt as te
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime import tensorrt_backend as tb
from retrace.runtime.backend import contiguous_range
from retrace.runtime.prompt_lookup import PromptLookup
from retrace.runtime.torch_backend import TorchBackend
from retrace.runtime.verify_policy import AdaptivePolicy

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK, MAX_SEQ, MAX_BATCH, MAX_PROMPT = 8, 256, 2, 32


class RecordingBackend:
    """Passes every call to `inner` and records the input shapes a TensorRT engine would be bound with."""

    def __init__(self, inner):
        self.inner = inner
        for attr in ("name", "target_config", "drafter_config", "max_batch", "max_seq_len", "has_conditioner"):
            setattr(self, attr, getattr(inner, attr))
        self.calls: list[tuple[str, dict]] = []

    def _past(self, graph: str, slots: torch.Tensor, past_len: torch.Tensor) -> tuple[int, ...]:
        c = (self.target_config if graph == "target" else self.drafter_config).layers
        p = tb.bound_past(int(past_len.max()), self.max_seq_len, contiguous_range(slots) is not None)
        return slots.numel(), c.num_key_value_heads, p, c.head_dim

    def target(self, slots, input_ids, positions, logits_index, tree_mask=None):
        n, t = input_ids.shape
        self.calls.append(("target", {"input_ids": (n, t), "position_ids": (n, t), "past_len": (n,),
                                      "logits_index": tuple(logits_index.shape),
                                      "past_key_0": self._past("target", slots, positions[:, 0])}))
        return self.inner.target(slots, input_ids, positions, logits_index, tree_mask)

    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        n, c = ctx_positions.shape
        self.calls.append(("drafter", {"ctx_taps": tuple(ctx_taps.shape), "ctx_positions": (n, c),
                                       "block_ids": tuple(block_ids.shape), "past_len": (n,),
                                       "past_key_0": self._past("drafter", slots, ctx_positions[:, 0])}))
        return self.inner.draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)

    def commit_path(self, slots, src_index, dst_pos):
        self.inner.commit_path(slots, src_index, dst_pos)

    def release(self, slot):
        self.inner.release(slot)


def test_every_call_of_a_long_generate_fits_a_profile(tmp_path):
    target, drafter = write_pair(tmp_path, vocab=64, layers=2, block_size=BLOCK, seed=5)
    be = RecordingBackend(TorchBackend.from_dirs(target, drafter, max_batch=MAX_BATCH, max_seq_len=MAX_SEQ))
    never_drafts = AdaptivePolicy(BLOCK, LinearCost(0.1, 50.0), learn_cost=False)  # off 8, 16, 32... rounds
    rt = Runtime(be, verify_policy=never_drafts, prompt_lookup=PromptLookup(max_rows=MAX_BATCH))
    g = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(0, 60, (n,), generator=g).tolist() * 3)[:MAX_PROMPT] for n in (4, 9, 7)]
    res = rt.generate(prompts, SamplingParams(max_new_tokens=96), "retrace")
    assert all(len(r.token_ids) == 96 for r in res)

    t, d = be.target_config.layers, be.drafter_config.layers
    kd = be.calls[[k for k, _ in be.calls].index("drafter")][1]["ctx_taps"][2]
    dims = {"target": {"layers": 1, "Hkv": t.num_key_value_heads, "hd": t.head_dim},
            "drafter": {"layers": 1, "Hkv": d.num_key_value_heads, "hd": d.head_dim, "kd": kd,
                        "d": d.hidden_size, "F": 3}}
    table = te.optimisation_profiles(MAX_BATCH, MAX_SEQ, BLOCK, MAX_PROMPT, dims=dims)
    profiles = {graph: [table[graph][p] for p in te.PROFILES] for graph in te.GRAPHS}
    drafts = [s for graph, s in be.calls if graph == "drafter"]
    # the calls the old table refused happen: a context longer than the block with a past
    assert max(s["ctx_positions"][1] for s in drafts if s["past_key_0"][2] > 0) > BLOCK
    assert len(drafts) < len(be.calls) // 4  # the drafter did sit out most rounds
    for graph, shapes in be.calls:
        tb.pick_profile(profiles[graph], shapes)  # raises RetraceError when no profile fits
