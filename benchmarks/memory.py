"""Peak RSS of `retrace generate` on an ONNX Runtime bundle, against what it must hold (not a test).

    python benchmarks/memory.py make-pair --out DIR [--shape qwen3-0.6b]
    python benchmarks/memory.py measure --engine BUNDLE [--max-batch 1] [--max-seq-len 512] [--json out.json]
    python benchmarks/memory.py calls --engine BUNDLE [--calls 5]

make-pair writes a random-weight pair of a real Qwen3 shape (DIR/target, DIR/drafter: a 1-layer drafter of
the target's width with a random ReTrace conditioner); build its bundle with `retrace-export build`.
measure prints the bundle's weights split by part (target, the embedding / LM head the drafter shares, the
drafter's own layers, the conditioner), the KV caches the backend allocates at the given limits, and the
peak RSS of `retrace generate` run in a subprocess (getrusage of the child), with its ratio to
`target + drafter layers + conditioner + KV cache`.
calls times the backend's draft, verify (a block of 16 new tokens, logits at each), verify4 (4 new tokens: a
short verify) and decode (one token, one row of logits: an ar step) calls at batch 1 (median of --calls),
several engines' calls interleaved.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # the real configs' shapes (random weights)
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rms_norm_eps=1e-6),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rms_norm_eps=1e-6),
}


def make_pair(out: Path, shape: str, block_size: int = 16, seed: int = 0) -> tuple[Path, Path]:
    """A random target of `shape` (transformers save_pretrained) and a 1-layer drafter with a random
    ReTrace conditioner, in out/target and out/drafter."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from retrace.models.conditioner import ReTraceConditioner
    from retrace.models.drafter import DFlashDrafter, new_drafter_config
    from retrace.models.target import Qwen3Target

    torch.manual_seed(seed)
    cfg = Qwen3Config(**SHAPES[shape], rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    Qwen3ForCausalLM(cfg).save_pretrained(out / "target")
    target = Qwen3Target.from_pretrained(out / "target")
    drafter = DFlashDrafter(new_drafter_config(target, num_layers=1, block_size=block_size), target)
    for p in drafter.parameters():  # its own layers only (the embedding / LM head are the target's)
        if p.dim() == 2:
            p.data.normal_(0, 0.02)
    drafter.conditioner = ReTraceConditioner(cfg.hidden_size)
    drafter.conditioner.reset(init="random", seed=seed)
    drafter.save_pretrained(out / "drafter")
    return out / "target", out / "drafter"


# -- what the bundle holds ---------------------------------------------------------------------------------
def _initializer_bytes(graph_path: Path) -> dict[str, int]:
    """name -> bytes of every initializer of a graph (external data lengths; nothing is loaded)."""
    import onnx

    from retrace.runtime.shared_weights import tensor_bytes

    m = onnx.load(str(graph_path), load_external_data=False)
    return {i.name: tensor_bytes(i) for i in m.graph.initializer}


def breakdown(engine: Path, max_batch: int, max_seq_len: int) -> dict:
    """Bytes of each part: the target graph's weights, the drafter's shared embedding / LM head (what it
    would hold as its own copy), its own layers and its conditioner, and both KV caches as the backend
    allocates them ([2L, max_batch, Hkv, max_seq_len, hd] each)."""
    from retrace.engines.bundle import Bundle

    b = Bundle.open(engine, verify_hashes=False)
    dtype_bytes = {"float32": 4, "float16": 2}[b.dtype]
    target = sum(_initializer_bytes(b.graph_path("target")).values())
    drafter = _initializer_bytes(b.graph_path("drafter"))
    shared = sum(v for k, v in drafter.items() if k.startswith("shared_target."))
    conditioner = sum(v for k, v in drafter.items() if ".conditioner." in k)
    own = sum(drafter.values()) - shared - conditioner

    def kv(summary: dict) -> int:
        return (2 * summary["num_hidden_layers"] * max_batch * summary["num_key_value_heads"] * max_seq_len
                * summary["head_dim"] * dtype_bytes)

    return {"target": target, "drafter_shared": shared, "drafter_layers": own, "conditioner": conditioner,
            "kv_target": kv(b.model("target")["summary"]), "kv_drafter": kv(b.model("drafter")["summary"])}


def peak_rss(engine: Path, max_batch: int, max_seq_len: int, max_new_tokens: int, prompt_len: int,
             mode: str, threads: int | None) -> tuple[int, dict]:
    """Peak RSS (bytes) of `retrace generate` in a fresh subprocess, and its JSON stats."""
    exe = Path(sys.executable).with_name("retrace")
    ids = ",".join(str(7 + (i * 31) % 1000) for i in range(prompt_len))
    cmd = [str(exe), "generate", "--engine", str(engine), "--prompt-ids", ids, "--max-new-tokens",
           str(max_new_tokens), "--mode", mode, "--max-batch", str(max_batch), "--max-seq-len", str(max_seq_len),
           "--no-verify-bundle", "--json", *(["--threads", str(threads)] if threads else [])]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        raise SystemExit("measure in a fresh process: an earlier child had a larger peak RSS")
    return peak * 1024, json.loads(res.stdout)["stats"]


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def measure(args) -> dict:
    parts = breakdown(args.engine, args.max_batch, args.max_seq_len)
    budget = sum(v for k, v in parts.items() if k != "drafter_shared")
    rss, stats = peak_rss(args.engine, args.max_batch, args.max_seq_len, args.max_new_tokens, args.prompt_len,
                          args.mode, args.threads)
    rows = [("target graph weights", parts["target"]),
            ("drafter: shared embedding / LM head (file)", parts["drafter_shared"]),
            ("drafter: own layers", parts["drafter_layers"]), ("drafter: conditioner", parts["conditioner"]),
            (f"KV cache target (max_batch {args.max_batch}, max_seq_len {args.max_seq_len})", parts["kv_target"]),
            ("KV cache drafter", parts["kv_drafter"]),
            ("budget: target + drafter layers + conditioner + KV", budget),
            (f"peak RSS of retrace generate ({args.mode})", rss)]
    print(f"{'part':<62} {'GB':>8}")
    for name, n in rows:
        print(f"{name:<62} {_gb(n):>8}")
    print(f"{'peak RSS / budget':<62} {rss / budget:>8.3f}")
    return {"engine": str(args.engine), "parts": parts, "budget": budget, "peak_rss": rss,
            "ratio": rss / budget, "tokens": stats["tokens"], "tau": stats["tau"],
            "limits": {"max_batch": args.max_batch, "max_seq_len": args.max_seq_len}}


# -- call times --------------------------------------------------------------------------------------------
def _call_inputs(be, prompt_len: int, block: int):
    import torch

    from retrace.models.drafter import SuffixInputs

    dc = be.drafter_config
    vocab = be.target_config.vocab_size
    slots = torch.tensor([0])
    ids = ((7 + 31 * torch.arange(prompt_len)) % vocab).unsqueeze(0)
    pos = torch.arange(prompt_len).unsqueeze(0)
    verify_ids = ((5 + 17 * torch.arange(block)) % vocab).unsqueeze(0)
    verify_pos = prompt_len + torch.arange(block).unsqueeze(0)
    _, taps = be.target(slots, ids, pos, torch.tensor([[prompt_len - 1]]))
    block_ids = torch.full((1, block), dc.mask_token_id)
    block_ids[0, 0] = 5
    suffix = None
    if be.has_conditioner:
        n_feat = getattr(be, "_num_features", 3)
        suffix = SuffixInputs(torch.zeros(1, block, dc.hidden_size), torch.zeros(1, block, n_feat),
                              torch.zeros(1, block), torch.zeros(1, block, dtype=torch.long))
    draft = (slots, taps, pos, block_ids, prompt_len - 1 + torch.arange(block).unsqueeze(0), suffix)
    verify = (slots, verify_ids, verify_pos, torch.arange(block).unsqueeze(0))
    decode = (slots, verify_ids[:, :1], verify_pos[:, :1], torch.zeros(1, 1, dtype=torch.long))
    short = (slots, verify_ids[:, :4], verify_pos[:, :4], torch.arange(4).unsqueeze(0))
    return draft, verify, short, decode


def calls(args) -> dict:
    """Median ms of draft, verify (a block of new tokens, logits at each), verify4 and decode (one token: an ar step)
    calls at batch 1 per engine, the engines' calls interleaved."""
    from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

    backends = [OnnxRuntimeBackend.from_bundle(e, max_batch=1, max_seq_len=args.max_seq_len, threads=args.threads,
                                               verify=False) for e in args.engine]
    inputs = [_call_inputs(be, args.prompt_len, be.drafter_config.block_size) for be in backends]
    times = [{"draft": [], "verify": [], "verify4": [], "decode": []} for _ in backends]
    for _ in range(args.calls):
        for be, (draft, verify, short, decode), t in zip(backends, inputs, times, strict=True):
            for name, fn, call in (("draft", be.draft, draft), ("verify", be.target, verify),
                                   ("verify4", be.target, short), ("decode", be.target, decode)):
                t0 = time.perf_counter()
                fn(*call)
                t[name].append(time.perf_counter() - t0)
    out = {}
    first = {k: statistics.median(v) for k, v in times[0].items()}
    for e, t in zip(args.engine, times, strict=True):
        med = {k: 1000 * statistics.median(v) for k, v in t.items()}
        print(f"{str(e):<50} " + "   ".join(f"{k} {v:7.1f} ms ({v / 1000 / first[k]:.2f}x)" for k, v in med.items())
              + f"  (median of {args.calls}; ratios to the first engine)")
        out[str(e)] = med
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mp = sub.add_parser("make-pair")
    mp.add_argument("--out", type=Path, required=True)
    mp.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    for name in ("measure", "calls"):
        p = sub.add_parser(name)
        p.add_argument("--engine", type=Path, required=True, action="append" if name == "calls" else "store")
        p.add_argument("--max-seq-len", type=int, default=512)
        p.add_argument("--prompt-len", type=int, default=32)
        p.add_argument("--threads", type=int, default=None)
        p.add_argument("--json", dest="json_out", type=Path)
    sub.choices["measure"].add_argument("--max-batch", type=int, default=1)
    sub.choices["measure"].add_argument("--max-new-tokens", type=int, default=64)
    sub.choices["measure"].add_argument("--mode", default="retrace")
    sub.choices["calls"].add_argument("--calls", type=int, default=5)
    args = ap.parse_args(argv)
    if args.cmd == "make-pair":
        make_pair(args.out, args.shape)
        print(f"wrote {args.out}/target and {args.out}/drafter; build a bundle with retrace-export build")
        return 0
    result = measure(args) if args.cmd == "measure" else calls(args)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
