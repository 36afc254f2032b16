"""The draft call's cost against one target decode step, full head vs draft vocabularies of several sizes,
on one ONNX Runtime bundle (OnnxRuntimeBackend.use_draft_vocab swaps the subset), with each subset's
coverage of held-out responses.

    python benchmarks/draft_vocab_cost.py --engine B --small-target Z/target \
        --train-prompts Z/data/train_prompts.jsonl \
        --heldout Z/prompts --sizes 4096,8192,16384,32768 --json out.json

B: a bundle built from a drafter directory that has a draft vocabulary (any size: the script swaps it);
Z: the zoo the bundle's pair was inflated from (inflation preserves the function, so the small target's
greedy responses are the inflated one's, at a fraction of the cost). The subsets come from the greedy
responses to the training prompts; coverage is measured on the greedy responses to the held-out prompts.
Timing: batch 1, one target decode step at context --context against one draft call (block of the
bundle's block size, --ctx new context tokens), medians of --reps interleaved repetitions.

    python benchmarks/draft_vocab_cost.py --heads-only --sizes 4096,8192,16384,32768

times the LM head alone (an ONNX Runtime Gemm session over the rows of a random [151936, 1024] table, 15
rows: a 16-slot block) for the full table and each subset size (the runtime keeps the subset's logits as
they are: runtime/draft_space.py).

    python benchmarks/draft_vocab_cost.py --engine B --bundle-map --threads 1

times the bundle's own map against the full head (either precision; an int4 / int8 bundle's subset head is
MatMulNBits over the subset's packed rows), without responses or coverage.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from retrace.models.draft_vocab import count_tokens, coverage_of, from_counts
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend


def responses(target_dir: Path, files: list[Path], limit: int | None, max_new: int) -> list[list[int]]:
    from retrace.models.target import Qwen3Target
    from retrace.runtime.tokenizer import TextCodec
    from retrace.train.datasets_io import plain_prompts, read_rows
    from retrace.train.rollout import generate

    rows = [r for f in files for r in read_rows(f)][:limit]
    prompts = [p[-256:] for p in plain_prompts(rows, TextCodec.find(target_dir))]
    return generate(Qwen3Target.from_pretrained(target_dir, tap_layers=()), prompts, max_new, 32)


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def heads_only(sizes: list[int], reps: int, threads: int, out: Path | None, V: int = 151936, d: int = 1024,
               rows: int = 15) -> None:
    from retrace.runtime.lm_head_split import LmHead
    from retrace.runtime.onnxruntime_backend import _session_options

    g = torch.Generator().manual_seed(0)
    table = (torch.randn(V, d, generator=g) * 0.02).numpy()
    h = torch.randn(rows, d, generator=g)
    heads = {}
    for n in [V, *sizes]:
        ids = torch.sort(torch.randperm(V, generator=g)[:n]).values
        heads[n] = LmHead.of_rows(table[ids.numpy()], _session_options(threads, None), ["CPUExecutionProvider"])
    times: dict[int, list[float]] = {n: [] for n in heads}
    for rep in range(reps + 2):  # interleaved; the first two are warm-up
        for n, head in heads.items():
            t0 = time.perf_counter()
            head(h, (1, rows))
            if rep >= 2:
                times[n].append((time.perf_counter() - t0) * 1e3)
    res = {n: {"median_ms": statistics.median(t), "min_ms": min(t)} for n, t in times.items()}
    for n, r in res.items():
        print(f"{n:>7} rows: median {r['median_ms']:7.2f} ms, min {r['min_ms']:7.2f} ms "
              f"({r['min_ms'] / res[V]['min_ms']:.3f} of the full head's min)")
    if out:
        out.write_text(json.dumps({"rows": rows, "hidden": d, "threads": threads, "heads": res}, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", type=Path)
    ap.add_argument("--small-target", type=Path)
    ap.add_argument("--train-prompts", type=Path)
    ap.add_argument("--heldout", type=Path, help="folder of held-out prompt JSONL files")
    ap.add_argument("--sizes", default="4096,8192,16384,32768")
    ap.add_argument("--train-limit", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=4, help="new context tokens per draft call (accepted + bonus)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--heads-only", action="store_true", help="time the LM head alone (no bundle)")
    ap.add_argument("--bundle-map", action="store_true",
                    help="time the bundle's own draft vocabulary against the full head only (no coverage)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.heads_only:
        return heads_only([int(s) for s in a.sizes.split(",")], a.reps, a.threads, a.json)
    if a.engine is None or not a.bundle_map and (a.small_target is None or a.train_prompts is None
                                                 or a.heldout is None):
        ap.error("--engine, --small-target, --train-prompts and --heldout are needed (or --heads-only, or "
                 "--engine with --bundle-map)")

    be = OnnxRuntimeBackend.from_bundle(a.engine, max_batch=1, threads=a.threads)
    V = be.target_config.vocab_size
    if a.bundle_map:  # the bundle's own map against the full head; no responses, no coverage
        train = held = torch.zeros(V, dtype=torch.int64)
        vocabs = {be.draft_vocab.size: be.draft_vocab}
    else:
        train = count_tokens(responses(a.small_target, [a.train_prompts], a.train_limit, a.max_new_tokens), V)
        held = count_tokens(responses(a.small_target, sorted(a.heldout.glob("*.jsonl")), None, a.max_new_tokens), V)
        eos = be.target_config.eos_token_ids
        vocabs = {int(s): from_counts(train, size=int(s), always=eos) for s in a.sizes.split(",")}

    B = be.drafter_config.block_size
    k_d = be.drafter_config.num_taps * be.target_config.hidden_size
    slots, P, C = torch.tensor([0]), a.context, a.ctx
    g = torch.Generator().manual_seed(0)
    be.target(slots, torch.randint(0, 500, (1, P), generator=g), torch.arange(P).unsqueeze(0),
              torch.tensor([[P - 1]]))  # the context's K/V
    decode = (slots, torch.tensor([[7]]), torch.tensor([[P]]), torch.tensor([[0]]))
    taps = torch.randn(1, C, k_d, generator=g)
    block = torch.randint(0, 500, (1, B), generator=g)
    draft = (slots, taps, torch.arange(P - C, P).unsqueeze(0), block, torch.arange(P, P + B).unsqueeze(0), None)
    configs = {"full": None, **{f"{s}": v for s, v in vocabs.items()}}
    heads = {}
    for name, v in configs.items():  # one head session per config, built once, swapped between calls
        be.use_draft_vocab(v)
        heads[name] = (be.draft_vocab, be.draft_head, be.draft_ids)
    times: dict[str, list[float]] = {"decode": [], **{n: [] for n in configs}}
    for _ in range(3):  # warm-up
        be.target(*decode)
        for n in configs:
            be.draft_vocab, be.draft_head, be.draft_ids = heads[n]
            be.draft(*draft)
    for _ in range(a.reps):  # interleaved
        times["decode"] += timed(lambda: be.target(*decode), 1)
        for n in configs:
            be.draft_vocab, be.draft_head, be.draft_ids = heads[n]
            times[n] += timed(lambda: be.draft(*draft), 1)
    dec = statistics.median(times["decode"])
    out = {"decode_ms": dec, "block": B, "context": P, "ctx": C, "threads": a.threads, "rows": {}}
    for n, v in configs.items():
        ms = statistics.median(times[n])
        row = {"draft_ms": ms, "ratio": ms / dec, "range_ms": [min(times[n]), max(times[n])]}
        if v is not None:
            row.update(size=v.size)
        if v is not None and not a.bundle_map:
            row.update(coverage_train=coverage_of(v.ids, train), coverage_heldout=coverage_of(v.ids, held))
        out["rows"][n] = row
        print(f"{n:>6}: draft {ms:7.2f} ms = {ms / dec:.3f} of a decode ({dec:.2f} ms)"
              + (f", coverage train {row['coverage_train']:.4f} held-out {row['coverage_heldout']:.4f}"
                 if "coverage_train" in row else ""))
    out["distinct_ids"] = {"train": int((train > 0).sum()), "heldout": int((held > 0).sum())}
    print(f"distinct ids in the responses: train {out['distinct_ids']['train']}, "
          f"held-out {out['distinct_ids']['heldout']} (target vocab {V})")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
