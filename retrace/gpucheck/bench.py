"""`python -m retrace.gpucheck.bench OUTDIR [--dry-run]` (scripts/gpu_bench.sh): the runtime on a GPU.

Random-weight pairs built on the device (Qwen3-8B and Qwen3-0.6B shapes in bf16, a 5-layer and a 1-layer
drafter with a ReTrace conditioner; `--dry-run`: the same steps on the CPU at toy size, fp32), then per shape:
  timings    CUDA-event times (host timers on the CPU) of the target at T=1 and T=16, the draft call, and
             a whole round at fixed K (0, 3, 7, 15; the drafter runs, the policy verifies K drafts);
  tau        rounds whose drafts come from a greedy pre-pass (tau 1, 3, 6: acceptance controlled);
  reference  (a) a static-cache, CUDA-graph, greedy-on-device decoder written here on the same weights
             (gpucheck/static_reference.py: what vLLM, SGLang and gpt-fast do), (b) transformers' eager
             greedy decode, (c) the bandwidth roofline: one read of every weight, timed;
  profile    per round: kernel launches and synchronisations (torch.profiler), host reads and the bytes
             they bring back (every conversion of a tensor to host values, counted), and sync_sources: each
             synchronisation (and blocking copy) by aten op and the retrace line that asked for it;
  graphs     (the first drafter) the same calls and rounds with the steps captured as CUDA graphs per bucket
             (the backend's default on CUDA), padded but eager, and unpadded (runtime/step_buckets.py,
             runtime/cuda_graphs.py): times, captures, replays, and whether the tokens agree;
  windows    (the first target) batch 8 after a 2048-token past: the static-shape step placed at its slots
             against the same step gathered (a copy of every layer's window);
  row_invariance  (the first drafter) every target call at one width (the default on CUDA) against each call
             at its own width: bit-identical verify rows, plain decoding's cost, lossless at controlled tau.
OUTDIR/gpu_bench.json is rewritten after every section.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

SHAPES = {  # name -> (target layers, hidden, heads, kv heads, head_dim, MLP, vocab)
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936),
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936),
    "toy": (4, 64, 4, 2, 16, 96, 128),
}
KS = (0, 3, 7, 15)
TAUS = (1, 3, 6)


# -- building -------------------------------------------------------------------------------------------------
def build_pair(shape: str, draft_layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random Qwen3 target of `shape` and a drafter of `draft_layers` with a random conditioner, on device."""
    from retrace.models.conditioner import ReTraceConditioner
    from retrace.models.config import Qwen3Config
    from retrace.models.drafter import DFlashDrafter, new_drafter_config
    from retrace.models.target import Qwen3Target

    L, d, h, kv, hd, mlp, V = SHAPES[shape]
    cfg = Qwen3Config.from_dict({
        "vocab_size": V, "hidden_size": d, "num_hidden_layers": L, "num_attention_heads": h,
        "num_key_value_heads": kv, "head_dim": hd, "intermediate_size": mlp, "rms_norm_eps": 1e-6,
        "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "eos_token_id": V - 2}, Path(f"<{shape}>"))
    torch.manual_seed(seed)
    with torch.device(device):
        probe = Qwen3Target(cfg)
        dcfg = new_drafter_config(probe, num_layers=draft_layers, block_size=16)
        target = Qwen3Target(cfg, tap_layers=tuple(dcfg.target_layer_ids)).to(dtype)
        del probe
        drafter = DFlashDrafter(dcfg, target, ReTraceConditioner(d)).to(dtype)
    for p in list(target.parameters()) + list(drafter.parameters()):
        with torch.no_grad():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    drafter.conditioner.reset(init="random", seed=seed)
    drafter.conditioner.to(device=device, dtype=dtype)
    return target.eval().requires_grad_(False), drafter.eval().requires_grad_(False)


class FixedK:
    """A verify policy that always drafts and verifies exactly K drafts per row."""

    name = "fixed-k"

    def __init__(self, block_size: int, k: int):
        self.block_size, self.k = block_size, k

    def plan(self, mode, rows):
        return self.block_size - 1

    def choose(self, mode, draft_logits, drafts, q):
        from retrace.runtime.device import index_tensor

        return index_tensor([min(self.k, drafts.shape[1])] * drafts.shape[0], drafts.device)

    def observe(self, *args):
        pass


class PrepassDrafts:
    """A backend wrapper: the drafter runs, then its logits are replaced on the device so that slot k's
    draft is the greedy pre-pass token for k < tau - 1 and a wrong one after (acceptance tau exactly)."""

    def __init__(self, inner, sequences: torch.Tensor, tau: int):
        self.inner, self.seq, self.tau = inner, sequences, tau  # seq [slots, L]: prompt + greedy continuation

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix):
        hidden, logits = self.inner.draft(slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix)
        pos = block_positions[:, 1:].clamp_max(self.seq.shape[1] - 1)
        true = self.seq[slots.to(self.seq.device)].gather(1, pos)
        V = logits.shape[-1]
        slot = torch.arange(1, pos.shape[1] + 1, device=pos.device).unsqueeze(0)
        tok = torch.where(slot < self.tau, true, (true + 1) % (V - 2))
        forced = torch.full_like(logits, -10.0).scatter_(2, tok.unsqueeze(-1), 10.0)
        return hidden, forced


# -- measuring --------------------------------------------------------------------------------------------
def _timer(device):
    from retrace.runtime.stopwatch import stopwatch_for

    return stopwatch_for(device)


def time_call(fn, device, repeats: int) -> float:
    """Median seconds of fn() (device time on CUDA), after one warm-up call."""
    clock = _timer(device)
    fn()
    times = []
    for _ in range(repeats):
        a = clock.mark()
        fn()
        times.append(clock.seconds(a, clock.mark()))
    return sorted(times)[len(times) // 2]


class HostReads(TorchFunctionMode):
    """Counts the conversions of tensors to host values and the bytes they read."""

    FUNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}

    def __init__(self):
        super().__init__()
        self.count = self.bytes = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.FUNCS and args and isinstance(args[0], torch.Tensor):
            self.count += 1
            self.bytes += args[0].numel() * args[0].element_size()
        return func(*args, **(kwargs or {}))


def _runtime(backend, policy):
    from retrace.runtime import Runtime

    return Runtime(backend, None, verify_policy=policy, prompt_lookup=False)  # the rounds measured: the drafter's


def run_rounds(backend, prompts, mode, policy, new_tokens, device) -> dict:
    """Generate; -> ms per round and per token, tau, rounds (after one warm-up request)."""
    from retrace.runtime import SamplingParams

    rt = _runtime(backend, policy)
    rt.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True), mode)
    rt.reset_stats()
    clock = _timer(device)
    a = clock.mark()
    res = rt.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), mode)
    wall = clock.seconds(a, clock.mark())
    st = rt.run_stats()
    rounds = max(1, st["rounds"] // len(prompts))
    return {"ms_per_round": round(1e3 * wall / rounds, 3), "ms_per_token": round(1e3 * wall / st["tokens"], 3),
            "tau": st["tau"], "rounds": rounds, "tokens": st["tokens"], "token_ids": [r.token_ids for r in res]}


BLOCKING_COPY_OPS = ("aten::_local_scalar_dense", "aten::copy_", "aten::_to_copy", "aten::item")
_FRAME = re.compile(r"^(.+)\((\d+)\): (.+)$")  # "path/to/retrace/runtime/loop.py(123): fn_name"
_SKIP_FRAMES = ("retrace/gpucheck/bench.py",)  # HostReads.__torch_function__ sits under every host read


def _retrace_frame(frame: str) -> str | None:
    """'.../retrace/runtime/loop.py(123): fn' -> 'retrace/runtime/loop.py:123 fn'; None outside the package."""
    m = _FRAME.match(frame.strip())
    if not m:
        return None
    parts = m.group(1).replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] != "retrace":
            continue
        tail = parts[i + 1:]
        if tail and not any(t.startswith(".") or t in ("site-packages", "dist-packages") for t in tail):
            path = "/".join(parts[i:])
            return None if path in _SKIP_FRAMES else f"{path}:{m.group(2)} {m.group(3)}"
        return None
    return None


def sync_sources(events, rounds: int, top: int = 12) -> list[dict]:
    """Where the synchronisations come from: [{kind, op, where, per_round}], the `top` most frequent.

    `events`: profiler events (or stand-ins) with `name`, `cpu_parent` and `stack` only (torch 2.11 and 2.13
    agree on those). Counted: every event named *Synchronize*, and every cudaMemcpy* whose innermost aten op
    is a blocking copy (BLOCKING_COPY_OPS: a pageable host-to-device copy waits without a Synchronize event).
    op: the innermost enclosing aten op; where: the innermost frame in the retrace package, read from the
    events' `stack` lists (innermost first) or from the Python-function events in the `cpu_parent` chain
    (with_stack=True in torch 2.13 records frames as events); "(no python frame)" when there is none.
    """
    counts: Counter = Counter()
    for e in events:
        name = e.name
        if "Synchronize" not in name and not name.startswith("cudaMemcpy"):
            continue
        op = where = None
        node, depth = e, 0
        while node is not None and depth < 1000:
            if node is not e and op is None and node.name.startswith("aten::"):
                op = node.name
            if where is None:
                for frame in [*(getattr(node, "stack", None) or ()), node.name]:
                    where = _retrace_frame(frame)
                    if where:
                        break
            if op is not None and where is not None:
                break
            node, depth = node.cpu_parent, depth + 1
        if "Synchronize" not in name and op not in BLOCKING_COPY_OPS:
            continue
        counts[(name, op or "(no aten op)", where or "(no python frame)")] += 1
    return [{"kind": k, "op": o, "where": w, "per_round": round(n / max(1, rounds), 2)}
            for (k, o, w), n in counts.most_common(top)]


def profile_round(backend, prompts, mode, policy, new_tokens, device) -> dict:
    """Per round: kernel launches and synchronisations (CUDA; on the CPU: aten ops), host reads and bytes;
    sync_sources: where each synchronisation comes from (sync_sources(); sync_sources_error if that failed)."""
    from torch.profiler import ProfilerActivity, profile

    from retrace.runtime import SamplingParams

    rt = _runtime(backend, policy)
    rt.generate(prompts[:1], SamplingParams(max_new_tokens=4, ignore_eos=True), mode)
    rt.reset_stats()
    reads = HostReads()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, with_stack=True) as prof, reads:
        rt.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True), mode)
    rounds = max(1, rt.run_stats()["rounds"] // len(prompts))
    names = [e.name for e in prof.events()]
    launches = sum(n in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch") for n in names)
    syncs = sum("Synchronize" in n for n in names)
    aten = sum(n.startswith("aten::") for n in names)
    out = {"rounds": rounds, "kernel_launches_per_round": round(launches / rounds, 1),
           "synchronizations_per_round": round(syncs / rounds, 2), "aten_ops_per_round": round(aten / rounds, 1),
           "host_reads_per_round": round(reads.count / rounds, 2),
           "host_read_bytes_per_round": round(reads.bytes / rounds, 1)}
    try:
        out["sync_sources"] = sync_sources(prof.events(), rounds)
    except Exception as e:  # noqa: BLE001 - the profiler's event API moves between torch versions
        out["sync_sources_error"] = f"{type(e).__name__}: {e}"
    return out


def call_timings(backend, device, repeats: int, past: int) -> dict:
    """Target at T=1 and T=16 and one draft call (16 new context taps) at `past` on slot 0."""
    from retrace.runtime.device import index_tensor

    slot = index_tensor([0], device)
    out = {}
    for T in (1, 16):
        ids = torch.zeros(1, T, dtype=torch.int64, device=device)
        pos = index_tensor([list(range(past, past + T))], device)
        li = torch.arange(T, device=device).unsqueeze(0)
        call = lambda ids=ids, pos=pos, li=li: backend.target(slot, ids, pos, li)  # noqa: E731
        out[f"target_T{T}_ms"] = round(1e3 * time_call(call, device, repeats), 3)
    dc, tc = backend.drafter_config, backend.target_config
    taps = torch.zeros(1, 16, tc.hidden_size * dc.num_taps, device=device, dtype=backend.dtype)
    ctx_pos = index_tensor([list(range(past - 16, past))], device)
    block = torch.full((1, dc.block_size), dc.mask_token_id, dtype=torch.int64, device=device)
    bpos = index_tensor([list(range(past, past + dc.block_size))], device)
    out["draft_ms"] = round(1e3 * time_call(lambda: backend.draft(slot, taps, ctx_pos, block, bpos, None), device,
                                            repeats), 3)
    return out


def roofline(target, device, repeats: int) -> dict:
    """One read of every weight, timed: the floor of a decode step that must read them all."""
    params = list(target.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params)
    s = time_call(lambda: [p.amax() for p in params], device, repeats)
    return {"weight_bytes": nbytes, "read_all_weights_ms": round(1e3 * s, 3),
            "bandwidth_GBps": round(nbytes / s / 1e9, 1)}


def hf_eager(target, prompt: list[int], n: int, device) -> dict:
    """transformers' eager greedy decode on the same weights (copied into its own model)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = target.config.layers
    cfg = Qwen3Config(vocab_size=target.config.vocab_size, hidden_size=c.hidden_size,
                      num_hidden_layers=c.num_hidden_layers,
                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                      head_dim=c.head_dim, intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps,
                      rope_theta=c.rope_theta, max_position_embeddings=4096, tie_word_embeddings=False,
                      attn_implementation="eager")
    with torch.device(device):
        hf = Qwen3ForCausalLM(cfg).to(target.lm_head.weight.dtype)
    hf.load_state_dict(target.state_dict(), strict=False)  # the same names (lm_head, model.*)
    hf.eval()
    ids = torch.tensor([prompt], device=device)
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, temperature=None, top_p=None, top_k=None,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    hf.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
    clock = _timer(device)
    a = clock.mark()
    out = hf.generate(ids, **kw)
    s = clock.seconds(a, clock.mark())
    return {"ms_per_token": round(1e3 * s / n, 3), "token_ids": out[0, len(prompt):].tolist()}


def reference(target, prompt: list[int], n: int, device) -> dict:
    from retrace.gpucheck.static_reference import StaticGreedy

    ref = StaticGreedy(target, len(prompt) + n + 8)
    ref.capture()
    ref.generate(prompt, 3)
    clock = _timer(device)
    a = clock.mark()
    toks = ref.generate(prompt, n)
    s = clock.seconds(a, clock.mark())
    return {"ms_per_token": round(1e3 * s / n, 3), "cuda_graph": ref.graph is not None, "token_ids": toks}


def graphs_section(target, drafter, prompts, new: int, max_len: int, device, repeats: int) -> dict:
    """The backend's steps as CUDA graphs (CUDA only), padded to their buckets but eager, and unpadded."""
    from retrace.runtime.torch_backend import TorchBackend

    variants = {"unpadded_eager": dict(cuda_graphs=False, static_shapes=False),  # each call at its own width
                "padded_eager": dict(cuda_graphs=False, static_shapes=True)}         # (row invariance: its section)
    if device.type == "cuda":
        variants["cuda_graphs"] = dict(cuda_graphs=True)
    variants = {name: {**kw, "row_invariant": False} for name, kw in variants.items()}
    out, tokens = {}, {}
    for name, kw in variants.items():
        be = TorchBackend(target, drafter, max_batch=1, max_seq_len=max_len, device=device, **kw)
        calls = call_timings(be, device, repeats, past=len(prompts[0]))
        ar = run_rounds(be, prompts, "ar", "fixed", new, device)
        k15 = run_rounds(be, prompts, "retrace", FixedK(16, 15), new, device)
        tokens[name] = (ar["token_ids"], k15["token_ids"])
        out[name] = {"calls": calls, "ar_ms_per_token": ar["ms_per_token"],
                     "retrace_k15_ms_per_round": k15["ms_per_round"], "retrace_k15_tau": k15["tau"],
                     "captures": be.runner.captures, "replays": be.runner.replays,
                     "buckets": len(getattr(be.runner, "calls", ())),
                     "capture_failed": getattr(be.runner, "failed", None)}
        del be
    first = next(iter(tokens.values()))
    out["same_tokens"] = all(t == first for t in tokens.values())
    return out


def windows_section(target, device, repeats: int, past: int, rows: int = 8) -> dict:
    """Plain decoding and a 4-token verify at batch `rows` after a `past`-token prefill of every slot: the
    static-shape step placed at its slots (views of the caches, runtime/step_buckets.py `slot_order`) against
    the same step gathered (a copy of every layer's window: every call before 2026-12-06), in the backend's
    default runner (CUDA graphs on CUDA), alternating. docs/static-cache.md worked the copy out at ~60% more
    K/V traffic per decode at the 8B shape, batch 8, a 2048-column window."""
    from retrace.runtime.device import index_tensor
    from retrace.runtime.torch_backend import TorchBackend

    be = TorchBackend(target, None, max_batch=rows, max_seq_len=past + 32, device=device, row_invariant=False,
                      static_shapes=True)
    for s in range(rows):
        be.target(index_tensor([s], device), torch.zeros(1, past, dtype=torch.int64, device=device),
                  index_tensor([list(range(past))], device), index_tensor([[past - 1]], device))
    slots = index_tensor(list(range(rows)), device)
    out = {"rows": rows, "past": past}
    for T in (1, 4):
        ids = torch.zeros(rows, T, dtype=torch.int64, device=device)
        pos = index_tensor([list(range(past, past + T))] * rows, device)
        li = index_tensor([list(range(T))] * rows, device)
        call = lambda ids=ids, pos=pos, li=li: be.target(slots, ids, pos, li)  # noqa: E731
        for name, place_rows in (("placed", True), ("gathered", False)):
            be.place_rows = place_rows
            out[f"{name}_T{T}_ms"] = round(1e3 * time_call(call, device, repeats), 3)
        out[f"gathered_over_placed_T{T}"] = round(out[f"gathered_T{T}_ms"] / out[f"placed_T{T}_ms"], 3)
    out["buckets"] = sorted({(b.rows, b.width, b.window, b.variant[-1]) for b in be.runner.calls})
    return out


def invariance_section(target, drafter, prompts, new: int, max_len: int, device, seq_of, ar_on: dict,
                       taus_on: dict) -> dict:
    """Row invariance on (the backend's default on CUDA) against off (runtime/torch_backend.py): whether a
    verify row is the decode step's bits (`rows_matching_decodes`, T = 2..16 after a 100-token past), what
    plain decoding costs, and whether speculative output at controlled tau equals plain decoding's. The "on"
    rounds are the shape section's own (ar_on: its `ar` run, taus_on: its controlled_tau), not run again."""
    from retrace.runtime.row_invariance import rows_matching_decodes
    from retrace.runtime.torch_backend import TorchBackend

    def rows(on: bool) -> dict:
        two = TorchBackend(target, drafter, max_batch=2, max_seq_len=max_len, device=device, row_invariant=on)
        got = rows_matching_decodes(two, widths=(2, 3, 4, 8, 9, 16), prefill=min(100, max_len - 32))
        return {str(w): n for w, n in got.items()}

    def side(ar: dict, taus: dict, on: bool) -> dict:
        return {"rows_matching_decodes": rows(on), "ar_ms_per_token": ar["ms_per_token"],
                "controlled_tau_k15": {t: {k: taus[t][k] for k in ("ms_per_token", "tau", "lossless")}
                                       for t in map(str, TAUS[1:])}}

    be = TorchBackend(target, drafter, max_batch=1, max_seq_len=max_len, device=device, row_invariant=False)
    ar_off = run_rounds(be, prompts, "ar", "fixed", new, device)
    taus_off = {}
    for tau in TAUS[1:]:
        r = run_rounds(PrepassDrafts(be, seq_of(ar_off), tau), prompts, "retrace", FixedK(16, 15), new, device)
        taus_off[str(tau)] = {**r, "lossless": r["token_ids"] == ar_off["token_ids"]}
    del be
    return {"on": side(ar_on, taus_on, True), "off": side(ar_off, taus_off, False),
            "ar_same_tokens_on_and_off": ar_on["token_ids"] == ar_off["token_ids"]}


# -- the sections -----------------------------------------------------------------------------------------
def shape_section(result: dict, shape: str, device, dtype, dry: bool, save) -> None:
    from retrace.runtime.torch_backend import TorchBackend

    new = 8 if dry else 64
    repeats = 3 if dry else 20
    g = torch.Generator().manual_seed(0)
    V = SHAPES[shape][-1]
    prompts = [torch.randint(0, V - 2, (24 if dry else 128,), generator=g).tolist()]
    for draft_layers in ((1, 2) if dry else (5, 1)):
        target, drafter = build_pair(shape, draft_layers, device, dtype)
        max_len = len(prompts[0]) + new + 64
        # row invariance on as on CUDA by default (the dry run on the CPU too: the same steps)
        be = TorchBackend(target, drafter, max_batch=1, max_seq_len=max_len, device=device, row_invariant=True)
        key = f"drafter{draft_layers}"
        part = result[key] = {}
        part["calls"] = call_timings(be, device, repeats, past=len(prompts[0]))
        save()
        ar = run_rounds(be, prompts, "ar", "fixed", new, device)
        part["ar"] = {k: v for k, v in ar.items() if k != "token_ids"}
        part["fixed_k"] = {str(k): {kk: v for kk, v in run_rounds(be, prompts, "retrace", FixedK(16, k), new,
                                                                       device).items() if kk != "token_ids"}
                           for k in KS}
        save()
        def seq_of(ar):  # the sequence a greedy pre-pass makes the drafts right along
            return torch.tensor([prompts[0] + ar["token_ids"][0] + [0] * 32], device=device)

        seq = seq_of(ar)
        part["controlled_tau"] = {}
        for tau in TAUS:
            r = run_rounds(PrepassDrafts(be, seq, tau), prompts, "retrace", FixedK(16, 15), new, device)
            part["controlled_tau"][str(tau)] = {**{k: v for k, v in r.items() if k != "token_ids"},
                                                "lossless": r["token_ids"] == ar["token_ids"]}
        save()
        part["profile"] = {"ar": profile_round(be, prompts, "ar", "fixed", new, device),
                           "retrace_k15": profile_round(be, prompts, "retrace", FixedK(16, 15), new, device)}
        save()
        if draft_layers == ((1, 2) if dry else (5, 1))[0]:
            part["graphs"] = graphs_section(target, drafter, prompts, new, max_len, device, repeats)
            save()
            part["windows"] = windows_section(target, device, repeats, past=48 if dry else 2048)
            save()
            part["row_invariance"] = invariance_section(target, drafter, prompts, new, max_len, device, seq_of,
                                                        ar, part["controlled_tau"])
            save()
            ref = reference(target, prompts[0], new, device)
            result["reference_static_cuda_graph"] = {**{k: v for k, v in ref.items() if k != "token_ids"},
                                                     "same_tokens_as_ar": ref["token_ids"] == ar["token_ids"][0]}
            save()
            hf = hf_eager(target, prompts[0], new, device)
            result["transformers_eager"] = {"ms_per_token": hf["ms_per_token"],
                                            "same_tokens_as_ar": hf["token_ids"] == ar["token_ids"][0]}
            result["roofline"] = roofline(target, device, repeats)
            save()
        del be, target, drafter
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m retrace.gpucheck.bench", description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="CPU, toy size, fp32 (what the test suite runs)")
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="the weights' dtype (default: bfloat16 on CUDA, float32 on the CPU)")
    ap.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES) + " (default: the two Qwen3)")
    a = ap.parse_args(argv)
    a.outdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from retrace.gpucheck.record import Report, log
    from retrace.runtime.device import resolve_dtype

    cuda = torch.cuda.is_available() and not a.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = resolve_dtype(a.dtype) if a.dtype else torch.bfloat16 if cuda else torch.float32
    shapes = a.shapes.split(",") if a.shapes else (["toy"] if a.dry_run else ["qwen3-8b", "qwen3-0.6b"])
    rep = Report(a.outdir / "gpu_bench.json", {"dry_run": a.dry_run, "device": str(device), "dtype": str(dtype),
                                                "shapes": shapes, "torch": torch.__version__,
                                                "gpu": torch.cuda.get_device_name() if cuda else None,
                                                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if not cuda and not a.dry_run:
        log("WARNING: CUDA is not available: running on the CPU")
    for shape in shapes:
        rep.run(shape, lambda r, s=shape: shape_section(r, s, device, dtype, a.dry_run, rep.write))
    return 0


if __name__ == "__main__":
    sys.exit(main())
