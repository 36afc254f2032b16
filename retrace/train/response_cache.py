"""The target's responses to a run's prompts, and their taps, kept beside the run (`OUT/train_data/`) and
keyed by what produced them: generating them is the expensive part of `train dflash`, and a resumed or
repeated run reuses them. Under torchrun each rank keeps the taps of its own sequences."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from retrace.models.checkpoint import atomic_write_text
from retrace.train import common as cm
from retrace.train import distributed as dist


def cached_responses(cache_dir: Path, key: dict, make, with_taps: bool, n: int, mine: list[int],
                     d: dist.Dist = dist.Dist()):
    """Responses (and their target taps) are expensive: keep them beside the run, keyed by what produced
    them. `responses.json` holds all n responses (written by the main rank); the taps of this rank's
    sequences `mine` are in its own shard (`taps.safetensors` for one process, `taps-rank{r}-of-{w}` under
    torchrun). make(indices, with_taps) -> (responses, taps or None) for those indices: each rank generates
    only its share, then the responses are gathered. Returns (all responses, {index: taps} or None)."""
    k = cm.key_sha(key)
    rj = cache_dir / "responses.json"

    def read():
        try:
            obj = json.loads(rj.read_text())
            return obj["responses"] if obj.get("key") == k and len(obj["responses"]) == n else None
        except (OSError, ValueError, KeyError, TypeError):
            return None

    res = d.main_first(read)
    if res is not None:
        return res, (load_taps_cache(cache_dir, key, mine, d) if with_taps else None)  # None: recomputed
    got, taps = make(mine, with_taps)
    res = [None] * n
    for part in d.all_gather(list(zip(mine, got, strict=True))):
        for i, r in part:
            res[i] = r
    cache_dir.mkdir(parents=True, exist_ok=True)
    taps_by = dict(zip(mine, taps, strict=True)) if taps is not None else None
    if taps_by is not None:
        save_taps_cache(cache_dir, key, taps_by, d)
    if d.is_main:
        atomic_write_text(rj, json.dumps({"key": k, "responses": res}))
    d.barrier()
    return res, taps_by


def _taps_file(cache_dir: Path, d: dist.Dist) -> Path:
    return cache_dir / ("taps.safetensors" if not d.active else f"taps-rank{d.rank}-of-{d.world}.safetensors")


def _taps_key(key: dict, indices: list[int]) -> list[int]:
    return list(bytes.fromhex(cm.key_sha({"key": cm.key_sha(key), "indices": cm.key_sha(sorted(indices))})))


def load_taps_cache(cache_dir: Path, key: dict, mine: list[int], d: dist.Dist) -> dict | None:
    """This rank's cached taps {index: [L, k*d]} when its shard file matches (key and indices), else None."""
    from safetensors.torch import load_file

    tf = _taps_file(cache_dir, d)
    try:
        t = load_file(str(tf)) if tf.is_file() else None
    except (OSError, RuntimeError, ValueError):
        t = None
    if t is None or t["key"].tolist() != _taps_key(key, mine):
        return None
    return dict(zip(t["indices"].tolist(), torch.split(t["taps"], t["lengths"].tolist()), strict=True))


def save_taps_cache(cache_dir: Path, key: dict, taps: dict[int, torch.Tensor], d: dist.Dist = dist.Dist()) -> None:
    """Write this rank's taps shard (safetensors, fp16), atomically."""
    from safetensors.torch import save_file

    cache_dir.mkdir(parents=True, exist_ok=True)
    tf = _taps_file(cache_dir, d)
    tmp = tf.with_suffix(".tmp")
    ix = sorted(taps)
    save_file({"taps": torch.cat([taps[i].to(torch.float16) for i in ix]),
               "lengths": torch.tensor([taps[i].shape[0] for i in ix], dtype=torch.long),
               "indices": torch.tensor(ix, dtype=torch.long),
               "key": torch.tensor(_taps_key(key, ix), dtype=torch.uint8)}, str(tmp))
    tmp.replace(tf)


__all__ = ["cached_responses", "load_taps_cache", "save_taps_cache"]
