"""Runtime performance check for the torch backend (not a test).

    python benchmarks/runtime_perf.py [--target DIR --drafter DIR] [--max-new-tokens 128] [--json out.json]
                                      [--profile out.prof]

Reports, for modes ar / dflash / retrace (greedy):
  - tokens/s at batch 1 (each prompt alone, in turn) and at batch 8 (all prompts as one batch), and their
    ratio; tau (mean tokens per round, counting the bonus token);
  - at batch 1: the share of wall time spent outside model forwards (`other`; goal <= 5%). Forward time
    is measured around the backend's target()/draft() calls, so `other` is everything the loop does in
    Python and torch glue: building blocks, context padding, acceptance, suffix memory, commit, stops;
  - the loop's own timing split (prefill / draft / verify / other as the Scheduler records them).
The pair: --target/--drafter, else the zoo at ./zoo-small-target-check if it exists, else a random
~6M-parameter pair (hidden 256, 6 target layers, 2 drafter layers, vocab 2048, block 16) written to a
temporary directory. A random drafter is almost never accepted (tau ~1), so dflash/retrace are slower than
ar on it; the overhead share is what that pair measures.
Columns: wall-clock and CPU-time figures. On a shared machine (other jobs on the cores) wall time mostly
measures the neighbours; use --threads 1 there (two intra-op threads fighting for busy cores made every
op 10-50x slower here) and read the CPU-time columns.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.modes import MODES
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.torch_backend import TorchBackend

DEFAULT_ZOO = Path(__file__).resolve().parents[1] / "zoo-small-target-check"


class TimedBackend:
    """Forwards every call to a backend and adds up the wall and CPU seconds spent inside its model
    forwards (CPU time: on a shared, busy machine wall time mostly measures the neighbours)."""

    def __init__(self, inner):
        self.inner = inner
        for k in ("name", "target_config", "drafter_config", "max_batch", "max_seq_len", "has_conditioner"):
            setattr(self, k, getattr(inner, k))
        self.forward_s = self.forward_cpu_s = 0.0

    def _timed(self, fn, *args):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args)
        finally:
            self.forward_s += time.perf_counter() - t0
            self.forward_cpu_s += time.process_time() - c0

    def target(self, *args):
        return self._timed(self.inner.target, *args)

    def draft(self, *args):
        return self._timed(self.inner.draft, *args)

    def release(self, slot: int) -> None:
        self.inner.release(slot)


def random_pair(root: Path) -> tuple[Path, Path]:
    """A random Qwen3 target (transformers save_pretrained) and a DFlash drafter with a zero-init conditioner."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from retrace.models.conditioner import ReTraceConditioner
    from retrace.models.drafter import DFlashDrafter, new_drafter_config
    from retrace.models.target import Qwen3Target

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=1024,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    target = Qwen3Target.from_pretrained(root / "target")
    drafter = DFlashDrafter(new_drafter_config(target, num_layers=2, block_size=16), target)
    drafter.conditioner = ReTraceConditioner(256)
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


def run_mode(backend: TimedBackend, codec, prompts, mode: str, max_new: int, batch: int) -> dict:
    rt = Runtime(backend, codec)
    params = SamplingParams(max_new_tokens=max_new)
    rt.generate(prompts[:1], SamplingParams(max_new_tokens=8), mode)  # warm-up
    rt.reset_stats()
    backend.forward_s = backend.forward_cpu_s = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    if batch == 1:
        for p in prompts:
            rt.generate([p], params, mode)
    else:
        rt.generate(prompts[:batch], params, mode)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = rt.run_stats()
    return {
        "mode": mode, "batch": batch, "tokens": st["tokens"], "wall_s": wall, "cpu_s": cpu,
        "tokens_per_s": st["tokens"] / wall, "tokens_per_cpu_s": st["tokens"] / cpu,
        "tau": st["tau"], "rounds": st["rounds"], "forward_s": backend.forward_s,
        "other_share": 1 - backend.forward_s / wall, "other_share_cpu": 1 - backend.forward_cpu_s / cpu,
        "loop_time": st["time"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=8, help="number of prompts (batch 8 uses 8 of them)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--profile", help="cProfile the batch-1 retrace run into this file")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    tmp = None
    if args.target:
        target, drafter = Path(args.target), Path(args.drafter) if args.drafter else None
        source = "given"
    elif (DEFAULT_ZOO / "target").is_dir():
        target, drafter, source = DEFAULT_ZOO / "target", DEFAULT_ZOO / "drafter", str(DEFAULT_ZOO)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="retrace-perf-")
        target, drafter = random_pair(Path(tmp.name))
        source = "random ~6M-parameter pair"
    seq_len = args.prompt_len + args.max_new_tokens + 64
    backend = TimedBackend(TorchBackend.from_dirs(target, drafter, max_batch=8, max_seq_len=seq_len))
    codec = TextCodec.find(target)
    n_params = sum(p.numel() for p in backend.inner.target_model.parameters())
    vocab = backend.target_config.vocab_size
    mask = backend.drafter_config.mask_token_id if backend.drafter_config else -1
    g = torch.Generator().manual_seed(0)
    prompts = []
    while len(prompts) < args.prompts:
        p = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
        if mask not in p:
            prompts.append(p)

    print(f"pair: {source} (target {n_params / 1e6:.1f}M params, {backend.target_config.num_hidden_layers} "
          f"layers, vocab {vocab}); torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}; {args.prompts} prompts x {args.max_new_tokens} new tokens, greedy")
    rows = []
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        for batch in (1, 8):
            if batch == 1 and mode == "retrace" and args.profile:
                import cProfile

                prof = cProfile.Profile(time.process_time)  # CPU time: robust to busy neighbours
                prof.enable()
                rows.append(run_mode(backend, codec, prompts, mode, args.max_new_tokens, batch))
                prof.disable()
                prof.dump_stats(args.profile)
            else:
                rows.append(run_mode(backend, codec, prompts, mode, args.max_new_tokens, batch))

    print(f"{'mode':8} {'batch':>5} {'tok/s':>8} {'tok/cpu-s':>9} {'tau':>5} {'rounds':>6} {'other':>6} "
          f"{'other-cpu':>9}   loop split (prefill/draft/verify/other wall s)")
    for r in rows:
        t = r["loop_time"]
        print(f"{r['mode']:8} {r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['tokens_per_cpu_s']:>9.1f} "
              f"{r['tau']:>5.2f} {r['rounds']:>6} {r['other_share']:>6.1%} {r['other_share_cpu']:>9.1%}   "
              f"{t['prefill_s']:.2f}/{t['draft_s']:.2f}/{t['verify_s']:.2f}/{t['other_s']:.2f}")
    by = {(r["mode"], r["batch"]): r for r in rows}
    for mode in modes:
        b1, b8 = by[(mode, 1)], by[(mode, 8)]
        print(f"{mode}: batch 8 / batch 1 throughput = {b8['tokens_per_s'] / b1['tokens_per_s']:.2f}x wall, "
              f"{b8['tokens_per_cpu_s'] / b1['tokens_per_cpu_s']:.2f}x CPU; batch-1 time outside model forwards "
              f"{b1['other_share']:.1%} wall, {b1['other_share_cpu']:.1%} CPU (goal <= 5%)")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"pair": source, "rows": rows}, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
