"""How close prompt lookup's cost-aware K is to an oracle's (not a test): the target's own greedy continuations
of the held-out prompts, then at every position the n-gram proposal `retrace.runtime.prompt_lookup` makes there
and how many of its tokens the target would accept; rounds are replayed against a verify-cost curve t(T)
(in decodes: T = 1 is a plain step) with

  geo     PromptLookup's own choose / observe (decayed per-token acceptance per matched n-gram size, geometric
          in depth),
  depth   a per-depth estimate (the decayed rate of accepting token j given j - 1 accepted, per n-gram size),
  oracle  the K that commits fastest knowing the accepted length (an upper bound for any K rule),
  full    every proposal verified whole.

    python benchmarks/lookup_oracle.py --target ZOO/target --prompts ZOO/prompts [--limit 128] [--new 96]
        [--ngram 1,3] [--max-tokens 15]

Curves: `int4-avx2` (a verify of two rows costs a decode, each row past two 0.45 more: docs/quantization.md
"The verify rows' cost on AVX2"), `fp32` (0.06 per row), `mid` (0.2 per row). Prints tokens per unit of cost
over plain decoding's, tau (tokens per round) and lookup tokens verified per round, pooled over the prompts.
"""

from __future__ import annotations

import argparse

CURVES = {
    "int4-avx2": lambda T: 1.0 if T <= 2 else 1 + 0.45 * (T - 2),
    "fp32": lambda T: 1 + 0.06 * (T - 1),
    "mid": lambda T: 1 + 0.2 * (T - 1),
}


class Curve:
    """A cost curve as the CostModel `PromptLookup.best` asks (one row: N = 1)."""

    def __init__(self, t):
        self.t = t

    def verify(self, rows: int, tokens: int) -> float:
        return self.t(tokens)


class PerDepth:
    def __init__(self, sizes, depth, decay=0.98):
        self.decay, self.c = decay, {n: [[1.0, 1.0] for _ in range(depth)] for n in sizes}

    def gains(self, n, L):
        out, p = [], 1.0
        for h, m in self.c[n][:L]:
            p *= h / (h + m)
            out.append(p)
        return out

    def observe(self, n, verified, accepted):
        for j in range(min(accepted + 1, verified)):
            c = self.c[n][j]
            c[0] = self.decay * c[0] + (j < accepted)
            c[1] = self.decay * c[1] + (j >= accepted)


def replay(runs, rule, t, sizes, max_tokens) -> tuple[float, float, float]:
    """-> (speed over plain decoding, tokens per round, lookup tokens verified per round)."""
    from retrace.runtime.device import CPU, index_tensor
    from retrace.runtime.prompt_lookup import PromptLookup, _Index

    tokens = cost = rounds = verified = 0.0
    for prompt, out in runs:
        lookup = PromptLookup(min_ngram=sizes.start, max_ngram=sizes.stop - 1, max_tokens=max_tokens)
        est = PerDepth(sizes, max_tokens) if rule == "depth" else None
        idx = _Index(sizes)
        idx.extend(prompt)
        i = 0
        while i < len(out):
            prop = idx.find(max_tokens)[: len(out) - i - 1]
            n = idx.matched
            acc = 0
            while acc < len(prop) and prop[acc] == out[i + acc]:
                acc += 1
            if rule == "oracle":
                K = acc if acc and (1 + acc) / t(acc + 1) > 1 / t(1) else 0
            elif rule == "full":
                K = len(prop)
            elif rule == "geo":  # the runtime's own choice and estimate
                lookup._matched = [n if prop else 0]  # the matched size `propose` records for `best`
                K = lookup.choose(index_tensor([len(prop)], CPU), Curve(t))
                if K:
                    lookup.observe([K], [min(acc, K)])
            else:
                K, best, s = 0, 1 / t(1), 0.0
                for k, g in enumerate(est.gains(n, len(prop)) if prop else [], 1):
                    s += g
                    if (1 + s) / t(k + 1) > best:
                        K, best = k, (1 + s) / t(k + 1)
                if K:
                    est.observe(n, K, min(acc, K))
            c = min(acc, K) + 1
            idx.extend(out[i: i + c])
            i += c
            tokens, cost, rounds, verified = tokens + c, cost + t(K + 1), rounds + 1, verified + K
    return tokens / cost, tokens / rounds, verified / rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=128)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--ngram", default="1,3", help="min,max n-gram size")
    ap.add_argument("--max-tokens", type=int, default=15)
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from retrace.bench.prompts import load_prompts
    from retrace.runtime.tokenizer import TextCodec

    prompts = load_prompts([a.prompts], TextCodec.find(a.target), limit=a.limit)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # EOS is a token like any other (the bench's --ignore-eos)
    runs = []
    with torch.no_grad():
        for p in prompts:
            g = model.generate(torch.tensor([p.ids]), max_new_tokens=a.new, do_sample=False, pad_token_id=0)
            runs.append((p.ids, g[0, len(p.ids):].tolist()))
    lo, hi = (int(x) for x in a.ngram.split(","))
    sizes = range(lo, hi + 1)
    print(f"{len(runs)} prompts x {a.new} tokens, n-grams {lo}..{hi}, up to {a.max_tokens} lookup tokens")
    for name, t in CURVES.items():
        for rule in ("geo", "depth", "oracle", "full"):
            speed, tau, k = replay(runs, rule, t, sizes, a.max_tokens)
            print(f"{name:10s} {rule:7s} x plain decoding {speed:.3f}  tau {tau:.2f}  lookup tokens/round {k:.2f}")


if __name__ == "__main__":
    main()
