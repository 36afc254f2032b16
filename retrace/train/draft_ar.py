"""An autoregressive draft model for onnxruntime-genai's own speculative decoding (the `ortgenai-draft` peer).

A stock 1-2 layer `Qwen3ForCausalLM` with the target's tokenizer, hidden size and vocabulary, initialised
from the target (embedding, LM head, final norm and its first layers copied), then distilled for a bounded
time on the target's own greedy responses to training prompts: KL(target || draft) over every position of
prompt + response, the target's logits computed per batch (cheap at zoo sizes). Saved as an HF Qwen3 dir
with the target's tokenizer files, so onnxruntime-genai's builder exports it like any Qwen3.

Cached: OUT/draft_ar.json keeps the key (target content, prompts file, settings); the same key returns at
once. Atomic: built in a temporary directory beside OUT and renamed into place.

`pad_vocab` widens a draft trained at a small vocabulary to the target's (the inflated 0.6B-shape pair):
the extra embedding and LM-head rows are zero, and `never_produce_padded` (retrace.bench.builds) adds a
-1e9 bias to those ids' logits in the exported ONNX graph, so the draft never proposes them.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from retrace.errors import RetraceError
from retrace.models.checkpoint import plain_modes
from retrace.output_dir import staged_output
from retrace.train.config import DraftArConfig

META = "draft_ar.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


def _key(target_dir: Path, data: Path, cfg: DraftArConfig) -> dict:
    from retrace.digest import dir_digest, sha256_file

    return {"version": 1, "target": dir_digest(target_dir), "data": sha256_file(data)[:16], "config": asdict(cfg)}


def cached(out: str | Path, key: dict) -> dict | None:
    p = Path(out) / META
    try:
        meta = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if meta.get("key") == key and (Path(out) / "config.json").is_file() else None


def draft_config(target_config, layers: int):
    """The target's Qwen3 config cut to `layers` decoder layers (every other field kept)."""
    cfg = target_config.__class__.from_dict(target_config.to_dict())
    cfg.num_hidden_layers = layers
    cfg.max_window_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types[:layers])
    return cfg


def init_from_target(draft, target) -> None:
    """Copy embedding, final norm, LM head and the first decoder layers of the target into the draft."""
    src = target.state_dict()
    own = draft.state_dict()
    missing = [k for k in own if k not in src]
    if missing:
        raise RetraceError(f"draft init: target has no {missing[0]}")
    draft.load_state_dict({k: src[k].clone() for k in own})


def _train_loop(draft, target, seqs: list[list[int]], cfg: DraftArConfig, pad_id: int, log) -> dict:
    import torch
    import torch.nn.functional as F

    from retrace.train import common as cm
    from retrace.train.fit import Budget, fit

    gen = torch.Generator().manual_seed(cfg.seed)
    params = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    opt = cm.make_adamw(params, cfg.lr, 0.0)
    draft.train()
    t0 = time.perf_counter()
    curve = []

    def schedule(step: int, spent: float) -> float:
        # the schedule runs on whichever budget (steps or seconds) is nearer its end
        frac = max(step / cfg.max_steps, spent)
        at = step if step < cfg.warmup else cfg.warmup + int(frac * 10_000)
        return cm.lr_at(at, cfg.warmup + 10_000, cfg.lr, cfg.warmup)

    def train_step(_st, backward) -> float:
        idx = torch.randint(len(seqs), (cfg.batch_size,), generator=gen).tolist()
        L = max(len(seqs[i]) for i in idx)
        ids = torch.full((len(idx), L), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(idx), L), dtype=torch.int64)
        for r, i in enumerate(idx):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
            mask[r, : len(seqs[i])] = 1
        with torch.no_grad():
            t_logits = target(input_ids=ids, attention_mask=mask).logits.float()
        d_logits = draft(input_ids=ids, attention_mask=mask).logits.float()
        m = mask.bool()
        kl = F.kl_div(F.log_softmax(d_logits[m], -1), F.log_softmax(t_logits[m], -1), log_target=True,
                      reduction="batchmean")
        backward(kl)
        return kl.item()

    def log_curve(st) -> None:
        if (st.step - 1) % 25 == 0:
            curve.append((st.step - 1, round(st.ema, 4)))
            log(f"step {st.step - 1} kl {st.ema:.4f}")

    run = fit(train_step, opt, [p for _, p in params], Budget(cfg.max_steps, cfg.seconds), schedule, 1.0,
              on_step=log_curve, name="draft-ar")
    draft.eval()
    return {"steps": run.step, "train_s": round(time.perf_counter() - t0, 2), "final_kl_ema": run.ema,
            "curve": curve}


def greedy_agreement(draft, target, seqs: list[list[int]]) -> float:
    """Share of positions where the draft's argmax equals the target's (teacher-forced, held-out sequences)."""
    import torch

    hit = tot = 0
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            a = draft(input_ids=ids).logits.argmax(-1)
            b = target(input_ids=ids).logits.argmax(-1)
            hit += int((a == b).sum())
            tot += a.numel()
    return hit / max(1, tot)


def train_draft_ar(target_dir: str | Path, out_dir: str | Path, data: str | Path, cfg: DraftArConfig | None = None,
                   progress: bool = True) -> dict:
    """Distil a `cfg.layers`-layer Qwen3 draft from the target on its greedy responses to the prompts in `data`
    (JSONL, {'prompt'} or {'prompt_ids'}); write it to out_dir (HF Qwen3 dir + tokenizer + draft_ar.json)."""
    import torch
    from transformers import AutoConfig, Qwen3ForCausalLM

    from retrace.models.target import Qwen3Target
    from retrace.runtime.tokenizer import TextCodec
    from retrace.train import common as cm
    from retrace.train.rollout import generate

    cfg = cfg or DraftArConfig()
    target_dir, out, data = Path(target_dir), Path(out_dir), Path(data)
    if not (target_dir / "config.json").is_file():
        raise RetraceError(f"{target_dir}: not an HF Qwen3 directory (no config.json)")
    if not data.is_file():
        raise RetraceError(f"{data}: no such prompts file")
    if not 1 <= cfg.layers <= 4:
        raise RetraceError(f"draft-ar: --layers must be 1-4, got {cfg.layers}")
    key = _key(target_dir, data, cfg)
    hit = cached(out, key)
    if hit is not None:
        return hit

    def log(msg: str) -> None:
        cm.log(progress, "draft-ar", msg)

    t_all = time.perf_counter()
    with cm.torch_threads(cfg.threads):
        torch.manual_seed(cfg.seed)
        codec = TextCodec.find(target_dir)
        rows = cm.read_prompts_jsonl(data)[: cfg.num_prompts]
        prompts = [p[-cfg.max_prompt_len:] for p in cm.encode_prompts(rows, codec) if p]
        if len(prompts) < 4:
            raise RetraceError(f"{data}: needs at least 4 non-empty prompts, got {len(prompts)}")
        tcfg = AutoConfig.from_pretrained(target_dir)
        target = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        log(f"generating {len(prompts)} greedy responses x {cfg.max_new_tokens} tokens with the target")
        t0 = time.perf_counter()
        responses = generate(Qwen3Target.from_pretrained(target_dir), prompts, cfg.max_new_tokens, cfg.gen_batch)
        gen_s = time.perf_counter() - t0
        seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
        n_val = max(2, len(seqs) // 16)
        train, val = seqs[n_val:], seqs[:n_val]
        draft = Qwen3ForCausalLM(draft_config(tcfg, cfg.layers)).float()
        init_from_target(draft, target)
        agree0 = greedy_agreement(draft, target, val)
        pad = tcfg.pad_token_id if tcfg.pad_token_id is not None else 0
        log(f"distilling a {cfg.layers}-layer draft for up to {cfg.seconds:.0f} s")
        tr = _train_loop(draft, target, train, cfg, int(pad), log)
        agree = greedy_agreement(draft, target, val)
        log(f"greedy agreement with the target on {len(val)} held-out sequences: {agree0:.3f} -> {agree:.3f}")
        with staged_output(out, "draft-ar", force=True, what="AR draft model") as tmp:
            draft.generation_config = target.generation_config
            draft.save_pretrained(str(tmp), safe_serialization=True)
            plain_modes(tmp)
            for f in TOKENIZER_FILES:
                if (target_dir / f).is_file():
                    shutil.copy2(target_dir / f, tmp / f)
            meta = {"key": key, "layers": cfg.layers,
                    "params": sum(p.numel() for p in draft.parameters()),
                    "target_params": sum(p.numel() for p in target.parameters()),
                    "greedy_agreement_init": agree0, "greedy_agreement": agree, "val_sequences": len(val),
                    "train": tr, "responses_s": round(gen_s, 2), "total_s": round(time.perf_counter() - t_all, 2)}
            (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def pad_vocab(src: str | Path, out: str | Path, vocab_size: int) -> Path:
    """Copy the HF Qwen3 dir `src` to `out` with its vocabulary widened to `vocab_size`: the new embedding
    and LM-head rows are zero (a padded id's logit is then exactly 0: see never_produce_padded)."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    cfg = json.loads((src / "config.json").read_text())
    old = int(cfg["vocab_size"])
    if vocab_size < old:
        raise RetraceError(f"pad_vocab: {src} has vocab {old} > {vocab_size}")
    with staged_output(out, "padded-model", force=True, what="vocab-padded model") as tmp:
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        w = load_file(src / "model.safetensors")
        for k in ("model.embed_tokens.weight", "lm_head.weight"):
            if k in w:
                pad = torch.zeros((vocab_size - old, w[k].shape[1]), dtype=w[k].dtype)
                w[k] = torch.cat([w[k], pad]).contiguous()
        save_file(w, tmp / "model.safetensors", metadata={"format": "pt"})
        cfg["vocab_size"] = vocab_size
        cfg["retrace_padded_vocab"] = {"real_vocab_size": old}
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


__all__ = ["DraftArConfig", "train_draft_ar", "pad_vocab", "draft_config", "init_from_target"]
