"""The round's host-side kernels: `torch.ops.retrace.argmax` (runtime/argmax_op.py) is `max(-1).indices`
exactly (first maximal index on ties, NaN as the maximum, any float dtype, strided inputs, meta tensors) and
reads nothing to the host; `torch.ops.retrace.topk` (runtime/topk_op.py) selects what `torch.topk` does (the
same values, largest first; on ties the same set of values) on rows of every shape sampling meets; `guard_rows`
replaces an unsampleable row on the device and reports it as a device flag, without a read."""

from __future__ import annotations

import pytest
import torch
from test_runtime_device import HostReads

from retrace.runtime.candidates import Candidates
from retrace.runtime.sampling import argmax, guard_rows
from retrace.runtime.topk_op import topk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_argmax_is_max_indices(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 300, generator=g).to(dtype)
    x[0, :, 17] = x[0].amax(-1) + 1  # ties: the first maximal index
    x[0, :, 40] = x[0, :, 17]
    x[1, 2, 9] = x[1, 2, 100] = float("nan")  # NaN counts as the maximum (its first index)
    x[2] = 0.0  # all equal
    for t in (x, x.transpose(0, 1), x[:, ::2]):  # strided views too
        got = argmax(t)
        assert got.dtype == torch.int64 and torch.equal(got, t.max(-1).indices)


def test_argmax_on_meta_and_without_host_reads():
    assert argmax(torch.empty(3, 5, 7, device="meta")).shape == (3, 5)
    seen = HostReads()
    x = torch.randn(8, 16, 2048)
    with seen:
        got = argmax(x)
    assert seen.count == 0 and torch.equal(got, x.max(-1).indices)


def test_guard_rows_flags_on_the_device():
    p = torch.softmax(torch.randn(3, 4, 10), -1)
    p[1, 2, 5] = float("nan")
    seen = HostReads()
    with seen:
        out, bad = guard_rows(Candidates(p))  # the dense form; candidates: tests/test_candidates.py
    assert seen.count == 0
    assert bad.tolist() == [False, True, False]
    assert torch.equal(out.probs[[0, 2]], p[[0, 2]])
    want = torch.zeros(4, 10)
    want[:, 0] = 1
    assert torch.equal(out.probs[1], want)


def _rows(V: int) -> torch.Tensor:
    """Logit rows as sampling sees them: plain, a padded vocabulary (most ids tied far below), a draft vocabulary
    expanded with -inf, every id tied, and duplicates of the largest values."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, V, generator=g) * 3
    x[1, 900:] = -901.0
    x[2, 8192 % V:] = float("-inf")
    x[3] = 0.5
    x[4, :40] = x[4].max() + 1  # 40 entries tied at the top
    return x


@pytest.mark.parametrize("V, k", [(151936, 36), (151936, 20), (151936, 256), (9000, 36), (300, 36), (2048, 2048)])
def test_topk_selects_what_torch_topk_does(V, k):
    x = _rows(V)
    for t in (x, x[:, None].expand(6, 2, V), x[::2]):  # batch dims, expanded and strided views
        vals, idx = topk(t, k)
        want = torch.topk(t, k, dim=-1)
        assert idx.dtype == torch.int64 and idx.shape == want.indices.shape
        assert torch.equal(vals, want.values)  # the same values, largest first, whatever the ties
        assert torch.equal(t.gather(-1, idx), vals)
        assert (idx.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct ids


def test_topk_hands_nan_rows_to_torch_and_reads_nothing():
    x = torch.randn(3, 151936)
    x[1, 7] = float("nan")
    vals, idx = topk(x, 36)
    want = torch.topk(x, 36, dim=-1)
    assert torch.equal(idx[1], want.indices[1]) and torch.isnan(vals[1, 0])  # NaN first, as torch.topk
    assert topk(torch.empty(2, 151936, device="meta"), 36)[1].shape == (2, 36)
    seen = HostReads()
    with seen:
        topk(torch.randn(4, 151936), 36)
    assert seen.count == 0
