"""The torch backend's static caches against its dense-past path, plain decoding (not a test).

    python benchmarks/torch_static_cache.py [--shape qwen3-0.6b|small] [--threads 2] [--prompts 4]
                                            [--prompt-len 64] [--max-new-tokens 48] [--runs 2] [--compile]
                                            [--per-call] [--ort] [--json out.json]

Random weights of the shape (the speed of a dense fp32 model does not depend on its values), `ar` mode at
batch 1 (each prompt in turn) through the Runtime, for
  concat   runtime/torch_concat.py: the models' own forwards over a dense past (the path before the
           static caches, kept verbatim for training rollouts),
  static   runtime/torch_backend.py: K/V written in place, attention over a bucketed cache window,
  static+compile (--compile) the same under torch.compile (inductor, fullgraph),
  ort      (--ort) our ONNX Runtime backend on a bundle of the same weights (built once, fp32, in a temp dir),
interleaved run by run on the same weights (the machine is shared: compare within a run); prints tok/s and
static / concat per run, and checks that every variant gives the same tokens. --per-call: instead, ms per
target call (T=1 and T=16 at past 128 and 1024, batch 1; the minimum over --runs, interleaved).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from retrace.models.config import Qwen3Config
from retrace.models.target import Qwen3Target
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.device import index_tensor
from retrace.runtime.torch_backend import TorchBackend
from retrace.runtime.torch_concat import ConcatTorchBackend

SHAPES = {  # Qwen3-0.6B: hidden 1024, 28 layers, heads 16/8, head_dim 128, MLP 3072, vocabulary 151936
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936),
    "small": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                  intermediate_size=768, vocab_size=4096),
}


def random_target(shape: str) -> Qwen3Target:
    raw = dict(SHAPES[shape], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
               tie_word_embeddings=True, model_type="qwen3")
    torch.manual_seed(0)
    model = Qwen3Target(Qwen3Config.from_dict(raw, Path(f"<random {shape}>")))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.eval().requires_grad_(False)


def hf_random_dir(shape: str, root: Path) -> Path:
    """The random weights of `shape` as a transformers Qwen3 directory (what a bundle is built from)."""
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(HFConfig(**SHAPES[shape], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
                                   tie_word_embeddings=True))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    hf.save_pretrained(root / "target")
    return root / "target"


def ort_runtime(shape: str, threads: int, max_seq_len: int) -> tuple[Runtime, Qwen3Target]:
    """A Runtime on our ONNX Runtime backend over a bundle of random `shape` weights, and the same weights
    as a Qwen3Target (so the torch variants run the same model)."""
    import atexit
    import shutil
    import tempfile

    from retrace.export.build import BuildOptions, build_bundle
    from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

    tmp = Path(tempfile.mkdtemp(prefix="static-cache-ort-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    tdir = hf_random_dir(shape, tmp)
    t0 = time.perf_counter()
    build_bundle(BuildOptions(tdir, None, tmp / "bundle", max_batch=1, max_seq_len=max_seq_len))
    print(f"bundle built in {time.perf_counter() - t0:.0f} s", flush=True)
    backend = OnnxRuntimeBackend.from_bundle(tmp / "bundle", max_batch=1, threads=threads, verify=False)
    return Runtime(backend), Qwen3Target.from_pretrained(tdir).eval().requires_grad_(False)


def tokens_per_s(rt: Runtime, prompts: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    rt.generate([prompts[0]], SamplingParams(max_new_tokens=4, ignore_eos=True), "ar")  # warm-up
    out, n, t0 = [], 0, time.perf_counter()
    for p in prompts:
        ids = rt.generate([p], SamplingParams(max_new_tokens=max_new, ignore_eos=True), "ar")[0].token_ids
        out.append(ids)
        n += len(ids)
    return n / (time.perf_counter() - t0), out


def unfrozen(make):
    """A backend whose compiled steps are built without inductor's freezing (runtime/compiled_step.py)."""
    old = os.environ.get("RETRACE_COMPILE_FREEZING")
    os.environ["RETRACE_COMPILE_FREEZING"] = "0"
    try:
        return make()
    finally:
        os.environ.pop("RETRACE_COMPILE_FREEZING") if old is None else os.environ.update(RETRACE_COMPILE_FREEZING=old)


def per_call(backends: dict, runs: int, vocab: int) -> dict:
    """ms per target call (min over runs), batch 1, slot 0, the past already in the cache (random K/V)."""
    cpu = torch.device("cpu")
    slot = index_tensor([0], cpu)
    out: dict = {}
    for _ in range(runs):
        for P in (128, 1024):
            for T in (1, 4, 16):
                ids = torch.randint(0, vocab, (1, T))
                pos = index_tensor([list(range(P, P + T))], cpu)
                for name, be in backends.items():
                    t0 = time.perf_counter()
                    be.target(slot, ids, pos, torch.arange(T).unsqueeze(0))
                    ms = 1e3 * (time.perf_counter() - t0)
                    key = f"T={T} P={P}"
                    out.setdefault(key, {})[name] = min(ms, out.get(key, {}).get(name, float("inf")))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also the static path under torch.compile (inductor)")
    ap.add_argument("--unfrozen", action="store_true",
                    help="with --compile: also inductor without freezing (RETRACE_COMPILE_FREEZING=0)")
    ap.add_argument("--per-call", action="store_true")
    ap.add_argument("--ort", action="store_true", help="also our ONNX Runtime backend on the same weights")
    ap.add_argument("--skip-concat", action="store_true", help="leave out the dense-past variant")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ort_rt = None
    if a.ort:
        ort_rt, target = ort_runtime(a.shape, a.threads, a.max_seq_len)
    else:
        target = random_target(a.shape)
    g = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist() for _ in range(a.prompts)]
    kw = dict(max_batch=1, max_seq_len=a.max_seq_len)
    variants = {"concat": lambda: ConcatTorchBackend(target, None, **kw),
                "static": lambda: TorchBackend(target, None, **kw)}
    if a.compile:
        variants["static+compile"] = lambda: TorchBackend(target, None, compile=True, **kw)
    if a.compile and a.unfrozen:
        variants["static+compile-unfrozen"] = lambda: unfrozen(lambda: TorchBackend(target, None, compile=True, **kw))
    if a.skip_concat:
        del variants["concat"]
    base = next(iter(variants))
    if a.per_call:
        backends = {name: make() for name, make in variants.items()}
        if ort_rt is not None:
            backends["ort"] = ort_rt.backend
        res = per_call(backends, a.runs, vocab)
        for key, row in res.items():
            print(f"{key}: " + "  ".join(f"{n} {v:.1f} ms" for n, v in row.items()) +
                  (f"  (static/concat time {row['static'] / row['concat']:.2f}x)" if "concat" in row else ""))
        if a.json:
            Path(a.json).write_text(json.dumps({"shape": a.shape, "threads": a.threads, "per_call_ms": res}, indent=2))
        return 0
    runtimes = {name: Runtime(make()) for name, make in variants.items()}
    if ort_rt is not None:
        runtimes["ort"] = ort_rt
    report: dict = {"shape": a.shape, "threads": a.threads, "prompts": a.prompts, "prompt_len": a.prompt_len,
                    "max_new_tokens": a.max_new_tokens, "runs": []}
    tokens = {}
    for run in range(a.runs):
        row = {}
        for name, rt in runtimes.items():
            t0 = time.perf_counter()
            row[name], tokens[name] = tokens_per_s(rt, prompts, a.max_new_tokens)
            if run == 0:
                report.setdefault("first_run_s", {})[name] = round(time.perf_counter() - t0, 1)  # compile included
        report["runs"].append(row)
        ref = "ort" if "ort" in row else base
        ratios = "  ".join(f"{n}/{ref} {row[n] / row[ref]:.2f}x" for n in row if n != ref)
        print(f"run {run + 1}: " + "  ".join(f"{n} {v:.2f} tok/s" for n, v in row.items()) + f"  ({ratios})",
              flush=True)
    report["same_tokens"] = all(t == tokens[base] for t in tokens.values())
    print("same tokens in every variant:", report["same_tokens"])
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0 if report["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
