"""What each training step reads: resumable epoch orders over the sequences (`SeqSampler`), the data
streams of the micro-batches (`data_streams`: one per micro-batch of a step, so world size x grad accum
can change without changing the batches), and the random anchors of the draft blocks in a sequence."""

from __future__ import annotations

import torch

from retrace.errors import RetraceError


class SeqSampler:
    """Epoch permutations from (seed, epoch); the position is (epoch, cursor): resumable exactly."""

    def __init__(self, n: int, seed: int, epoch: int = 0, cursor: int = 0):
        self.n, self.seed, self.epoch, self.cursor = n, seed, epoch, cursor
        self._perm = self._make()

    def _make(self) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.cursor >= self.n:
                self.epoch, self.cursor = self.epoch + 1, 0
                self._perm = self._make()
            out.append(self._perm[self.cursor])
            self.cursor += 1
        return out


def sample_anchors(lengths: list[int], prompt_lens: list[int], nb: int, gen: torch.Generator):
    """Random distinct anchors per sequence in its response ([prompt_len, L-2]); -> (anchor_pos [N,nb],
    block_weight [N,nb]) with padding blocks at position 0 and weight 0."""
    N = len(lengths)
    pos = torch.zeros(N, nb, dtype=torch.long)
    w = torch.zeros(N, nb)
    for i, (L, p0) in enumerate(zip(lengths, prompt_lens, strict=True)):
        m = L - 1 - p0
        if m <= 0:
            continue
        pick = torch.randperm(m, generator=gen)[:nb] + p0
        pick, _ = pick.sort()
        pos[i, : len(pick)] = pick
        w[i, : len(pick)] = 1.0
    return pos, w


def data_streams(usable: list[int], n_train: int, streams: int, where) -> list[list[int]]:
    """The training sequences of each data stream: stream s takes the prompts i with i % streams == s. There
    is one stream per micro-batch of a step (world x grad_accum); rank r owns streams r*A .. r*A+A-1, so two
    processes with grad_accum A see exactly the batches of one process with 2A."""
    if n_train < streams:
        raise RetraceError(f"{where}: {n_train} training prompts cannot be split into {streams} data shards (world "
                           "size x --grad-accum): use more prompts, fewer processes or less accumulation")
    out = [[i for i in usable if i % streams == s] for s in range(streams)]
    empty = [s for s, o in enumerate(out) if not o]
    if empty:
        raise RetraceError(f"{where}: data shard {empty[0]} of {streams} (world size x --grad-accum) has no usable "
                           "training sequence (responses shorter than 2 tokens): use more prompts or fewer shards")
    return out


__all__ = ["SeqSampler", "sample_anchors", "data_streams"]
