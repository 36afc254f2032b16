"""Which ONNX form of attention/RMSNorm to export (not a test): opset-23 native vs decomposed.

    python benchmarks/onnx_attention.py [--target DIR --drafter DIR] [--threads 2] [--seconds 0.5] [--json F]

"native":      torch.onnx.ops.attention -> one `Attention` node per layer; onnxscript's opset-23 fusions
               -> `RMSNormalization`, `RotaryEmbedding`.
"decomposed":  MatMul/Softmax attention over repeated KV heads, elementwise RMSNorm and RoPE.
For each form: node counts of both graphs, ORT-vs-torch max |Δlogits|, and ms per ONNX Runtime call (CPU
EP, IO as numpy) for target decode (T=1) and verify (T=16) at past 128 and 1024, prefill (T=128), and a
drafter round (B=16 block, 16 new context, past 128 / 1024). Repetitions are interleaved between the
forms and the minimum is kept (timings on shared machines vary 1.5-3x; compare ratios within one run).
Default pair: random, ~6.8M-parameter target (hidden 256, 6 layers, 8 heads / 4 KV, vocab 4096) and a
2-layer drafter with a random conditioner.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from retrace.export import onnx_export as oe
from retrace.export.onnx_parity import drafter_parity, target_parity
from retrace.models.drafter import load_pair

FORMS = ("native", "decomposed")


def random_pair(root: Path, vocab=4096, hidden=256, layers=6, heads=8, kv_heads=4, inter=768, block=16):
    """A random target + drafter + random conditioner in the formats users bring (HF / z-lab dirs)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from retrace.models.conditioner import ReTraceConditioner
    from retrace.models.drafter import DFlashDrafter, new_drafter_config
    from retrace.models.target import Qwen3Target

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                      max_position_embeddings=4096, tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).save_pretrained(root / "target")
    target = Qwen3Target.from_pretrained(root / "target")
    drafter = DFlashDrafter(new_drafter_config(target, num_layers=2, block_size=block), target)
    cond = ReTraceConditioner(hidden)
    cond.reset("random")
    drafter.conditioner = cond
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


def ms_per_call(sess, feed, seconds):
    sess.run(None, feed)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or n < 3:
        sess.run(None, feed)
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import onnxruntime as ort

    tmp = Path(tempfile.mkdtemp(prefix="onnx-attention-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    tdir, ddir = (a.target, a.drafter) if a.target else random_pair(tmp / "pair")
    target, drafter = load_pair(tdir, ddir)
    n_params = sum(p.numel() for p in target.parameters())
    print(f"target {n_params / 1e6:.1f}M params, {target.config.num_hidden_layers} layers; drafter "
          f"{drafter.config.layers.num_hidden_layers} layers; ORT {ort.__version__}, {a.threads} threads")
    so = ort.SessionOptions()
    so.intra_op_num_threads = a.threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    res: dict = {}
    sessions = {}
    for form in FORMS:
        t0 = time.perf_counter()
        gt = oe.export_target(target, tmp / form / "target", attention=form)
        gd = oe.export_drafter(drafter, tmp / form / "drafter", attention=form)
        export_s = time.perf_counter() - t0
        sessions[form] = (ort.InferenceSession(str(gt.path), so, providers=["CPUExecutionProvider"]),
                          ort.InferenceSession(str(gd.path), so, providers=["CPUExecutionProvider"]))
        tp = target_parity(target, gt.path, 16, sess=sessions[form][0])
        dp = drafter_parity(drafter, gd.path, 16, sess=sessions[form][1])
        res[form] = {"target_nodes": gt.node_count, "drafter_nodes": gd.node_count, "export_s": round(export_s, 1),
                     "target_max_dlogits": max(r["logits"] for r in tp.values()),
                     "drafter_max_dlogits": max(r["logits"] for r in dp.values()),
                     "target_ops": gt.op_counts, "ms": {}}
    L = target.config.num_hidden_layers
    tin = oe.target_io(L)[0]
    din = oe.drafter_io(drafter.config.layers.num_hidden_layers, True)[0]
    cases = {}
    for T, P in ((1, 128), (1, 1024), (16, 128), (16, 1024), (128, 0)):
        args = oe.target_inputs(target, 1, T, P, T if T <= 16 else 1, past_len=torch.tensor([P]))
        name = "prefill T=128" if T == 128 else f"{'decode' if T == 1 else 'verify'} T={T} P={P}"
        cases[name] = (0, {n: x.numpy() for n, x in zip(tin, args, strict=True)})
    for P in (128, 1024):
        args = oe.drafter_inputs(drafter, 1, 16, 16, P, suffix=True)
        cases[f"draft B=16 C=16 P={P}"] = (1, {n: x.numpy() for n, x in zip(din, args, strict=True)})
    for _ in range(a.reps):
        for name, (which, feed) in cases.items():
            for form in FORMS:
                ms = ms_per_call(sessions[form][which], feed, a.seconds)
                res[form]["ms"][name] = min(res[form]["ms"].get(name, np.inf), ms)
    w = max(len(c) for c in cases)
    print(f"{'':{w}}  " + "  ".join(f"{f:>11}" for f in FORMS) + "   native/decomposed")
    print(f"{'nodes target / drafter':{w}}  " + "  ".join(
        f"{res[f]['target_nodes']:>5}/{res[f]['drafter_nodes']:<5}" for f in FORMS))
    print(f"{'max |Δlogits| vs torch':{w}}  " + "  ".join(
        f"{max(res[f]['target_max_dlogits'], res[f]['drafter_max_dlogits']):>11.1e}" for f in FORMS))
    for name in cases:
        vals = [res[f]["ms"][name] for f in FORMS]
        print(f"{name:{w}}  " + "  ".join(f"{v:>8.3f} ms" for v in vals) + f"   {vals[0] / vals[1]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
