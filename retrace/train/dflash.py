"""`retrace train dflash`: distil a DFlash drafter from a frozen Qwen3 target.

Data: the target regenerates the responses itself (batched, greedy by default) from the training prompts;
a validation split of the prompts is held out of training (never the evaluation prompts). Each step takes
`batch_size` sequences, draws `blocks_per_seq` random anchors in each response, and trains all blocks of
a sequence in one drafter forward (`blocks.block_forward`: context K/V once per sequence from the target
taps, each block sees the context before its anchor and itself). Loss: cross-entropy on slots 1..B-1 with
weights exp(-(k-1)/gamma) (or another --objective: retrace.train.objectives), labels = the target's own
continuation. The target's embedding and LM head are
shared and frozen (so the never-trained MASK row cannot decay; its norm is checked, as a near-zero MASK
embedding makes all block slots identical). Writes the z-lab checkpoint format.
"""

from __future__ import annotations

import json
import time
import types
from pathlib import Path

import torch

from retrace.digest import sha256_file
from retrace.errors import RetraceError
from retrace.models.checkpoint import atomic_write_text
from retrace.models.config import Qwen3Config
from retrace.models.drafter import DFlashDrafter, new_drafter_config
from retrace.models.target import Qwen3Target
from retrace.train import blocks as bl
from retrace.train import common as cm
from retrace.train import distributed as dist
from retrace.train import fsdp as fs
from retrace.train.batches import SeqSampler, data_streams, sample_anchors
from retrace.train.config import DFlashConfig
from retrace.train.datasets_io import data_sha, prepare_prompts
from retrace.train.evaluate import runtime_tau
from retrace.train.fit import Budget, FitState, fit, follow_budget
from retrace.train.outputs import drop_stale_conditioner
from retrace.train.response_cache import cached_responses, save_taps_cache, target_responses
from retrace.train.taps import compute_taps, load_target, pad_taps, pad_tokens, target_taps

TAG = "train dflash"


# -- the drafter: its MASK token and its initialisation ------------------------------------------------------
def find_mask_token_id(target_dir: str | Path, vocab_size: int, given: int | None = None) -> int:
    """--mask-token-id, else `<|mask|>` in the target's tokenizer.json, else an error naming the option."""
    if given is not None:
        mid = int(given)
    else:
        mid = None
        tj = Path(target_dir) / "tokenizer.json"
        if tj.is_file():
            tok = json.loads(tj.read_text())
            for t in tok.get("added_tokens", []):
                if t.get("content") == "<|mask|>":
                    mid = int(t["id"])
            if mid is None:
                mid = (tok.get("model", {}).get("vocab") or {}).get("<|mask|>")
        if mid is None:
            raise RetraceError(f"{target_dir}: no <|mask|> token in tokenizer.json; pass --mask-token-id "
                               "(151669 for Qwen3: an existing, untrained embedding row)")
    if not 0 <= mid < vocab_size:
        raise RetraceError(f"mask token id {mid} is outside the target vocab ({vocab_size})")
    return mid


def mask_row_check(target: Qwen3Target, mask_id: int) -> dict:
    """The MASK embedding's norm relative to the mean row norm (a near-zero row is a known pitfall)."""
    w = target.model.embed_tokens.weight.detach().float()
    norms = w.norm(dim=-1)
    ratio = float(norms[mask_id] / norms.mean().clamp_min(1e-12))
    return {"mask_norm": round(float(norms[mask_id]), 5), "mean_norm": round(float(norms.mean()), 5),
            "ratio": round(ratio, 4)}


def init_drafter(drafter: DFlashDrafter, target: Qwen3Target, how: str, seed: int) -> None:
    """random: N(0, 0.02) matrices, unit norms. copy: the target's last layers (a common trick: they speak the
    LM head's language), the target's final norm, and an fc that averages the taps (plus small noise)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.startswith("conditioner."):
                continue
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            else:
                p.fill_(1.0)
        if how == "random":
            return
        if how != "copy":
            raise RetraceError(f"unknown drafter init {how!r} (copy|random)")
        n_t, n_d = len(target.model.layers), len(drafter.layers)
        src = list(range(max(0, n_t - n_d), n_t))
        src = (src * n_d)[:n_d]
        for i, j in enumerate(src):
            tsd = target.model.layers[j].state_dict()
            dsd = drafter.layers[i].state_dict()
            if all(k in tsd and tsd[k].shape == v.shape for k, v in dsd.items()):
                drafter.layers[i].load_state_dict({k: tsd[k].float() for k in dsd})
        drafter.norm.weight.copy_(target.model.norm.weight.float())
        k = drafter.config.num_taps
        d = drafter.config.hidden_size
        eye = torch.eye(d) / k
        drafter.fc.weight.copy_(torch.cat([eye] * k, dim=1) + torch.randn(d, k * d, generator=g) * 0.005)




# -- the trainer -------------------------------------------------------------------------------------------------
class _Data:
    def __init__(self, seqs, prompt_lens, taps):
        self.seqs, self.prompt_lens, self.taps = seqs, prompt_lens, taps


def _batch_forward(drafter, target, data: _Data, idx, anchors, bw, cfg, device, weights, bf16, model=None):
    """Loss of the sequences `idx` of `data`; `model`: the DDP/FSDP-wrapped BlockModel for training steps."""
    seqs = [data.seqs[i] for i in idx]
    ids, lengths = pad_tokens(seqs, device)
    anchors, bw = anchors.to(device), bw.to(device)
    soft = None
    if data.taps is not None:
        taps = pad_taps([data.taps[i] for i in idx], device)
    else:
        with torch.no_grad():
            # slot k of the block at anchor a predicts the token at a+k: the target's logits at a+k-1
            if cfg.soft_labels:
                at = (anchors.unsqueeze(-1)
                      + torch.arange(cfg.block_size - 1, device=device)).clamp_max(ids.shape[1] - 1)
                taps, soft = target_taps(target, ids, at.flatten(1))
                soft = soft.view(*at.shape, -1).float()
            else:
                taps = target_taps(target, ids)
            taps = taps.float()
    block_ids, labels = bl.block_inputs(ids, anchors, cfg.block_size, drafter.config.mask_token_id,
                                        torch.tensor(lengths, device=device))
    with cm.autocast(device, bf16):
        if model is not None:
            _, logits = model(taps, anchors, block_ids)
        else:
            _, logits = bl.block_forward(drafter, taps, anchors, block_ids)
    return bl.block_loss(logits, labels, weights, bw, soft, cfg.objective)


def evaluate_blocks(drafter, target, data: _Data, anchors, cfg, device, weights, bf16, items=None,
                    d: dist.Dist = dist.Dist()) -> dict:
    """Validation loss / estimated tau on fixed anchors (no grad) over the sequences `items` of data (default:
    all), anchors aligned with items; under torchrun each rank passes its share and the sums are merged."""
    total: dict = {}
    items = list(range(len(data.seqs))) if items is None else items
    was = drafter.training
    drafter.eval()
    with torch.no_grad():
        for s in range(0, len(items), cfg.batch_size):
            pos = list(range(s, min(len(items), s + cfg.batch_size)))
            _, st = _batch_forward(drafter, target, data, [items[p] for p in pos], anchors[0][pos], anchors[1][pos],
                                   cfg, device, weights, bf16)
            bl.merge_stats(total, st)
    drafter.train(was)
    return bl.summarize(d.sum_stats(total))


def train_dflash(target_dir: str | Path, out_dir: str | Path, data: str | Path, cfg: DFlashConfig | None = None,
                 resume: bool = False, progress: bool = True, force: bool = False) -> dict:
    """Train into out_dir (see retrace.train.outputs for what may be overwritten: force / resume). Under
    torchrun: data parallel (retrace.train.distributed); the global batch is batch_size x grad_accum x world."""
    from retrace.train import outputs

    cfg = cfg or DFlashConfig()
    with dist.session(cfg.device) as (d, device):
        with outputs.dflash_out(Path(out_dir), force, resume, d) as work, cm.torch_threads(cfg.threads):
            return _train_dflash(Path(target_dir), work, Path(data), cfg, resume, progress and d.is_main, d, device)


def _train_dflash(target_dir: Path, out: Path, data: Path, cfg: DFlashConfig, resume: bool, progress: bool,
                  d: dist.Dist, device: torch.device) -> dict:
    t_start = time.perf_counter()
    bf16 = (device.type == "cuda") if cfg.bf16 is None else cfg.bf16
    if cfg.batch_size < 1 or cfg.grad_accum < 1:
        raise RetraceError(f"--batch-size ({cfg.batch_size}) and --grad-accum ({cfg.grad_accum}) must be positive")
    if resume and cm.has_train_state(out):  # before the target generates anything or train_data/ is touched
        cm.check_resumable(out, "dflash", cm.key_sha(_resume_key(cfg)), cfg.steps)
    torch.manual_seed(cfg.seed)
    tconf = Qwen3Config.from_dir(target_dir)
    mask_id = find_mask_token_id(target_dir, tconf.vocab_size, cfg.mask_token_id)
    dconf = new_drafter_config(types.SimpleNamespace(config=tconf), num_layers=cfg.num_layers,
                               block_size=cfg.block_size, mask_token_id=mask_id,
                               target_layer_ids=cfg.target_layer_ids, intermediate_size=cfg.intermediate_size)
    taps = list(dconf.target_layer_ids)
    if cfg.target_layer_ids is None and not all(0 <= i < tconf.num_hidden_layers for i in taps):
        raise RetraceError(f"--layers {cfg.num_layers}: z-lab's default taps for a {cfg.num_layers}-layer drafter "
                           f"({taps}: evenly spaced over layers 1..n-3) do not fit this "
                           f"{tconf.num_hidden_layers}-layer "
                           "target; pass --target-layer-ids (one target layer per tap) or use fewer --layers")
    target = load_target(target_dir, dconf.target_layer_ids, device, bf16)
    mask_info = mask_row_check(target, mask_id)
    if mask_info["ratio"] < 0.1:
        cm.log(progress, TAG, f"warning: the MASK embedding row {mask_id} is tiny (norm ratio {mask_info['ratio']}): "
                              "all block slots will look alike; reset that row in the target")
    gamma = cfg.gamma or bl.default_gamma(cfg.block_size)
    weights = bl.loss_weights(cfg.block_size, gamma, device)

    # data: the target's own continuations, generated by each rank for its share of the prompts
    t0 = time.perf_counter()
    train_p, val_p = prepare_prompts(target_dir, data, cfg.max_prompt_len, cfg.num_prompts, cfg.val_prompts, cfg.seed,
                                     cfg.chat)
    key = {"target": sha256_file(next(iter(sorted(target_dir.glob("*.safetensors")))))[:16], "data": data_sha(data),
           "n": len(train_p) + len(val_p), "max_new": cfg.max_new_tokens, "maxp": cfg.max_prompt_len,
           "T": cfg.gen_temperature, "seed": cfg.seed, "val": cfg.val_prompts, "sample_frac": cfg.gen_sample_frac}
    if cfg.chat:
        key["chat"] = True
    all_p = train_p + val_p
    n_tr, A = len(train_p), cfg.grad_accum
    S = d.world * A
    if n_tr < S:
        data_streams([], n_tr, S, data)  # raises: not enough prompts for the shards
    own_tr = [i for i in range(n_tr) if (i % S) // A == d.rank]
    own_va = [n_tr + j for j in dist.strided(len(val_p), d)]
    mine = own_tr + own_va

    # taps: kept (captured while generating) when they fit in cache_taps_mb, else recomputed per batch; with
    # soft labels every batch runs the target anyway (for its logits), so none are kept
    kd = dconf.num_taps * dconf.hidden_size
    est_tokens = sum(len(all_p[i]) for i in mine) + len(mine) * cfg.max_new_tokens
    cache = not cfg.soft_labels and est_tokens * kd * 2 / 2**20 <= cfg.cache_taps_mb

    def make(ix_list, with_taps):
        return target_responses(target, target_dir, dconf.target_layer_ids, all_p, ix_list, with_taps, cfg, device, d,
                                progress)

    responses, taps_by = cached_responses(out / "train_data", key, make, cache, len(all_p), mine, d)
    gen_s = time.perf_counter() - t0
    seqs = [p + r for p, r in zip(all_p, responses, strict=True)]
    plens = [len(p) for p in all_p]
    keep = [i for i in range(len(seqs)) if len(seqs[i]) - plens[i] >= 2]
    tr_idx = [i for i in keep if i < n_tr]
    va_idx = [i for i in keep if i >= n_tr]
    if not tr_idx:
        raise RetraceError(f"{data}: no usable training sequences (responses shorter than 2 tokens)")
    streams = data_streams(tr_idx, n_tr, S, data)
    own_streams = list(range(d.rank * A, (d.rank + 1) * A))
    t0 = time.perf_counter()
    if cache and taps_by is None:
        taps_by = dict(zip(mine, compute_taps(target, [seqs[i] for i in mine], cfg.gen_batch, device), strict=True))
        save_taps_cache(out / "train_data", key, taps_by, d)
    taps_s = time.perf_counter() - t0

    data_all = _Data(seqs, plens, taps_by if cache else None)  # global indices; this rank's taps only
    vgen = torch.Generator().manual_seed(4242 + cfg.seed)
    val_anchors = sample_anchors([len(seqs[i]) for i in va_idx], [plens[i] for i in va_idx], cfg.blocks_per_seq, vgen)
    vpos = [j for j, i in enumerate(va_idx) if (i - n_tr) % d.world == d.rank]
    own_val = ([va_idx[j] for j in vpos], (val_anchors[0][vpos], val_anchors[1][vpos]))

    def evaluate() -> dict:
        with fs.full_params(model):
            return evaluate_blocks(drafter, target, data_all, own_val[1], cfg, device, weights, bf16, own_val[0], d)

    # model
    drafter = DFlashDrafter(dconf, target).to(device)
    init_drafter(drafter, target, cfg.init, cfg.seed)
    drafter.to(device).train()
    model = dist.wrap(bl.BlockModel(drafter), d, device, cfg.fsdp) if d.active else None  # --fsdp: shards in place
    named = [(n, p) for n, p in drafter.named_parameters() if not n.startswith("conditioner.")]
    params = dict(named)
    opt = cm.make_adamw(named, cfg.lr, cfg.weight_decay)

    def stream_seed(s: int) -> int:
        return cfg.seed + 7919 * s

    samplers = [SeqSampler(len(streams[s]), stream_seed(s)) for s in range(S)]
    agens = [torch.Generator().manual_seed(stream_seed(s) + 7) for s in range(S)]
    step, history = 0, []
    if resume and cm.has_train_state(out):
        step, info, rng = fs.load_train_state(out, params, opt, model)
        saved = info.get("streams") or [[info["epoch"], info["cursor"]]]
        if len(saved) == S:
            for s in range(S):
                samplers[s] = SeqSampler(len(streams[s]), stream_seed(s), *saved[s])
                agens[s].set_state(rng[_anchor_rng(s)])
        else:  # another world size x grad_accum: same weights, optimizer and schedule; fresh data order
            epoch = 1 + max(e for e, _ in saved)
            samplers = [SeqSampler(len(streams[s]), stream_seed(s), epoch) for s in range(S)]
            agens = [torch.Generator().manual_seed(stream_seed(s) + 7 + 104_729 * step) for s in range(S)]
            cm.log(progress, TAG, f"the checkpoint had {len(saved)} data shards, this run has {S} (world size "
                                  f"{d.world} x grad accum {A}): the data order restarts at epoch {epoch}")
        history = info.get("history", [])
        cm.log(progress, TAG, f"resumed at step {step}")

    cm.log(progress, TAG, f"{len(tr_idx)} train / {len(va_idx)} val sequences, "
                          f"{sum(p.numel() for p in params.values()) / 1e6:.2f}M drafter params, B={cfg.block_size}, "
                          f"taps {dconf.target_layer_ids}, init {cfg.init}, device {device}, bf16 {bf16}, global batch "
                          f"{cfg.batch_size} x {A} x {d.world} ranks")
    bar = cm.progress_bar(cfg.steps, "dflash", progress, initial=step)
    if step == 0 and va_idx and cfg.eval_every:
        history.append({"step": 0, **{f"val_{k}": v for k, v in evaluate().items()}})

    def save(step_now):
        owned = {s: (samplers[s].epoch, samplers[s].cursor, agens[s].get_state()) for s in own_streams}
        state = {k: v for part in d.all_gather(owned) for k, v in part.items()}
        full, full_opt = fs.gather_train_state(model, params, opt)  # --fsdp: unsharded, on rank 0
        if d.is_main:
            info = {"kind": "dflash", "config": cfg.to_dict(), "config_sha": cm.key_sha(_resume_key(cfg)),
                    "epoch": state[0][0], "cursor": state[0][1], "streams": [list(state[s][:2]) for s in range(S)],
                    "world_size": d.world, "fsdp": fs.is_sharded(model), "history": history}
            cm.save_train_state(out, full, full_opt, step_now, info,
                                rng={_anchor_rng(s): state[s][2] for s in range(S)})
            drafter.save_pretrained(out, save_conditioner=False, tensors=full)
            drop_stale_conditioner(out)
        d.barrier()

    def train_step(_st: FitState, backward) -> float:
        """One micro-batch per data stream of this rank; -> the step's loss over all ranks."""
        tot: dict = {}
        for a, s in enumerate(own_streams):
            idx = [streams[s][j] for j in samplers[s].take(cfg.batch_size)]
            anchors, bw = sample_anchors([len(seqs[i]) for i in idx], [plens[i] for i in idx], cfg.blocks_per_seq,
                                         agens[s])
            with dist.no_sync(model, a == A - 1):
                loss, st = _batch_forward(drafter, target, data_all, idx, anchors, bw, cfg, device, weights, bf16,
                                          model)
                backward(loss / A)  # DDP then averages over the ranks: the mean over all micro-batches
            bl.merge_stats(tot, st)
        tot = d.sum_stats(tot)
        return tot["loss_sum"] / max(tot["weight_sum"], 1e-8)

    def eval_point(st: FitState) -> dict:
        ev = evaluate() if va_idx else {}
        history.append({"step": st.step, "train_loss": round(st.ema, 4), **{f"val_{k}": v for k, v in ev.items()}})
        return ev

    def postfix(st: FitState) -> dict:
        post = {"loss": f"{st.ema:.3f}"}
        if "tau_est" in (st.last_eval or {}):
            post["val_tau"] = f"{st.last_eval['tau_est']:.2f}"
        return post

    budget = Budget(cfg.steps, cfg.max_train_seconds, None if cfg.stop_after is None else step + cfg.stop_after)
    schedule = follow_budget(lambda s: cm.lr_at(s, cfg.steps, cfg.lr, cfg.warmup, cfg.min_lr_ratio), cfg.steps)
    run = fit(train_step, opt, list(params.values()), budget, schedule, cfg.grad_clip, start=step,
              evaluate=eval_point, eval_every=cfg.eval_every, checkpoint=save, save_every=cfg.save_every, bar=bar,
              postfix=postfix, sync=d.broadcast)
    if bar is not None:
        bar.close()
    step, ema, timed_out, last_eval = run.step, run.ema, run.timed_out, run.last_eval or {}
    if timed_out and va_idx:
        last_eval = evaluate()
        history.append({"step": step, "train_loss": round(ema, 4) if ema is not None else None,
                        **{f"val_{k}": v for k, v in last_eval.items()}})
    save(step)
    if step < cfg.steps and not timed_out:
        cm.log(progress, TAG, f"stopped at step {step} of {cfg.steps} (--stop-after); continue with --resume")
        return {"kind": "dflash", "steps": step, "stopped": True, "train_loss": ema, "history": history}

    t0 = time.perf_counter()
    n_tau = min(cfg.eval_tau_prompts, len(val_p))
    with fs.full_params(model):
        tau = d.main_first(lambda: runtime_tau(target, drafter, val_p[:n_tau], cfg.eval_tau_new_tokens, "dflash",
                                               device) if n_tau else {})
    tau_s = time.perf_counter() - t0
    metrics = {
        "kind": "dflash", "steps": step, "train_loss": round(ema, 4) if ema is not None else None,
        "val": last_eval, "val_runtime_tau": tau, "history": history, "mask_row": mask_info,
        "drafter_params": sum(p.numel() for p in params.values()), "target_layer_ids": list(dconf.target_layer_ids),
        "block_size": cfg.block_size, "num_layers": cfg.num_layers, "init": cfg.init, "gamma": gamma,
        "objective": cfg.objective,
        "timed_out": timed_out, "world_size": d.world, "fsdp": fs.is_sharded(model),
        "global_batch": cfg.batch_size * A * d.world,
        "train_sequences": len(tr_idx), "val_sequences": len(va_idx),
        "seconds": {"responses": round(gen_s, 2), "taps": round(taps_s, 2), "train": round(run.seconds, 2),
                    "steps_per_s": round(run.steps_run / max(run.seconds, 1e-9), 3), "eval_tau": round(tau_s, 2),
                    "total": round(time.perf_counter() - t_start, 2)},
        "config": cfg.to_dict(),
    }
    if d.is_main:
        atomic_write_text(out / "dflash_train.json", json.dumps(metrics, indent=2) + "\n")
    cm.log(progress, TAG, f"done: step {step}, train loss {metrics['train_loss']}, val {last_eval}, runtime tau {tau}")
    return metrics


def _anchor_rng(stream: int) -> str:
    return "anchors" if stream == 0 else f"anchors.{stream}"


def _resume_key(cfg: DFlashConfig) -> dict:
    d = cfg.to_dict()
    for k in ("steps", "stop_after", "max_train_seconds", "gen_workers", "eval_every", "save_every", "eval_tau_prompts",
              "eval_tau_new_tokens", "device", "threads",
              "cache_taps_mb", "gen_batch", "grad_accum", "fsdp"):  # grad_accum: the world size may change too
        d.pop(k, None)
    if not d.get("chat"):
        d.pop("chat", None)  # checkpoints from before --chat existed resume
    return d


__all__ = ["DFlashConfig", "train_dflash", "find_mask_token_id", "compute_taps", "init_drafter"]
