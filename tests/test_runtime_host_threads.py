"""The loop's own torch ops run on the backend's `loop_threads` (runtime/host_threads.py): on the ONNX Runtime
backend one thread inside every scheduler step, switched once before a run's first step and back once after
its last, the same tokens and the same acceptance as with torch's threads left alone; a backend without the
attribute (torch) is untouched."""

from __future__ import annotations

import pytest
import torch
from export_fixtures import MAX_BATCH, VOCAB, pair_and_bundle
from runtime_fixtures import write_pair

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6], [11, 3]]


class ThreadsSeen:
    """Wraps a backend's forwards and records torch's thread count at each call (inside the step)."""

    def __init__(self, backend):
        self.seen: list[int] = []
        for name in ("target", "draft"):
            setattr(backend, name, self._wrap(getattr(backend, name)))

    def _wrap(self, fn):
        def call(*args, **kwargs):
            self.seen.append(torch.get_num_threads())
            return fn(*args, **kwargs)
        return call


@pytest.fixture
def two_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


def _run(be, mode):
    res = Runtime(be, None, verify_policy="fixed").generate(PROMPTS, SamplingParams(max_new_tokens=24), mode)
    return [r.token_ids for r in res], [(r.stats["accepted_hist"], r.stats["verify_hist"]) for r in res]


@pytest.mark.parametrize("mode", ["dflash", "retrace"])
def test_ort_steps_run_torch_on_one_thread_with_the_same_rounds(two_threads, mode, monkeypatch):
    built = pair_and_bundle()
    be = OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=MAX_BATCH)
    assert be.loop_threads == 1
    torch.set_num_threads(2)  # the backend's load may set its own threads; the caller's setting is 2
    seen = ThreadsSeen(be)
    switches = []
    set_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (switches.append(n), set_threads(n))[1])
    tokens, stats = _run(be, mode)
    assert seen.seen and set(seen.seen) == {1}  # every forward (and the ops around it) inside a step
    assert len(seen.seen) > 10 and switches == [1, 2]  # once before the first step, once after the last
    assert torch.get_num_threads() == 2
    be.loop_threads = None  # torch's threads left alone: the same tokens, the same rounds
    seen.seen.clear()
    tokens2, stats2 = _run(be, mode)
    assert set(seen.seen) == {2}
    assert tokens == tokens2 and stats == stats2
    assert all(0 <= t < VOCAB for row in tokens for t in row)


def test_torch_backend_keeps_torchs_threads(two_threads, tmp_path):
    rt = Runtime.from_dirs(*write_pair(tmp_path, vocab=64, block_size=4, seed=1), max_batch=2, max_seq_len=64,
                           verify_policy="fixed")
    torch.set_num_threads(2)
    seen = ThreadsSeen(rt.backend)
    rt.generate(PROMPTS[:2], SamplingParams(max_new_tokens=6), "dflash")
    assert set(seen.seen) == {2}
