"""The round's host-side kernels: `torch.ops.retrace.argmax` (runtime/argmax_op.py) is `max(-1).indices`
exactly (first maximal index on ties, NaN as the maximum, any float dtype, strided inputs, meta tensors) and
reads nothing to the host; `guard_rows` replaces an unsampleable row on the device and reports it as a
device flag, without a read."""

from __future__ import annotations

import pytest
import torch
from test_runtime_device import HostReads

from retrace.runtime.sampling import argmax, guard_rows


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
        out, bad = guard_rows(p)
    assert seen.count == 0
    assert bad.tolist() == [False, True, False]
    assert torch.equal(out[[0, 2]], p[[0, 2]])
    want = torch.zeros(4, 10)
    want[:, 0] = 1
    assert torch.equal(out[1], want)
