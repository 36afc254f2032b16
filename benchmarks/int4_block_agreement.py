"""Top-1 agreement with the fp32 model of the int4 target graph at several quantization block sizes (not a test).

    python benchmarks/int4_block_agreement.py --target T --drafter D --out-dir DIR [--blocks 32,128,256]
        [--prompts 8] [--length 64] [--vocab N]

Exports the fp32 target graph once (as `retrace-export build` does), quantizes a copy per block size with the
build's own quantizer and fusions (retrace.export.quantize.quantize_graph), and measures each with the build's
agreement check (retrace.export.quantize.agreement: logits at every position of held-out random prompts).
`--vocab N`: prompt ids below N (a pair inflated to a larger vocabulary uses only its tokenizer's first ids;
default: the target directory's tokenizer.json size, else the whole vocabulary). Random-weight models give no
meaningful agreement (flat logits): use a trained pair (e.g. `retrace zoo inflate`).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path


def _tokenizer_size(target: Path) -> int | None:
    f = target / "tokenizer.json"
    if not f.is_file():
        return None
    t = json.loads(f.read_text())
    return len(t["model"]["vocab"]) + len(t.get("added_tokens", []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True, help="the pair's drafter (its tap layers)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--blocks", default="32,128,256")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=None)
    args = ap.parse_args(argv)
    from retrace.export.onnx_export import export_target
    from retrace.export.quantize import WeightQuant, agreement, quantize_graph
    from retrace.models.drafter import load_pair

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # per node
    out = Path(args.out_dir)
    target, _ = load_pair(args.target, args.drafter, load_conditioner=False, draft_vocab=False)
    vocab = args.vocab or _tokenizer_size(Path(args.target))
    fp32 = out / "fp32"
    if not (fp32 / "model.onnx").is_file():
        export_target(target, fp32)
    rows = {}
    for block in (int(b) for b in args.blocks.split(",")):
        d = out / f"int4-b{block}"
        if not (d / "model.onnx").is_file():
            shutil.copytree(fp32, d, dirs_exist_ok=True)
            quantize_graph(d / "model.onnx", WeightQuant("int4", block))
        rows[block] = agreement(target, d / "model.onnx", args.prompts, args.length, vocab=vocab)
        print(f"block {block:4d}: {json.dumps(rows[block])}", flush=True)
    print(json.dumps({"vocab": vocab, "blocks": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
