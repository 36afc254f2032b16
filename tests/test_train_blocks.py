"""Block-mask training forward == the drafter module run block by block; DFlash loss weights and masking."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import max_diff

from retrace.models.drafter import SuffixInputs
from retrace.train import blocks as bl

pytestmark = pytest.mark.usefixtures("one_thread")


def _taps(target, seq):
    N, S = seq.shape
    pk, pv = target.empty_past(N)
    with torch.no_grad():
        _, taps, _, _ = target(seq, torch.arange(S).expand(N, S), pk, pv, torch.zeros(N, dtype=torch.long))
    return taps


@pytest.mark.parametrize("layers,with_suffix", [(1, False), (2, True)])
def test_block_forward_equals_drafter_block_by_block(tiny_pair, layers, with_suffix):
    pair = tiny_pair(draft_layers=layers, block_size=8, conditioner="random" if with_suffix else None)
    target, drafter = pair.load()
    B = drafter.config.block_size
    g = torch.Generator().manual_seed(0)
    N, S, nb = 2, 37, 4
    seq = torch.randint(0, 120, (N, S), generator=g)
    taps = _taps(target, seq)
    lengths = torch.tensor([S, 25])  # row 1 is right-padded: its anchors stay below 24
    anchors = torch.tensor([[3, 11, 11, 35], [0, 6, 20, 23]])
    ids, labels = bl.block_inputs(seq, anchors, B, drafter.config.mask_token_id, lengths)
    suffix = None
    if with_suffix:
        d, kd = drafter.config.hidden_size, taps.shape[-1]
        suffix = bl.BlockSuffix(torch.randn(N, nb, B, d, generator=g), torch.rand(N, nb, B, 3, generator=g),
                                (torch.rand(N, nb, B, generator=g) > 0.4).float(),
                                torch.randn(N, nb, B, kd, generator=g))
        suffix.valid[..., 0] = 0
    with torch.no_grad():
        h, logits = bl.block_forward(drafter, taps, anchors, ids, suffix)
    assert logits.shape == (N, nb, B - 1, target.config.vocab_size)
    for n in range(N):
        for b in range(nb):
            p = int(anchors[n, b])
            ctx = taps[n : n + 1, :p]
            pos = torch.arange(p).unsqueeze(0)
            si = None
            if suffix is not None:  # correction taps are appended to the call's context (masked: positions >= anchor)
                ctx = torch.cat([ctx, suffix.corr_taps[n : n + 1, b]], 1)
                pos = torch.cat([pos, torch.arange(p + B, p + 2 * B).unsqueeze(0)], 1)
                si = SuffixInputs(suffix.memory[n : n + 1, b], suffix.features[n : n + 1, b],
                                  suffix.valid[n : n + 1, b],
                                  torch.arange(p, p + B).unsqueeze(0))
            pk, pv = drafter.empty_past(1)
            with torch.no_grad():
                h1, l1, _, _ = drafter(ctx, pos, pk, pv, torch.zeros(1, dtype=torch.long), ids[n : n + 1, b],
                                       (p + torch.arange(B)).unsqueeze(0), si)
            assert max_diff(l1[0], logits[n, b]) < 1e-4
            assert max_diff(h1[0], h[n, b]) < 1e-5
    # labels: the sequence's own next tokens, IGNORE past the row's length
    assert labels[0, 0].tolist() == seq[0, 4:11].tolist()
    assert labels[0, 3].tolist() == [seq[0, 36].item()] + [bl.IGNORE] * 6
    assert (labels[1, 3] == bl.IGNORE).sum() == 6  # anchor 23, length 25: only position 24 exists


def test_loss_weights():
    w = bl.loss_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert torch.allclose(w, torch.tensor([math.exp(-(k - 1) / 7) for k in range(1, 16)]))
    assert bl.default_gamma(16) == pytest.approx(7.0)
    assert bool((w[1:] < w[:-1]).all())


def test_block_loss_is_weighted_mean_over_present_slots():
    g = torch.Generator().manual_seed(1)
    N, nb, K, V = 2, 3, 5, 11
    logits = torch.randn(N, nb, K, V, generator=g)
    labels = torch.randint(0, V, (N, nb, K), generator=g)
    labels[0, 1, 3:] = bl.IGNORE
    bw = torch.ones(N, nb)
    bw[1, 2] = 0  # a padding block
    w = bl.loss_weights(K + 1, 2.0)
    loss, st = bl.block_loss(logits, labels, w, bw)
    num = den = 0.0
    for n in range(N):
        for b in range(nb):
            for k in range(K):
                if labels[n, b, k] == bl.IGNORE or bw[n, b] == 0:
                    continue
                ce = -torch.log_softmax(logits[n, b, k], -1)[labels[n, b, k]]
                num += float(w[k] * ce)
                den += float(w[k])
    assert loss.item() == pytest.approx(num / den, rel=1e-5)
    # accepted-length estimate: leading slots whose argmax is the label, full blocks only
    labels2 = logits.argmax(-1).clone()
    labels2[..., 2] = (labels2[..., 2] + 1) % V
    _, st2 = bl.block_loss(logits, labels2, w)
    assert bl.summarize(st2)["tau_est"] == pytest.approx(3.0)
