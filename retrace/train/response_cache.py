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
from retrace.train import rollout

TAG = "train dflash"


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


def target_responses(target, target_dir: Path, tap_layers, prompts: list[list[int]], indices: list[int],
                     with_taps: bool, cfg, device: torch.device, d: dist.Dist, progress: bool):
    """The target's responses to prompts[i] for i in `indices` (cfg: a DFlashConfig), and their taps when
    with_taps: greedy (or at cfg.gen_temperature), a seeded cfg.gen_sample_frac of them sampled at T=1; on
    CPU in cfg.gen_workers processes. -> (responses, taps or None), aligned with `indices`."""
    cm.log(progress, TAG, f"generating {len(prompts)} responses x {cfg.max_new_tokens} tokens with the target"
                          + (f" ({cfg.gen_workers} processes)" if cfg.gen_workers > 1 and device.type == "cpu" else "")
                          + (f" ({d.world} ranks)" if d.active else "")
                          + (f", {cfg.gen_sample_frac:.0%} sampled at T=1" if cfg.gen_sample_frac else ""))
    g = torch.Generator().manual_seed(cfg.seed + 99)
    sampled = (torch.rand(len(prompts), generator=g) < cfg.gen_sample_frac).tolist()
    outs, taps = {}, {}
    for flag, temp in ((False, cfg.gen_temperature), (True, 1.0)):
        ix = [i for i in indices if sampled[i] == flag]
        if not ix:
            continue
        seed = cfg.seed + (50_000 if flag else 0) + 1_000_003 * d.rank
        o, t = _generate(target, target_dir, tap_layers, [prompts[i] for i in ix], temp, seed, with_taps, cfg, device,
                         progress)
        for j, i in enumerate(ix):
            outs[i] = o[j]
            if t is not None:
                taps[i] = t[j]
    return [outs[i] for i in indices], ([taps[i] for i in indices] if with_taps else None)


def _generate(target, target_dir, tap_layers, prompts, temperature, seed, with_taps, cfg, device, progress):
    if cfg.gen_workers > 1 and device.type == "cpu" and len(prompts) > 1:
        parts = cm.parallel_map(rollout.generate_shard, [
            (str(target_dir), tuple(tap_layers), prompts[r.start : r.stop], cfg.max_new_tokens,
             cfg.gen_batch, temperature, seed + r.start, with_taps)
            for r in cm.shards(len(prompts), cfg.gen_workers)], cfg.gen_workers)
        if with_taps:
            return [o for p in parts for o in p[0]], [t for p in parts for t in p[1]]
        return [o for p in parts for o in p], None
    bar = _token_bar(progress, len(prompts) * cfg.max_new_tokens, "responses")
    res = rollout.generate(target, prompts, cfg.max_new_tokens, cfg.gen_batch, temperature, seed, device,
                           progress=(lambda n: bar.update(n)) if bar else None, return_taps=with_taps)
    if bar:
        bar.close()
    return res if with_taps else (res, None)


def _token_bar(progress: bool, total: int, desc: str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", dynamic_ncols=True, leave=False, mininterval=1.0)


__all__ = ["cached_responses", "load_taps_cache", "save_taps_cache", "target_responses"]
