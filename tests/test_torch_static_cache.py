"""The torch backend's static caches (models/cached_step.py): K/V written in place, attention over a window.

- A call writes the new K/V into the preallocated cache itself (the same storage before and after, the
  values the model's own forward computes at those positions) and concatenates nothing of cache width.
- The attention window is a power-of-two bucket of max_seq_len: a whole generate sees a handful of widths
  (the step's shapes do not follow the past length).
- Against the dense-past path (runtime/torch_concat.py, what the backend did before): the same logits
  (relative 1e-5) and argmax for chains, trees and slot sets that are not one range (the gathered-window
  path), and the same drafter outputs. (Token-exact against transformers' greedy decode in every mode,
  requests joining and leaving: tests/test_runtime_greedy.py, test_runtime_tree.py, which run this path.)
- The RoPE table is the per-call computation, bit for bit; training rollouts keep the dense-past numerics.
"""

from __future__ import annotations

import pytest
import torch
from runtime_fixtures import call_both, write_pair
from torch.overrides import TorchFunctionMode

from retrace.models.cached_step import RopeTable
from retrace.models.drafter import load_pair
from retrace.models.layers import rope_cos_sin
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.device import index_tensor
from retrace.runtime.torch_backend import MIN_WIDTH, TorchBackend, window_width
from retrace.runtime.torch_concat import ConcatTorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, SEQ = 128, 160


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_thread):
    return write_pair(tmp_path_factory.mktemp("static"), vocab=VOCAB, block_size=8, conditioner="random", seed=5)


def _backends(pair, max_batch=4):
    t, d = load_pair(*pair)
    return (ConcatTorchBackend(t, d, max_batch=max_batch, max_seq_len=SEQ),
            TorchBackend(t, d, max_batch=max_batch, max_seq_len=SEQ))


class _Cats(TorchFunctionMode):
    """Records the shapes of every torch.cat's inputs."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.cat:
            self.shapes += [tuple(t.shape) for t in args[0]]
        return func(*args, **(kwargs or {}))


def test_kv_written_in_place_into_the_cache_and_nothing_of_cache_width_concatenated(pair):
    ref, new = _backends(pair)
    storage = [k.data_ptr() for k in new.tcache.k]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    slots, pos = index_tensor([1, 2], torch.device("cpu")), index_tensor([list(range(9))] * 2, torch.device("cpu"))
    call_both(ref, new, slots, ids, pos, torch.tensor([[8], [8]]))
    step = index_tensor([[9 + j for j in range(3)]] * 2, torch.device("cpu"))
    with _Cats() as cats:
        new.target(slots, ids[:, :3], step, torch.arange(3).expand(2, 3))
    ref.target(slots, ids[:, :3], step, torch.arange(3).expand(2, 3))
    assert [k.data_ptr() for k in new.tcache.k] == storage  # the preallocated cache itself was written
    assert not [s for s in cats.shapes if len(s) == 4 and s[2] >= 9], cats.shapes  # the past (9) is never concatenated
    for a, b in zip(ref.tcache.k + ref.tcache.v, new.tcache.k + new.tcache.v, strict=True):
        assert torch.allclose(a[1:3, :, :12], b[1:3, :, :12], atol=1e-5)  # the K/V the model's forward computes
        assert not b[0].any() and not b[3].any()  # other slots untouched


def test_window_widths_are_a_few_buckets():
    assert [window_width(n, 2048) for n in (1, 64, 65, 129, 1000, 1025, 2048)] == [64, 64, 128, 256, 1024, 2048, 2048]
    assert window_width(100, 96) == 96 and MIN_WIDTH == 64
    # the dynamic-shape steps (eager, torch.compile): multiples of the step, so a past of 1500 reads 1536 columns
    assert [window_width(n, 2048, 64) for n in (1, 64, 65, 129, 1000, 1500, 2048)] == [64, 64, 128, 192, 1024,
                                                                                        1536, 2048]


def test_a_generate_attends_over_a_handful_of_window_widths(pair):
    t, d = load_pair(*pair)
    be = TorchBackend(t, d, max_batch=2, max_seq_len=512)
    seen = []
    real = be.tcache.window
    be.tcache.window = lambda slots, width: (seen.append(width), real(slots, width))[1]
    rt = Runtime(be, None, verify_policy="fixed")
    rt.generate([list(range(1, 50)), [3, 4]], SamplingParams(max_new_tokens=120, ignore_eos=True), "dflash")
    assert set(seen) <= {64, 128, 192} and len(seen) > 20  # 40+ calls, past lengths 2..170: three shapes


def test_same_outputs_as_the_dense_past_path_chains_trees_and_scattered_slots(pair):
    ref, new = _backends(pair)
    g = torch.Generator().manual_seed(1)
    cpu = torch.device("cpu")
    # prefill slots 0 and 3 (not one range: the gathered window and its write-back)
    slots = index_tensor([0, 3], cpu)
    ids = torch.randint(0, VOCAB, (2, 11), generator=g)
    call_both(ref, new, slots, ids, index_tensor([list(range(11))] * 2, cpu), torch.tensor([[10], [6]]))
    # a ragged chain verify: row 0 at 11, row 1 at 7 (its prompt was shorter)
    call_both(ref, new, slots, ids[:, :5], index_tensor([list(range(11, 16)), list(range(7, 12))], cpu),
              torch.arange(5).expand(2, 5))
    # a tree verify: root, two children, a grandchild of the first
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool).expand(2, 4, 4)
    depth = torch.tensor([0, 1, 1, 2])
    pos = index_tensor([[16 + x for x in depth.tolist()], [12 + x for x in depth.tolist()]], cpu)
    call_both(ref, new, slots, ids[:, :4], pos, torch.arange(4).expand(2, 4), tree.contiguous())
    for be in (ref, new):
        be.commit_path(slots, torch.tensor([[16, 17], [12, 14]]), torch.tensor([[16, 17], [12, 13]]))
    call_both(ref, new, slots, ids[:, :2], index_tensor([[18, 19], [14, 15]], cpu), torch.arange(2).expand(2, 2))
    # the drafter: context of two calls, then a block past its anchor
    kd = ref.drafter_config.num_taps * ref.target_config.hidden_size
    for ctx_start, C, anchor in ((0, 9, 9), (9, 4, 12)):
        taps = torch.randn(2, C, kd, generator=g)
        cpos = index_tensor([list(range(ctx_start, ctx_start + C))] * 2, cpu)
        block = torch.full((2, 8), ref.drafter_config.mask_token_id)
        bpos = index_tensor([list(range(anchor, anchor + 8))] * 2, cpu)
        a, b = ref.draft(slots, taps, cpos, block, bpos, None), new.draft(slots, taps, cpos, block, bpos, None)
        assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-4)
        assert torch.equal(a[1].argmax(-1), b[1].argmax(-1))


def test_rope_table_is_the_per_call_rope_bit_for_bit():
    pos = torch.tensor([[0, 5, 17, 99], [3, 3, 64, 1]])
    for dtype in (torch.float32, torch.bfloat16):
        table = RopeTable(100, 16, 1e6, dtype)
        want = rope_cos_sin(pos, 16, 1e6, dtype)
        assert all(torch.equal(a, b) for a, b in zip(table.at(pos), want, strict=True))


def test_training_rollouts_keep_the_dense_past_numerics(pair):
    from retrace.train.rollout import make_backend

    t, d = load_pair(*pair)
    assert type(make_backend(t, d, 2, 64)) is ConcatTorchBackend
    assert type(make_backend(t, d, 2, 64, static_cache=True)) is TorchBackend
