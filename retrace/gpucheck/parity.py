"""Section `parity`: the torch backend on the device against the CPU reference (carried JSON).

fp32: every mode's token ids must equal the CPU's (TF32 is switched off for this section). bf16 changes
the target itself, so against the CPU it reports how many prompts are identical and the first divergence;
in bf16 dflash and retrace should equal bf16 AR on the device token for token, with one caveat the report
must be read with: a B-token verify and a 1-token decode are different kernels that round differently in
bf16, so a near-tie can flip (seen on CPU with a random pair, never with the trained zoo pair); a
divergence there is reported with its position, and only fp32 divergences are bugs for certain.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from retrace.gpucheck import decode
from retrace.gpucheck.record import log

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(got: list[list[int]], want: list[list[int]]) -> dict:
    div = [first_divergence(g, w) for g, w in zip(got, want, strict=True)]
    return {"identical": sum(d is None for d in div), "n": len(div),
            "first_divergence": [d for d in div if d is not None]}


def run(result: dict, zoo: Path, reference: Path, device: torch.device, dtypes=("fp32", "bf16"),
        max_new_tokens: int | None = None) -> None:
    """`max_new_tokens` < the reference's compares prefixes (greedy decoding of k tokens = the first k)."""
    ref = json.loads(Path(reference).read_text())
    prompts, max_new = ref["prompts"], min(max_new_tokens or ref["max_new_tokens"], ref["max_new_tokens"])
    for r in ref["runs"].values():
        r["token_ids"] = [ids[:max_new] for ids in r["token_ids"]]
    result.update({"zoo": str(zoo), "reference": str(reference), "n_prompts": len(prompts),
                   "max_new_tokens": max_new, "reference_torch": ref.get("torch")})
    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        for dt in dtypes:
            target, drafter = decode.load(zoo, DTYPES[dt], device)
            runs = result[dt] = {}
            for key in ref["runs"]:
                mode, batch = key.rsplit("_b", 1)
                r = decode.greedy(target, drafter, prompts, mode, int(batch), max_new, device)
                entry = {"tau": r["tau"], "tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"],
                         "cpu_tau": ref["runs"][key]["tau"], "cpu_tokens_per_s": ref["runs"][key]["tokens_per_s"],
                         "vs_cpu": compare(r["token_ids"], ref["runs"][key]["token_ids"])}
                if mode != "ar":
                    entry["vs_device_ar"] = compare(r["token_ids"], runs[f"ar_b{batch}"]["_ids"])
                entry["_ids"] = r["token_ids"]
                runs[key] = entry
                log(f"parity {dt} {key}: tau {r['tau']}, {r['tokens_per_s']} tok/s, vs cpu "
                    f"{entry['vs_cpu']['identical']}/{entry['vs_cpu']['n']}"
                    + (f", vs device ar {entry['vs_device_ar']['identical']}/{entry['vs_device_ar']['n']}"
                       if "vs_device_ar" in entry else ""))
            for e in runs.values():
                e.pop("_ids")
            del target, drafter
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    result["checks"] = checks(result, dtypes)


def checks(result: dict, dtypes) -> dict:
    out = {}
    if "fp32" in dtypes:
        out["fp32_all_modes_equal_cpu"] = all(e["vs_cpu"]["identical"] == e["vs_cpu"]["n"]
                                              for e in result["fp32"].values())
    for dt in dtypes:
        out[f"{dt}_lossless_vs_device_ar"] = all(e["vs_device_ar"]["identical"] == e["vs_device_ar"]["n"]
                                                 for e in result[dt].values() if "vs_device_ar" in e)
    return out
