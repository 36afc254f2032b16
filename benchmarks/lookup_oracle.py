"""How close prompt lookup's cost-aware K is to an oracle's (not a test): the target's own greedy continuations
of the held-out prompts, then at every position the n-gram proposal `retrace.runtime.prompt_lookup` makes there
and how many of its tokens the target would accept; rounds are replayed against a verify-cost curve t(T)
(in decodes: T = 1 is a plain step) with

  geo     PromptLookup's own choose / observe (decayed per-token acceptance per matched n-gram size, geometric
          in depth), each size weighed by its estimate's mean,
  draw    the same with each size weighed by a draw from its Beta posterior (`explore=True`, the default:
          a size priced out by its mean is still tried now and then, and its estimate corrected),
  depth   a per-depth estimate (the decayed rate of accepting token j given j - 1 accepted, per n-gram size),
  oracle  the K that commits fastest knowing the accepted length (an upper bound for any K rule),
  full    every proposal verified whole.

    python benchmarks/lookup_oracle.py --target ZOO/target --prompts ZOO/prompts [--limit 128] [--new 96]
        [--ngram 1,3] [--max-tokens 15] [--rows 1,8]

`--rows N`: N prompts decoded together in lockstep (a batch of N rows: one K per round for all of them, as the
runtime chooses it; rows leave as they finish); the curves then price a call by its N x T rows.

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
    """A cost curve as the CostModel `PromptLookup.best` asks: a call of rows x tokens costs t(rows x tokens)."""

    def __init__(self, t):
        self.t = t

    def verify(self, rows: int, tokens: int) -> float:
        return self.t(rows * tokens)


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
        lookup = PromptLookup(min_ngram=sizes.start, max_ngram=sizes.stop - 1, max_tokens=max_tokens, explore=False)
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


def replay_rows(runs, rows, rule, t, sizes, max_tokens) -> tuple[float, float, float]:
    """`replay` for groups of `rows` prompts decoded together (rules geo, draw, full, oracle): -> (speed over plain
    decoding of the same groups, tokens per row-round, lookup tokens verified per row-round)."""
    from retrace.runtime.device import CPU, index_tensor
    from retrace.runtime.prompt_lookup import PromptLookup, _Index

    tokens = cost = plain = row_rounds = verified = 0.0
    lookup = PromptLookup(min_ngram=sizes.start, max_ngram=sizes.stop - 1, max_tokens=max_tokens,
                          max_rows=rows, explore=rule == "draw")
    for g in range(0, len(runs), rows):
        group = runs[g:g + rows]
        idx = [_Index(sizes) for _ in group]
        for i, (prompt, _) in enumerate(group):
            idx[i].extend(prompt)
        at = [0] * len(group)
        plain += max(len(out) for _, out in group) * t(len(group))
        while True:
            live = [i for i, (_, out) in enumerate(group) if at[i] < len(out)]
            if not live:
                break
            props, accs, matched = [], [], []
            for i in live:
                out = group[i][1]
                prop = idx[i].find(max_tokens)[: len(out) - at[i] - 1]
                acc = 0
                while acc < len(prop) and prop[acc] == out[at[i] + acc]:
                    acc += 1
                props.append(prop), accs.append(acc), matched.append(idx[i].matched if prop else 0)
            if rule == "full":
                K = max(map(len, props))
            elif rule == "oracle":  # the K that commits fastest this round, knowing every row's accepted length
                n = len(live)
                K = max(range(max(map(len, props)) + 1),
                        key=lambda k: (n + sum(min(a, k) for a in accs)) / t(n * (k + 1)))
            else:
                lookup._matched = matched
                K = lookup.choose(index_tensor([len(p) for p in props], CPU), Curve(t))
                if K:
                    ver = [min(len(p), K) for p in props]
                    lookup.observe(ver, [min(a, v) for a, v in zip(accs, ver, strict=True)])
            for i, p, a in zip(live, props, accs, strict=True):
                c = min(a, K, len(p)) + 1
                idx[i].extend(group[i][1][at[i]: at[i] + c])
                at[i] += c
                tokens, verified = tokens + c, verified + min(len(p), K)
            cost, row_rounds = cost + t(len(live) * (K + 1)), row_rounds + len(live)
    return (tokens / cost) / (sum(len(out) for _, out in runs) / plain), tokens / row_rounds, verified / row_rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=128)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--ngram", default="1,3", help="min,max n-gram size")
    ap.add_argument("--max-tokens", type=int, default=15)
    ap.add_argument("--rows", default="1", help="comma-separated batch sizes to replay (1: the one-row rules too)")
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
    for rows in (int(r) for r in a.rows.split(",")):
        for name, t in CURVES.items():
            for rule in ("geo", "draw", "full", "oracle") + (("depth",) if rows == 1 else ()):
                speed, tau, k = (replay(runs, rule, t, sizes, a.max_tokens) if rule == "depth"
                                 else replay_rows(runs, rows, rule, t, sizes, a.max_tokens))
                print(f"rows {rows} {name:10s} {rule:7s} x plain decoding {speed:.3f}  tau {tau:.2f}  "
                      f"lookup tokens/round {k:.2f}")


if __name__ == "__main__":
    main()
