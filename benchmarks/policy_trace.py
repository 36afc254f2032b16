"""What the adaptive verify policy expected against what its rounds gave (not a test).

    python benchmarks/policy_trace.py --engine BUNDLE --prompts ZOO/prompts [--limit 8] [--batch 4]
                                      [--max-new-tokens 96] [--mode retrace] [--threads 2] [--json OUT]

One backend, one process: an `ar` pass (the plain-decoding reference: its tokens/s and outputs), then the
mode under a traced AdaptivePolicy. For every drafted round the trace keeps what the policy predicted when it
chose K (the draft call's and the verify's seconds from its cost model, the expected accepted drafts summed
over the rows from its calibration) and what the round then measured (the two calls' seconds, the accepted
drafts). The summary groups the rounds by (rows, draft slots S, verified drafts K) and prints the ratio of
measured to predicted for each part, and the rate the policy expected against the one the rounds gave. Where
the ratio of the rates is far from 1, the part whose ratio is off is the part of the policy to fix.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

from retrace.bench.prompts import load_prompts
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.verify_policy import AdaptivePolicy, draft_confidence


class TracedPolicy(AdaptivePolicy):
    """The adaptive policy, recording each chain round's prediction (choose) and outcome (observe)."""

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.rounds: list[dict] = []
        self._pending: dict | None = None

    def choose(self, mode, draft_logits, drafts, q):
        N, S = drafts.shape
        conf = draft_confidence(draft_logits, q)
        p = self._calibration(mode, True, conf.device).prob(conf).double()  # greedy rows (the trace's runs)
        expected = p.cumprod(1).cumsum(1)  # [N, S]: E[a | K] per row, K = 1..S
        t_draft = self.cost.draft(N, S)
        K = super().choose(mode, draft_logits, drafts, q)
        k = int(K[0])
        self._pending = {"rows": N, "slots": S, "k": k, "pred_draft_s": t_draft,
                         "pred_verify_s": self.cost.verify(N, k + 1),
                         "pred_accepted": float(expected[:, k - 1].sum()) if k else 0.0}
        return K

    def observe(self, mode, rows, verify_tokens, verify_s, draft_s, verified, accepted):
        if self._pending is not None and verified is not None:
            self.rounds.append({**self._pending, "draft_s": draft_s, "verify_s": verify_s,
                                "accepted": int(accepted.sum())})
        elif verified is None:
            self.rounds.append({"rows": rows, "slots": 0, "k": 0, "verify_s": verify_s, "accepted": 0})
        self._pending = None
        super().observe(mode, rows, verify_tokens, verify_s, draft_s, verified, accepted)


def summarize(rounds: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rounds:
        groups[r["rows"], r["slots"], r["k"]].append(r)
    out = []
    for (n, s, k), rs in sorted(groups.items()):
        row = {"rows": n, "slots": s, "k": k, "rounds": len(rs),
               "verify_s": sum(r["verify_s"] for r in rs) / len(rs)}
        if s:
            timed = [r for r in rs if r["draft_s"] is not None]
            row.update(
                draft_s=sum(r["draft_s"] for r in timed) / len(timed) if timed else float("nan"),
                pred_draft_s=sum(r["pred_draft_s"] for r in rs) / len(rs),
                pred_verify_s=sum(r["pred_verify_s"] for r in rs) / len(rs),
                accepted=sum(r["accepted"] for r in rs) / len(rs),
                pred_accepted=sum(r["pred_accepted"] for r in rs) / len(rs))
            row["pred_rate"] = (n + row["pred_accepted"]) / (row["pred_draft_s"] + row["pred_verify_s"])
            row["rate"] = (n + row["accepted"]) / (row["draft_s"] + row["verify_s"])
        else:
            row["rate"] = n / row["verify_s"]
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--mode", default="retrace")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rt = Runtime.from_bundle(a.engine, max_batch=a.batch, threads=a.threads)
    prompts = [p.ids for p in load_prompts([a.prompts], rt.codec, limit=a.limit)]
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    policy = TracedPolicy(rt.scheduler().block_size)
    traced = Runtime(rt.backend, rt.codec, verify_policy=policy, prompt_lookup=False)
    rt.generate(prompts[:1], SamplingParams(max_new_tokens=4), "ar")  # warm-up
    results = {}
    for name, runtime, mode in (("ar", rt, "ar"), (a.mode, traced, a.mode)):
        t0, outs = time.perf_counter(), []
        for i in range(0, len(prompts), a.batch):
            outs += [r.token_ids for r in runtime.generate(prompts[i:i + a.batch], params, mode)]
        results[name] = {"wall_s": time.perf_counter() - t0, "tokens": sum(map(len, outs)), "outputs": outs}
    ar, spec = results["ar"], results[a.mode]
    rows = summarize(policy.rounds)
    print(f"ar {ar['tokens'] / ar['wall_s']:.2f} tok/s, {a.mode} {spec['tokens'] / spec['wall_s']:.2f} tok/s "
          f"({spec['wall_s'] and ar['wall_s'] / spec['wall_s']:.2f}x), same tokens: {spec['outputs'] == ar['outputs']}")
    print(f"{'N':>2} {'S':>2} {'K':>2} {'rounds':>6} {'draft ms':>14} {'verify ms':>14} {'accepted':>12} "
          f"{'rate tok/s':>14}   (measured / predicted)")
    for r in rows:
        if r["slots"]:
            print(f"{r['rows']:2d} {r['slots']:2d} {r['k']:2d} {r['rounds']:6d} "
                  f"{r['draft_s'] * 1e3:6.1f}/{r['pred_draft_s'] * 1e3:6.1f} "
                  f"{r['verify_s'] * 1e3:6.1f}/{r['pred_verify_s'] * 1e3:6.1f} "
                  f"{r['accepted']:5.2f}/{r['pred_accepted']:5.2f} {r['rate']:6.1f}/{r['pred_rate']:6.1f}")
        else:
            print(f"{r['rows']:2d}  -  0 {r['rounds']:6d} {'':>14} {r['verify_s'] * 1e3:6.1f}{'':>8} {'':>12} "
                  f"{r['rate']:6.1f}")
    if a.json:
        with open(a.json, "w") as f:
            args = sys.argv[1:] if argv is None else argv
            json.dump({"command": "python benchmarks/policy_trace.py " + " ".join(args),
                       "ar_tok_s": ar["tokens"] / ar["wall_s"], "tok_s": spec["tokens"] / spec["wall_s"],
                       "same_tokens": spec["outputs"] == ar["outputs"], "groups": rows,
                       "policy": policy.to_dict()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
