"""Build-time self-check: run the exported graphs in ONNX Runtime against the torch modules.

The cases are the shapes the runtime uses: target prefill (P = 0, ragged past), decode (T = 1) and verify
(T = block); drafter first round (context = prompt, no past), a later round (context = block, with past),
with suffix inputs (ReTrace) and without (valid = 0 on a ReTrace graph must equal torch's suffix=None).
The check is on logits: max |ORT - torch| <= tolerance * max(1, max |torch logits|), i.e. an absolute
tolerance for logits of order 1, relative for larger ones (real checkpoints have logits of 10-40, where
fp32 reordering alone reaches ~1e-5 relative). Taps, hidden states and K/V differences are reported too.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from retrace.errors import RetraceError
from retrace.export.onnx_export import causal_mask, drafter_inputs, drafter_io, target_inputs, target_io
from retrace.models.drafter import DFlashDrafter, SuffixInputs
from retrace.models.target import Qwen3Target

TOLERANCE = {"float32": 1e-4, "float16": 3e-2}


class ParityError(RetraceError):
    """ONNX Runtime's output differs from the torch module's beyond the tolerance."""


def session(path: str | Path, threads: int | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _diff(a, b: torch.Tensor) -> float:
    a = np.asarray(a, dtype=np.float32)
    b = b.detach().float().numpy()
    return float(np.abs(a - b).max()) if a.size else 0.0


def _case(ort_out: list, ref: tuple[torch.Tensor, ...], names: list[str]) -> dict:
    logits = _diff(ort_out[names.index("logits")], ref[0])
    second = "taps" if "taps" in names else "hidden"
    kv = max((_diff(o, r) for o, r in zip(ort_out[2:], ref[2:], strict=True)), default=0.0)
    return {"logits": logits, second: _diff(ort_out[names.index(second)], ref[1]), "kv": kv,
            "scale": float(ref[0].detach().float().abs().max()) if ref[0].numel() else 0.0}


def target_parity(target: Qwen3Target, path: str | Path, block_size: int = 16, sess=None) -> dict:
    sess = sess or session(path)
    L = target.config.num_hidden_layers
    tree = "tree_mask" in {i.name for i in sess.get_inputs()}
    names_in, names_out = target_io(L, tree)
    cases = {
        "prefill": dict(N=2, T=7, P=0, K=7),
        "decode": dict(N=2, T=1, P=9, K=1),
        "verify": dict(N=2, T=block_size, P=9, K=block_size),
    }
    if tree:
        cases["tree"] = dict(N=2, T=block_size, P=9, K=block_size)
    out = {}
    for i, (name, c) in enumerate(cases.items()):
        args = target_inputs(target, c["N"], c["T"], c["P"], c["K"], seed=100 + i)
        mask = None
        if tree:  # a chain's causal mask, or a tree's: node m's parent is a random earlier node
            mask = causal_mask(c["N"], c["T"])
            if name == "tree":
                mask = random_tree_mask(c["N"], c["T"], seed=100 + i)
            args = (*args, mask)
        past = args[4:4 + 2 * L]
        with torch.no_grad():
            logits, taps, nk, nv = target(args[0], args[1], list(past[0::2]), list(past[1::2]), args[2], args[3],
                                          tree_mask=mask)
        ref = (logits, taps, *[t for kv in zip(nk, nv, strict=True) for t in kv])
        got = sess.run(names_out, {n: a.numpy() for n, a in zip(names_in, args, strict=True)})
        out[name] = _case(got, ref, names_out)
    return out


def random_tree_mask(n: int, t: int, seed: int) -> torch.Tensor:
    """[n, t, t] ancestor-or-self mask of random trees (node m's parent uniform over 0..m-1)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.eye(t, dtype=torch.bool).repeat(n, 1, 1)
    for row in range(n):
        for m in range(1, t):
            mask[row, m] |= mask[row, int(torch.randint(0, m, (1,), generator=g))]
    return mask


def drafter_parity(drafter: DFlashDrafter, path: str | Path, block_size: int = 16, sess=None) -> dict:
    sess = sess or session(path)
    L = drafter.config.layers.num_hidden_layers
    has_suffix = drafter.conditioner is not None
    names_in, names_out = drafter_io(L, has_suffix)
    B = block_size
    cases = {"first_round": dict(C=7, P=0, suffix=False), "dflash": dict(C=B, P=9, suffix=False)}
    if has_suffix:
        cases["retrace"] = dict(C=B, P=9, suffix=True)
    out = {}
    for i, (name, c) in enumerate(cases.items()):
        args = drafter_inputs(drafter, 2, c["C"], B, c["P"], suffix=has_suffix, seed=200 + i,
                              valid_all_zero=not c["suffix"])
        n = 5 + 2 * L
        suffix = SuffixInputs(*args[n:]) if c["suffix"] else None  # torch: None; graph: valid = 0
        with torch.no_grad():
            hidden, logits, nk, nv = drafter(args[0], args[1], list(args[5:n:2]), list(args[6:n:2]), args[4],
                                             args[2], args[3], suffix)
        ref = (logits, hidden, *[t for kv in zip(nk, nv, strict=True) for t in kv])
        got = sess.run(names_out, {nm: a.numpy() for nm, a in zip(names_in, args, strict=True)})
        got = [got[1], got[0], *got[2:]]  # logits first, like ref
        out[name] = _case(got, ref, ["logits", "hidden", *names_out[2:]])
    return out


def check(results: dict[str, dict], tolerance: float, graph: str) -> float:
    """Raise ParityError for the worst case beyond tolerance; returns the worst scaled logits error."""
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ParityError(f"parity tolerance must be a finite number >= 0, got {tolerance!r}")
    worst_name, worst = None, 0.0
    for name, r in results.items():
        if not all(math.isfinite(float(v)) for v in r.values() if isinstance(v, int | float)):
            raise ParityError(f"{graph} graph parity check failed: non-finite values (NaN or inf) in the {name} "
                              "case (logits, hidden states or caches). The checkpoint's weights are probably NaN/inf; "
                              "check them (the exported graph would compute garbage)")
        err = r["logits"] / max(1.0, r["scale"])
        if err > worst:
            worst_name, worst = name, err
    if worst > tolerance:
        r = results[worst_name]
        raise ParityError(
            f"{graph} graph parity check failed: ONNX Runtime's logits differ from torch's by {r['logits']:.3g} "
            f"(max |logit| {r['scale']:.3g}) in the {worst_name} case, tolerance {tolerance:g} x max(1, max |logit|). "
            "The exported graph does not compute what the checkpoint does; this is a bug in the exporter or in "
            "onnxruntime (try --attention decomposed, or report it with this message)")
    return worst
