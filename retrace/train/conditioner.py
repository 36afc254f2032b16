"""`retrace train conditioner`: train the ReTrace conditioner on-policy on a frozen DFlash drafter + target.

A run is a sequence of phases. Each phase rolls out real draft/verify rounds with the CURRENT conditioner
through the runtime's Scheduler (batched, right-padded, per-row positions; `rollout.RecordingBackend`
records, for every round that has a rejected suffix from the previous round, exactly the suffix inputs
the runtime fed the drafter: memory, reliability features, valid mask and the verify taps at corr_index).
Then it trains on those rounds: each recorded round becomes one block [anchor, MASK...] at p', fused with
its suffix by the conditioner, with the DFlash weighted loss against the target's continuation at
p'+1..p'+B-1 (the rolled-out sequence itself: lossless decoding = the target's own output). All rounds of
a sequence share one drafter forward (context K/V once, `blocks.block_forward`).

Logged per phase: loss with the conditioner vs the DFlash loss on the same blocks, estimated tau of both,
the mean gate on valid slots (a conditioner that switched itself off shows gate -> 0), and the real
runtime tau of dflash vs retrace on validation prompts (a split of the TRAINING prompts).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from retrace.errors import RetraceError
from retrace.models.checkpoint import atomic_write_text
from retrace.models.conditioner import ReTraceConditioner
from retrace.models.config import DrafterConfig
from retrace.models.draft_vocab import META as DRAFT_VOCAB_META
from retrace.models.drafter import DFlashDrafter
from retrace.train import blocks as bl
from retrace.train import common as cm
from retrace.train import distributed as dist
from retrace.train import fsdp as fs
from retrace.train.batches import SeqSampler
from retrace.train.config import ConditionerConfig
from retrace.train.datasets_io import prepare_prompts
from retrace.train.evaluate import runtime_tau
from retrace.train.fit import Budget, FitState, fit
from retrace.train.rollout import Rollout, rollout
from retrace.train.taps import compute_taps, load_target, pad_taps, pad_tokens

TAG = "train conditioner"


# -- examples from rollouts ------------------------------------------------------------------------------------
@dataclass
class Examples:
    """Rolled-out sequences with their recorded rounds and clean target taps (training data of one phase)."""

    rolls: list[Rollout]
    taps: list[torch.Tensor]

    def usable(self) -> list[int]:
        return [i for i, r in enumerate(self.rolls) if r.rounds]


def collect(target, drafter, prompts, cfg: ConditionerConfig, device, seed: int, keep_empty: bool,
            progress: bool) -> Examples:
    """Roll out `prompts` (split across the rollout temperatures) and compute clean taps of the results."""
    drafter.eval()
    rolls: list[Rollout] = []
    temps = list(cfg.rollout_temperatures) or [0.0]
    B = cfg.block_size or drafter.config.block_size
    for ti, T in enumerate(temps):
        part = prompts[ti::len(temps)]
        if part:
            rolls += rollout(target, drafter, part, cfg.max_new_tokens, cfg.rollout_batch, T, seed + 1000 * ti,
                             block_size=B, device=device, keep_empty=keep_empty)
    taps = compute_taps(target, [r.tokens for r in rolls], cfg.rollout_batch, device)
    return Examples(rolls, taps)


def collate(ex: Examples, idx: list[int], picks: list[list[int]], B: int, device, mask_id: int):
    """-> (taps [N,S,kd], block_ids [N,nb,B], labels [N,nb,B-1], anchors [N,nb], block weight [N,nb], BlockSuffix)."""
    rolls = [ex.rolls[i] for i in idx]
    ids, lengths = pad_tokens([r.tokens for r in rolls], device)
    taps = pad_taps([ex.taps[i] for i in idx], device)
    N, nb = len(idx), max(1, max(len(p) for p in picks))
    r0 = rolls[0].rounds[picks[0][0]] if picks[0] else next(r.rounds[0] for r in rolls if r.rounds)
    d, F, kd = r0.memory.shape[-1], r0.features.shape[-1], r0.corr_taps.shape[-1]
    anchors = torch.zeros(N, nb, dtype=torch.long)
    bw = torch.zeros(N, nb)
    mem = torch.zeros(N, nb, B, d)
    feat = torch.zeros(N, nb, B, F)
    valid = torch.zeros(N, nb, B)
    corr = torch.zeros(N, nb, B, kd)
    for n, (r, pk) in enumerate(zip(rolls, picks, strict=True)):
        for b, k in enumerate(pk):
            rec = r.rounds[k]
            anchors[n, b] = rec.anchor_pos
            bw[n, b] = 1.0
            mem[n, b], feat[n, b], valid[n, b], corr[n, b] = rec.memory, rec.features, rec.valid, rec.corr_taps
    anchors, bw = anchors.to(device), bw.to(device)
    block_ids, labels = bl.block_inputs(ids, anchors, B, mask_id, torch.tensor(lengths, device=device))
    suffix = bl.BlockSuffix(mem.to(device), feat.to(device), valid.to(device), corr.to(device))
    return taps, block_ids, labels, anchors, bw, suffix


def pick_rounds(ex: Examples, idx: list[int], nb: int, gen: torch.Generator | None) -> list[list[int]]:
    out = []
    for i in idx:
        n = len(ex.rolls[i].rounds)
        if gen is None:
            out.append(list(range(min(n, nb))))
        else:
            out.append(sorted(torch.randperm(n, generator=gen)[:nb].tolist()))
    return out


def block_losses(drafter, ex: Examples, idx, picks, B, weights, device, bf16, with_baseline: bool, model=None,
                 objective: str = bl.objectives.DEFAULT):
    """(loss with the conditioner, stats, baseline stats or None, mean gate on valid slots); `model`: the
    DDP/FSDP-wrapped BlockModel that takes the gradients under torchrun; `objective`: the trained loss's slot
    weights (retrace.train.objectives; the stats' tau_est and top-1 do not depend on it)."""
    taps, block_ids, labels, anchors, bw, suffix = collate(ex, idx, picks, B, device, drafter.config.mask_token_id)
    with cm.autocast(device, bf16):
        if model is not None:
            _, logits = model(taps, anchors, block_ids, suffix)
        else:
            _, logits = bl.block_forward(drafter, taps, anchors, block_ids, suffix)
    loss, st = bl.block_loss(logits, labels, weights, bw, objective=objective)
    base = None
    with torch.no_grad():
        if with_baseline:
            with cm.autocast(device, bf16):
                _, lb = bl.block_forward(drafter, taps, anchors, block_ids, None)
            _, base = bl.block_loss(lb, labels, weights, bw)
        x = drafter.target.embed(block_ids).float()
        corr = drafter.project(suffix.corr_taps.to(drafter.fc.weight.dtype)).float()
        v = suffix.valid * bw.unsqueeze(-1)
        g = drafter.conditioner.mean_gate(x, suffix.memory.float(), corr, suffix.features, v)
        gate_w = float(v.sum())
    return loss, st, base, (float(g) * gate_w, gate_w)


def diagnose(drafter, ex: Examples, B: int, weights, device, bf16, batch_size: int = 8) -> dict:
    """What the rejected suffix is worth on recorded rounds (no grad), all on the same blocks:

    - loss / tau_est of the block with the conditioner (retrace) and without it (dflash), and of an
      "oracle" that takes the remembered draft d_j wherever it is the right token (the headroom);
    - over valid memory slots: how often d_j is right (mem_right), the fresh DFlash draft is right
      (fresh_right), d_j is right where the fresh draft is wrong (headroom), and what the conditioner did:
      fixed (fresh wrong -> retrace right) and broke (fresh right -> retrace wrong);
    - P(d_j right | agree bit) for the two values of the agree feature, and the mean gate on valid slots;
    - the same for the target's own argmax at slot j-1 of the rejected verify pass (target_token_*: not an
      input of the conditioner, measured to see where the information is).
    tau_est counts only blocks whose labels are all known (see blocks.block_loss)."""
    was = drafter.training
    drafter.eval()
    use = ex.usable()
    tot = {"r": {}, "d": {}}
    acc = {k: 0.0 for k in ("valid", "mem_right", "fresh_right", "headroom", "fixed", "broke", "agree1", "agree1_right",
                            "agree0_right", "oracle_len", "dflash_len", "retrace_len", "full", "gate", "gate_w",
                            "tt_right", "tt_headroom", "oracle_tt_len")}
    with torch.no_grad():
        for s in range(0, len(use), batch_size):
            idx = use[s : s + batch_size]
            picks = pick_rounds(ex, idx, 10**6, None)
            taps, block_ids, labels, anchors, bw, suffix = collate(ex, idx, picks, B, device,
                                                                   drafter.config.mask_token_id)
            with cm.autocast(device, bf16):
                _, lr_ = bl.block_forward(drafter, taps, anchors, block_ids, suffix)
                _, ld = bl.block_forward(drafter, taps, anchors, block_ids, None)
            bl.merge_stats(tot["r"], bl.block_loss(lr_, labels, weights, bw)[1])
            bl.merge_stats(tot["d"], bl.block_loss(ld, labels, weights, bw)[1])
            v = (suffix.valid[:, :, 1:] * bw.unsqueeze(-1)) > 0  # slots 1..B-1
            present = (labels != bl.IGNORE) & (bw.unsqueeze(-1) > 0)
            mem_tok = drafter.target.logits(suffix.memory[:, :, 1:].to(drafter.target.lm_head.weight.dtype)).argmax(-1)
            fresh, ret = ld.argmax(-1), lr_.argmax(-1)
            mem_ok, fresh_ok, ret_ok = mem_tok == labels, fresh == labels, ret == labels
            vp = v & present
            acc["valid"] += float(vp.sum())
            acc["mem_right"] += float((vp & mem_ok).sum())
            acc["fresh_right"] += float((vp & fresh_ok).sum())
            acc["headroom"] += float((vp & mem_ok & ~fresh_ok).sum())
            acc["fixed"] += float((vp & ~fresh_ok & ret_ok).sum())
            acc["broke"] += float((vp & fresh_ok & ~ret_ok).sum())
            agree = suffix.features[:, :, 1:, 0] > 0.5
            acc["agree1"] += float((vp & agree).sum())
            acc["agree1_right"] += float((vp & agree & mem_ok).sum())
            acc["agree0_right"] += float((vp & ~agree & mem_ok).sum())
            full = present.all(-1) & (bw > 0)
            oracle_ok = fresh_ok | (v & mem_ok)
            tt = torch.zeros_like(labels)
            for n, (i, pk) in enumerate(zip(idx, picks, strict=True)):
                for b, k in enumerate(pk):
                    rec = ex.rolls[i].rounds[k]
                    if rec.target_tokens is not None:
                        tt[n, b] = rec.target_tokens[1:].to(tt.device)
            tt_ok = tt == labels
            acc["tt_right"] += float((vp & tt_ok).sum())
            acc["tt_headroom"] += float((vp & tt_ok & ~fresh_ok).sum())
            for name, ok in (("oracle_len", oracle_ok), ("dflash_len", fresh_ok), ("retrace_len", ret_ok),
                             ("oracle_tt_len", fresh_ok | (v & tt_ok))):
                acc[name] += float(ok.long().cumprod(-1).sum(-1)[full].sum())
            acc["full"] += float(full.sum())
            x = drafter.target.embed(block_ids).float()
            corr = drafter.project(suffix.corr_taps.to(drafter.fc.weight.dtype)).float()
            vv = suffix.valid * bw.unsqueeze(-1)
            acc["gate"] += (float(drafter.conditioner.mean_gate(x, suffix.memory.float(), corr, suffix.features, vv))
                            * float(vv.sum()))
            acc["gate_w"] += float(vv.sum())
    drafter.train(was)
    n, f = max(acc["valid"], 1.0), max(acc["full"], 1.0)
    agree0 = acc["valid"] - acc["agree1"]
    return {
        "retrace": bl.summarize(tot["r"]), "dflash": bl.summarize(tot["d"]),
        "tau_est": {"dflash": round(1 + acc["dflash_len"] / f, 4), "retrace": round(1 + acc["retrace_len"] / f, 4),
                    "oracle": round(1 + acc["oracle_len"] / f, 4),
                    "oracle_target_token": round(1 + acc["oracle_tt_len"] / f, 4)},
        "valid_slots": int(acc["valid"]),
        "mem_right": round(acc["mem_right"] / n, 4), "fresh_right": round(acc["fresh_right"] / n, 4),
        "headroom": round(acc["headroom"] / n, 4), "fixed": round(acc["fixed"] / n, 4),
        "broke": round(acc["broke"] / n, 4),
        "target_token_right": round(acc["tt_right"] / n, 4), "target_token_headroom": round(acc["tt_headroom"] / n, 4),
        "p_right_given_agree": round(acc["agree1_right"] / max(acc["agree1"], 1.0), 4),
        "p_right_given_disagree": round(acc["agree0_right"] / max(agree0, 1.0), 4),
        "agree_rate": round(acc["agree1"] / n, 4),
        "mean_gate": round(acc["gate"] / max(acc["gate_w"], 1.0), 5),
    }


# -- the trainer -----------------------------------------------------------------------------------------------
def train_conditioner(target_dir: str | Path, drafter_dir: str | Path, data: str | Path,
                      out_dir: str | Path | None = None,
                      cfg: ConditionerConfig | None = None, resume: bool = False, progress: bool = True,
                      force: bool = False) -> dict:
    """Train into out_dir (default: the drafter's dir; see retrace.train.outputs: force / resume)."""
    from retrace.train import outputs

    cfg = cfg or ConditionerConfig()
    out = Path(out_dir or drafter_dir)
    with dist.session(cfg.device) as (d, device):
        d.main_first(lambda: outputs.prepare_conditioner_out(out, Path(drafter_dir), force, resume))
        guard = outputs.report_interrupt(out) if d.is_main else contextlib.nullcontext()
        with guard, cm.torch_threads(cfg.threads):
            return _train(Path(target_dir), Path(drafter_dir), Path(data), out, cfg, resume, progress and d.is_main,
                          d, device)


def _train(target_dir: Path, drafter_dir: Path, data: Path, out: Path, cfg: ConditionerConfig, resume: bool,
           progress: bool, d: dist.Dist, device: torch.device) -> dict:
    t_start = time.perf_counter()
    bf16 = (device.type == "cuda") if cfg.bf16 is None else cfg.bf16
    torch.manual_seed(cfg.seed)
    state_dir = cm.conditioner_state_dir(out)
    if resume and cm.has_train_state(out, state_dir):  # before any model is loaded or rolled out
        cm.check_resumable(out, "conditioner", cm.key_sha(_resume_key(cfg)), cfg.phases * cfg.steps_per_phase,
                           state_dir)
    dconf = DrafterConfig.from_dir(drafter_dir)
    target = load_target(target_dir, dconf.target_layer_ids, device, bf16)
    drafter = DFlashDrafter.from_pretrained(drafter_dir, target, load_conditioner=not cfg.reinit,
                                            dtype=torch.float32).to(device)
    if drafter.conditioner is None:
        cond = ReTraceConditioner(dconf.hidden_size, gate_bias_init=cfg.gate_bias_init,
                                  rms_norm_eps=dconf.layers.rms_norm_eps)
        cond.reset("zero", seed=cfg.seed)
        drafter.conditioner = cond.to(device)
    B = cfg.block_size or dconf.block_size
    if not 2 <= B <= dconf.block_size:
        raise RetraceError(f"block size {B} must be in 2..{dconf.block_size}")
    gamma = cfg.gamma or bl.default_gamma(B)
    weights = bl.loss_weights(B, gamma, device)

    if cfg.rollout_prompts < 1 or cfg.rollout_prompts % d.world:
        raise RetraceError(f"--rollout-prompts {cfg.rollout_prompts} is not a positive multiple of the world size "
                           f"{d.world} (each process rolls out an equal share)")
    if out != drafter_dir and d.is_main:
        out.mkdir(parents=True, exist_ok=True)
        for f in ("config.json",
                  *[p.name for p in drafter_dir.glob("*.safetensors") if p.name != "retrace.safetensors"],
                  *[n for n in (DRAFT_VOCAB_META,) if (drafter_dir / n).is_file()]):  # a draft vocabulary: both files
            shutil.copy2(drafter_dir / f, out / f)
    d.barrier()

    train_p, val_p = prepare_prompts(target_dir, data, cfg.max_prompt_len, cfg.num_prompts, cfg.val_prompts, cfg.seed,
                                     cfg.chat)
    if not train_p:
        raise RetraceError(f"{data}: no training prompts")
    if min(cfg.rollout_prompts, len(train_p)) < d.world:
        raise RetraceError(f"{data}: {len(train_p)} training prompts cannot give each of {d.world} processes a rollout")
    eval_p = val_p[: cfg.eval_prompts]

    drafter.requires_grad_(False)
    drafter.conditioner.requires_grad_(True)
    if cfg.unfreeze_drafter:
        drafter.requires_grad_(True)
    model = dist.wrap(bl.BlockModel(drafter), d, device, cfg.fsdp) if d.active else None  # --fsdp: shards in place
    named = [(f"conditioner.{n}", p) for n, p in drafter.conditioner.named_parameters()]
    dnamed = []
    if cfg.unfreeze_drafter:
        dnamed = [(n, p) for n, p in drafter.named_parameters() if not n.startswith("conditioner.")]
    params = dict(named + dnamed)
    opt = cm.make_adamw(named, cfg.lr, cfg.weight_decay)
    if dnamed:
        opt.add_param_group({"params": [p for _, p in dnamed], "weight_decay": cfg.weight_decay, "lr": cfg.drafter_lr})
    lr_scale = [g["lr"] / cfg.lr for g in opt.param_groups]
    total_steps = cfg.phases * cfg.steps_per_phase

    def schedule(s: int, _spent) -> float:  # by step: a time budget drops the later steps and phases
        return cm.lr_at(s, total_steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio)

    phase, step, history = 0, 0, []
    rng_name = "rounds" if d.rank == 0 else f"rounds.{d.rank}"
    rgen = torch.Generator().manual_seed(cfg.seed + 11 + 7919 * d.rank)
    if resume and cm.has_train_state(out, state_dir):
        step, info, rng = fs.load_train_state(out, params, opt, model, state_dir)
        phase, history = info["phase"], info.get("history", [])
        if info.get("world_size", 1) == d.world:
            rgen.set_state(rng[rng_name])
        else:  # another world size: same weights, optimizer and phase; fresh round picks
            rgen.manual_seed(cfg.seed + 11 + 7919 * d.rank + 104_729 * step)
        cm.log(progress, TAG, f"resumed at phase {phase} (step {step})")

    def save(phase_now):
        states = d.all_gather(rgen.get_state())
        full, full_opt = fs.gather_train_state(model, params, opt)  # --fsdp: unsharded, on rank 0
        if d.is_main:
            info = {"kind": "conditioner", "config": cfg.to_dict(), "config_sha": cm.key_sha(_resume_key(cfg)),
                    "phase": phase_now, "world_size": d.world, "fsdp": fs.is_sharded(model), "history": history}
            rng = {("rounds" if r == 0 else f"rounds.{r}"): st for r, st in enumerate(states)}
            cm.save_train_state(out, full, full_opt, step, info, rng=rng, state=state_dir)
            if cfg.unfreeze_drafter:  # the full weights (gathered under --fsdp)
                drafter.save_pretrained(out, tensors=full)
            else:
                drafter.conditioner.save(out, {k[len("conditioner."):]: v for k, v in full.items()})
        d.barrier()

    t0 = time.perf_counter()
    with fs.full_params(model):
        base_tau = d.main_first(lambda: runtime_tau(target, drafter, eval_p, cfg.eval_new_tokens, "dflash", device, B,
                                                    cfg.rollout_batch) if eval_p else {})
    eval_s = time.perf_counter() - t0
    cm.log(progress, TAG,
           f"{len(train_p)} train / {len(val_p)} val prompts; B={B}; dflash runtime tau on val {base_tau}")
    roll_s = train_s = 0.0
    bar = cm.progress_bar(total_steps, "conditioner", progress, initial=step)
    last = {}
    stop_at = cfg.phases if cfg.stop_after is None else min(cfg.phases, phase + cfg.stop_after)
    t_loop = time.perf_counter()

    def out_of_time() -> bool:
        if cfg.max_train_seconds is None:
            return False
        return d.broadcast(time.perf_counter() - t_loop >= cfg.max_train_seconds)  # one decision for all ranks

    while phase < stop_at and not (history and out_of_time()):
        # 1. on-policy rollout with the current conditioner
        t0 = time.perf_counter()
        k = cfg.rollout_prompts
        start = (phase * k) % len(train_p)
        prompts = [train_p[(start + i) % len(train_p)] for i in range(min(k, len(train_p)))]
        prompts = prompts[d.rank :: d.world]  # this rank's share of the rollouts
        with fs.full_params(model):
            ex = collect(target, drafter, prompts, cfg, device, cfg.seed + 7919 * phase + 1_000_003 * d.rank,
                         cfg.unfreeze_drafter, progress)
        use = ex.usable()
        roll_tau = [t for part in d.all_gather([r.tau for r in ex.rolls if r.tau is not None]) for t in part]
        n_use = d.all_gather(len(use))
        roll_s += time.perf_counter() - t0
        if any(n_use) and not all(n_use):
            raise RetraceError(f"phase {phase + 1}: the rollouts of rank {n_use.index(0)} produced no rounds with a "
                               "rejected suffix (an empty shard): use more --rollout-prompts or fewer processes")
        if not any(n_use):
            cm.log(progress, TAG, "warning: the rollouts produced no rounds with a rejected suffix (the drafter "
                                  "accepts whole blocks, or the responses are too short): nothing to train on")
            phase += 1
            history.append({"phase": phase, "step": step,
                            "rollout_tau": round(sum(roll_tau) / max(1, len(roll_tau)), 4),
                            "rollout_rounds": 0, "skipped": True})
            save(phase)
            continue
        diag = {}
        if cfg.diagnose_seqs:
            t0 = time.perf_counter()
            sub = Examples([ex.rolls[i] for i in use[: cfg.diagnose_seqs]],
                           [ex.taps[i] for i in use[: cfg.diagnose_seqs]])
            with fs.full_params(model):
                diag = d.broadcast(diagnose(drafter, sub, B, weights, device, bf16, cfg.batch_size) if d.is_main
                                   else None)
            eval_s += time.perf_counter() - t0
            cm.log(progress, TAG, f"phase {phase + 1} fresh rollouts: {diag}")
        # 2. train on them
        t0 = time.perf_counter()
        drafter.train()
        sampler = SeqSampler(len(use), cfg.seed + phase + 7919 * d.rank)
        steps = _PhaseSteps(drafter, model, ex, use, sampler, rgen, B, weights, device, bf16, cfg, last)
        # each phase trains at least one step; the time budget covers the rollouts too (clock: since t_loop)
        budget = Budget(total_steps, cfg.max_train_seconds, step + cfg.steps_per_phase, min_steps=1)
        step = fit(steps, opt, list(params.values()), budget, schedule, cfg.grad_clip, start=step,
                   lr_scale=lr_scale, bar=bar, postfix=steps.postfix, clock=lambda: time.perf_counter() - t_loop,
                   sync=d.broadcast).step
        tot, btot, gs, gw = steps.tot, steps.btot, steps.gs, steps.gw
        train_s += time.perf_counter() - t0
        tot, btot = d.sum_stats(tot), d.sum_stats(btot)
        gs, gw = d.sum_stats({"gs": gs, "gw": gw}).values()
        phase += 1
        # 3. evaluate: real runtime tau with the new conditioner on validation prompts
        t0 = time.perf_counter()
        with fs.full_params(model):
            rt = d.main_first(lambda: runtime_tau(target, drafter, eval_p, cfg.eval_new_tokens, "retrace", device, B,
                                                  cfg.rollout_batch) if eval_p else {})
        eval_s += time.perf_counter() - t0
        last = {"retrace_tau": rt.get("tau_mean"), "retrace_tau_pooled": rt.get("tau_pooled")}
        rec = {"phase": phase, "step": step, "rollout_tau": round(sum(roll_tau) / max(1, len(roll_tau)), 4),
               "rollout_rounds": sum(d.all_gather(sum(len(ex.rolls[i].rounds) for i in use))),
               "diagnose_before": diag, "train": bl.summarize(tot), "train_vs_dflash": _paired(btot),
               "mean_gate": round(gs / max(gw, 1e-8), 5), "val_runtime": rt}
        history.append(rec)
        cm.log(progress, TAG, f"phase {phase}/{cfg.phases}: rollout tau {rec['rollout_tau']}, train {rec['train']}, "
                              f"gate {rec['mean_gate']}, val tau retrace {rt.get('tau_mean')} vs dflash "
                              f"{base_tau.get('tau_mean')}")
        save(phase)
    if bar is not None:
        bar.close()
    if not history:  # resumed a finished run
        save(phase)
    metrics = {
        "kind": "conditioner", "phases": phase, "steps": step, "block_size": B, "gamma": gamma,
        "val_dflash_runtime_tau": base_tau, "final": history[-1] if history else None, "history": history,
        "mean_gate": history[-1].get("mean_gate") if history else None,
        "seconds": {"rollouts": round(roll_s, 2), "train": round(train_s, 2), "eval": round(eval_s, 2),
                    "total": round(time.perf_counter() - t_start, 2)},
        "config": cfg.to_dict(),
    }
    metrics["world_size"] = d.world
    metrics["fsdp"] = fs.is_sharded(model)
    if d.is_main:
        atomic_write_text(out / "conditioner_train.json", json.dumps(metrics, indent=2) + "\n")
    return metrics


class _PhaseSteps:
    """The training steps of one phase (fit's step function): batches of the recorded rounds of its rollouts;
    sums the loss stats (with the DFlash baseline on every 4th step) and the gate."""

    def __init__(self, drafter, model, ex: Examples, use: list[int], sampler, rgen, B, weights, device, bf16,
                 cfg: ConditionerConfig, last: dict):
        self.drafter, self.model, self.ex, self.use, self.sampler, self.rgen = drafter, model, ex, use, sampler, rgen
        self.B, self.weights, self.device, self.bf16, self.cfg, self.last = B, weights, device, bf16, cfg, last
        self.tot, self.btot, self.gs, self.gw = {}, {}, 0.0, 0.0

    def __call__(self, st: FitState, backward) -> float:
        idx = [self.use[i] for i in self.sampler.take(self.cfg.batch_size)]
        picks = pick_rounds(self.ex, idx, self.cfg.blocks_per_seq, self.rgen)
        loss, stats, base, (g, w) = block_losses(self.drafter, self.ex, idx, picks, self.B, self.weights, self.device,
                                                 self.bf16, st.steps_run % 4 == 0, self.model, self.cfg.objective)
        backward(loss)
        bl.merge_stats(self.tot, stats)
        if base is not None:
            bl.merge_stats(self.btot, {f"b_{k}": v for k, v in stats.items()})
            bl.merge_stats(self.btot, base)
        self.gs, self.gw = self.gs + g, self.gw + w
        return float(loss.detach())

    def postfix(self, _st: FitState) -> dict:
        post = {"loss": f"{self.tot['loss_sum'] / max(self.tot['weight_sum'], 1e-8):.3f}",
                "gate": f"{self.gs / max(self.gw, 1e-8):.3f}"}
        if "retrace_tau" in self.last:
            post["val_tau"] = f"{self.last['retrace_tau']:.2f}"
        return post


def _paired(btot: dict) -> dict:
    """Loss / tau estimate with the conditioner vs without it on the same sampled blocks (before the update)."""
    if not btot:
        return {}
    r = bl.summarize({k[2:]: v for k, v in btot.items() if k.startswith("b_")})
    d = bl.summarize({k: v for k, v in btot.items() if not k.startswith("b_")})
    return {"retrace": r, "dflash": d}


def _resume_key(cfg: ConditionerConfig) -> dict:
    d = cfg.to_dict()
    for k in ("phases", "stop_after", "max_train_seconds", "diagnose_seqs", "eval_prompts", "eval_new_tokens", "device",
              "threads", "rollout_batch", "fsdp"):
        d.pop(k, None)
    if not d.get("chat"):
        d.pop("chat", None)  # checkpoints from before --chat existed resume
    return d


__all__ = ["ConditionerConfig", "train_conditioner", "collate", "block_losses", "Examples", "collect",
           "diagnose"]
