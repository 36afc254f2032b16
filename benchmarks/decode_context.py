"""One decode step against the context length: our ONNX Runtime backend vs onnxruntime-genai (not a test).

    python benchmarks/decode_context.py --target DIR --bundle B [--contexts 128,512,1024,2048] [--threads 2]
        [--steps 8] [--cache-dir D] [--json F] [--plot F.png] [--markdown F.md]

Times a batch-1 decode step (one token, greedy) of the same Qwen3 target after `P` tokens of context, for
  retrace inplace   the ORT backend's default on the CPU: in-place K/V (retrace.runtime.kv_inplace)
  retrace gather    the portable graph: the past gathered into a staging buffer, then concatenated
  ortgenai          onnxruntime-genai's own decoder (GroupQueryAttention, past/present shared buffer),
                    built from the same HF directory by its model builder (retrace.bench.builds)
Each step is the target forward plus the LM head (logits of the last position): the whole per-token cost
of plain decoding, and the floor of any speculative round. Our caches are filled with random values
(a step's cost does not depend on them); onnxruntime-genai prefills a random prompt of P tokens. The
figure is the median of `--steps` consecutive steps after one warm-up step, systems interleaved per
context. Both run in this process with the same intra-op thread count and ONNX Runtime's default spinning.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def ours(bundle: str, kv_mode: str, threads: int, max_len: int):
    """-> step(P): the times of `steps` decode steps after P tokens (one backend, loaded once)."""
    from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

    be = OnnxRuntimeBackend.from_bundle(bundle, max_batch=1, threads=threads, verify=False, kv_mode=kv_mode,
                                        max_seq_len=max_len)
    assert be.kv_mode == kv_mode, be.kv_mode
    be.tcache.kv.normal_(0, 1)
    slots = torch.tensor([0])

    def run(context: int, steps: int) -> list[float]:
        times = []
        for i in range(steps + 1):
            ids = torch.randint(0, be.target_config.vocab_size // 2, (1, 1))
            t0 = time.perf_counter()
            be.target(slots, ids, torch.tensor([[context + i]]), torch.tensor([[0]]))
            times.append(time.perf_counter() - t0)
        return times[1:]

    return run


def ortgenai(model, context: int, steps: int, vocab: int) -> list[float]:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=context + steps + 2, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.random.default_rng(context).integers(0, vocab // 2, (1, context), dtype=np.int32))
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        gen.generate_next_token()
        times.append(time.perf_counter() - t0)
    return times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="Qwen3 HF directory (onnxruntime-genai builds from it)")
    ap.add_argument("--bundle", required=True, help="retrace-export bundle of the same target")
    ap.add_argument("--contexts", default="128,512,1024,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "retrace" / "bench"))
    ap.add_argument("--no-ortgenai", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    torch.set_num_threads(args.threads)
    cfg = json.loads((Path(args.target) / "config.json").read_text())
    max_len = max(contexts) + args.steps + 2
    inplace, gather = (ours(args.bundle, m, args.threads, max_len) for m in ("inplace", "gather"))
    systems = {"retrace inplace": lambda P: inplace(P, args.steps), "retrace gather": lambda P: gather(P, args.steps)}
    env = {}
    if not args.no_ortgenai:
        import onnxruntime_genai as og

        from retrace.bench.builds import build_genai_model

        model_dir, _ = build_genai_model(args.target, args.cache_dir, args.threads)
        model = og.Model(str(model_dir))
        systems["ortgenai"] = lambda P: ortgenai(model, P, args.steps, cfg["vocab_size"])
        env["ortgenai"] = {"version": og.__version__, "model_dir": str(model_dir)}
    rows = []
    for P in contexts:
        row = {"context": P}
        for name, fn in systems.items():
            t = fn(P)
            row[name] = {"median_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t), "max_ms": 1e3 * max(t)}
            print(f"P={P:5d} {name:16s} {row[name]['median_ms']:8.1f} ms/step "
                  f"({row[name]['min_ms']:.1f}-{row[name]['max_ms']:.1f})", flush=True)
        rows.append(row)
    import onnxruntime

    from retrace.train.numerics import cpu_name

    meta = {"target": args.target, "bundle": args.bundle, "threads": args.threads, "steps": args.steps,
            "shape": {k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")},
            "cpu": cpu_name(), "onnxruntime": onnxruntime.__version__, "torch": torch.__version__, **env}
    names = list(systems)
    lines = ["| context | " + " | ".join(f"{n} ms/step" for n in names) + " | inplace / gather |"
             + (" inplace / ortgenai |" if "ortgenai" in systems else ""),
             "|---:|" + "---:|" * (len(names) + 1 + ("ortgenai" in systems))]
    for r in rows:
        cells = [f"{r[n]['median_ms']:.1f}" for n in names]
        cells.append(f"{r['retrace inplace']['median_ms'] / r['retrace gather']['median_ms']:.2f}x")
        if "ortgenai" in systems:
            cells.append(f"{r['retrace inplace']['median_ms'] / r['ortgenai']['median_ms']:.2f}x")
        lines.append(f"| {r['context']} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        for n in names:
            ax.plot(contexts, [r[n]["median_ms"] for r in rows], marker="o", label=n)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step (batch 1)")
        ax.set_title(f"decode step vs context, {cfg.get('num_hidden_layers')} layers x {cfg.get('hidden_size')}, "
                     f"{args.threads} threads")
        ax.set_ylim(bottom=0)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
