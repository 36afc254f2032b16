"""The ONNX Runtime backend's K/V caches take memory as positions fill (zeros_on_touch), not at load."""

from __future__ import annotations

import sys

import pytest
import torch

from retrace.runtime.onnxruntime_backend import zeros_on_touch


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cache_sized_for_max_seq_len_costs_only_the_positions_written():
    before = _rss_bytes()
    kv = zeros_on_touch((8, 4, 8, 2048, 128), torch.float32)  # 256 MiB: 2L=8, 4 slots, 8 heads, 2048 positions
    assert kv.shape == (8, 4, 8, 2048, 128) and kv.dtype == torch.float32
    assert _rss_bytes() - before < 32 * 2**20  # torch.zeros would have written all 256 MiB
    kv[:, 1, :, :16] = 1.0  # a request's first 16 positions in slot 1
    assert _rss_bytes() - before < 48 * 2**20
    assert float(kv[:, 1, :, :16].sum()) == 8 * 8 * 16 * 128
    assert float(kv[:, 1, :, 16:32].abs().sum()) == 0.0 and float(kv[:, 0].abs().sum()) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zeros_of_every_cache_dtype_and_an_empty_one(dtype):
    t = zeros_on_touch((2, 3, 5), dtype)
    assert t.dtype == dtype and t.shape == (2, 3, 5) and t.is_contiguous() and not t.any()
    t[1, 2, 4] = 7
    assert float(t.sum()) == 7
    assert zeros_on_touch((0, 4), dtype).shape == (0, 4)
