"""Tiny Qwen3 target models for the offline model zoo, trained on CPU with a plain torch loop.

The model is a stock ``transformers`` ``Qwen3ForCausalLM`` (RMSNorm, GQA with q/k norms, RoPE, SwiGLU),
so everything downstream (drafter training, exporters, runtimes) sees the same architecture and the
same checkpoint format as a real Qwen3 target, only smaller.

Training: documents are joined with ``<|endoftext|>`` into one token stream, cut into non-overlapping
windows of ``seq_len + 1`` tokens at a random offset per epoch and read in a seeded random order;
AdamW (weight decay on the linear weights only: embeddings and norms are not decayed), linear warmup
then cosine decay, gradient clipping, fp32 (bf16 autocast is an option; its oneDNN kernels differ per CPU,
see retrace.train.numerics; speeds: docs/bench/zoo.md).  Deterministic for a given seed; bit-identical
across machines under numerics.PORTABLE_ENV.

The untrained special rows (``<|pad|>`` and the DFlash ``<|mask|>``) of the input embedding never receive
a gradient; since embeddings are excluded from weight decay they keep their (tiny) init.  After
training they are reset to the mean trained embedding rescaled to the mean trained row norm (see
:func:`reset_untrained_rows`), so the mask embedding is a typical-norm vector, not ~0.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if "torch" not in sys.modules:
    # libgomp reads this once, when torch loads it.  With the default (active spinning) a 2-thread training
    # step on a 2-core machine that other processes also use ran ~5x slower than with PASSIVE (measured:
    # 8-11 s vs 1.6-1.8 s per step at load 7); results are bit-identical either way.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from retrace.models.checkpoint import plain_modes  # noqa: E402
from retrace.train import common as cm  # noqa: E402
from retrace.train.fit import Budget, FitState, fit, follow_budget  # noqa: E402
from retrace.train.options import setting  # noqa: E402


@dataclass(frozen=True)
class TargetPreset:
    """A zoo target: its Qwen3 shape and how it trains (the presets below; `get_preset` overrides fields)."""

    # model
    vocab_size: int = setting(help="vocabulary (the tokenizer's size when it is smaller)")
    hidden_size: int = setting(help="hidden width")
    intermediate_size: int = setting(help="SwiGLU width")
    num_layers: int = setting(help="decoder layers")
    num_heads: int = setting(help="query heads")
    num_kv_heads: int = setting(help="key/value heads (GQA)")
    head_dim: int = setting(help="width of a head")
    max_position_embeddings: int = setting(help="longest context")
    rope_theta: float = setting(1_000_000.0, "Qwen3's value (a non-default theta exposes readers that ignore it)")
    tie_embeddings: bool = setting(False, "the LM head shares the input embedding")
    # training
    seq_len: int = setting(256, "tokens per training window")
    batch_size: int = setting(16, "windows per step")
    steps: int = setting(100, "optimizer steps")
    lr: float = setting(2e-3, "peak learning rate")
    min_lr_ratio: float = setting(0.1, "the cosine schedule ends at this fraction of lr")
    warmup_steps: int = setting(20, "linear warmup steps")
    weight_decay: float = setting(0.1, "AdamW weight decay (linear weights only)")
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW betas")
    grad_clip: float = setting(1.0, "gradient-norm clipping")
    bf16: bool = setting(False, "bf16 autocast: see the module docstring (numerics)")
    compile: bool = setting(False, "torch.compile the training forward/backward (falls back to eager if it fails)")
    init_std: float = setting(0.02, "std of the initial weights")
    # evaluation
    eval_tokens: int = setting(32_768, "held-out tokens of the perplexity")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


PRESETS: dict[str, TargetPreset] = {
    # CI-sized: ~0.1M params, a few seconds of training; learns enough to be clearly non-random.
    "test": TargetPreset(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=192,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        seq_len=128,
        batch_size=16,
        steps=150,
        lr=3e-3,
        warmup_steps=15,
        eval_tokens=8192,
    ),
    # Demo/benchmark target: see the module docstring of retrace.train.zoo_target for the sizing.
    "small": TargetPreset(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        seq_len=512,
        batch_size=8,
        steps=950,
        lr=2e-3,
        warmup_steps=60,
        eval_tokens=131_072,
    ),
}


def get_preset(size: str, **overrides) -> TargetPreset:
    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; expected one of {sorted(PRESETS)}")
    return replace(PRESETS[size], **overrides) if overrides else PRESETS[size]


# ----------------------------------------------------------------------------------------------- threads


def default_num_threads() -> int:
    """Cores this process may use (affinity-aware), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, n)


@contextlib.contextmanager
def torch_threads(n: int | None = None) -> Iterator[int]:
    """Temporarily set ``torch.set_num_threads`` (default: all usable cores); restores the old value."""
    n = default_num_threads() if n is None else max(1, int(n))
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------------- model


def make_config(preset: TargetPreset, vocab_size: int | None = None, eos_id: int = 0, pad_id: int = 1):
    from transformers import Qwen3Config

    n = preset.num_layers
    return Qwen3Config(
        vocab_size=int(vocab_size or preset.vocab_size),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(preset.rope_theta)},
        tie_word_embeddings=preset.tie_embeddings,
        initializer_range=preset.init_std,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=n,
        layer_types=["full_attention"] * n,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        architectures=["Qwen3ForCausalLM"],
    )


def build_model(config, seed: int):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(config)
    return model.float()


def count_params(model) -> dict:
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight
    head_n = 0 if head is model.get_input_embeddings().weight else head.numel()
    return {"total": total, "embedding": emb, "lm_head": head_n, "non_embedding": total - emb - head_n}


# -------------------------------------------------------------------------------------------------- data


def pack_stream(docs: Sequence[Sequence[int]], eos_id: int) -> torch.Tensor:
    """Concatenate token lists, each followed by ``eos_id``, into one 1-D int64 tensor."""
    total = sum(len(d) + 1 for d in docs)
    out = torch.empty(total, dtype=torch.int64)
    i = 0
    for d in docs:
        n = len(d)
        out[i : i + n] = torch.as_tensor(d, dtype=torch.int64)
        out[i + n] = eos_id
        i += n + 1
    return out


def iter_batches(
    stream: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless [batch, seq_len + 1] windows: non-overlapping within an epoch, random offset and order."""
    w = seq_len + 1
    if stream.numel() < w * batch_size:
        raise ValueError(f"stream of {stream.numel()} tokens is too short for {batch_size}x{w} windows")
    while True:
        off = int(torch.randint(0, w, (1,), generator=gen))
        n = (stream.numel() - off) // w
        chunks = stream[off : off + n * w].view(n, w)
        order = torch.randperm(n, generator=gen)
        for i in range(0, n - batch_size + 1, batch_size):
            yield chunks[order[i : i + batch_size]]


def lr_at(step: int, preset: TargetPreset) -> float:
    """Linear warmup, then cosine to lr x min_lr_ratio: the curve of common.lr_at in another rounding, kept as the
    zoo targets were trained with it (it differs from common.lr_at in the last bit at 346 of the 1100 steps of the
    two presets, and every bit of the learning rate reaches the weights)."""
    if step < preset.warmup_steps:
        return preset.lr * (step + 1) / preset.warmup_steps
    t = (step - preset.warmup_steps) / max(1, preset.steps - preset.warmup_steps)
    floor = preset.lr * preset.min_lr_ratio
    return floor + (preset.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


def param_groups(model, weight_decay: float) -> list[dict]:
    """Weight decay on linear weights only; embeddings (incl. the never-trained mask row) and norms excluded."""
    emb = model.get_input_embeddings().weight
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (no_decay if p is emb or p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def compiled(model):
    """torch.compile'd view of `model` (same parameters). On 2 CPU cores it costs ~20 s once and makes a small
    preset step 0.57 -> 0.41 s (RMSNorm, RoPE and SiLU fused); shapes are fixed, so it compiles once."""
    try:
        return torch.compile(model)
    except Exception:  # noqa: BLE001
        return model


def _lm_loss(model, batch: torch.Tensor, bf16: bool) -> torch.Tensor:
    inp, tgt = batch[:, :-1], batch[:, 1:]
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=inp, use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def train_target(
    model,
    stream: torch.Tensor,
    preset: TargetPreset,
    seed: int = 0,
    progress: bool = True,
    log_every: int = 50,
    max_seconds: float | None = None,
) -> dict:
    """Train ``model`` in place on ``stream``; returns stats (loss curve, tokens, seconds, tokens/s).

    Batches go to the model's device. ``max_seconds``: stop after that much wall time (or ``preset.steps``,
    whichever comes first); the learning-rate schedule then follows the elapsed fraction of the budget, so
    a time-bounded run still warms up and decays fully.
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(
        param_groups(model, preset.weight_decay), lr=preset.lr, betas=preset.betas, eps=1e-8, foreach=True
    )
    batches = iter_batches(stream, preset.seq_len, preset.batch_size, gen)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    curve: list[tuple[int, float]] = []
    fwd = [compiled(model) if preset.compile else model]
    t0 = time.perf_counter()
    c0 = time.process_time()

    def train_step(_st: FitState, backward) -> float:
        batch = next(batches).to(device, non_blocking=True)
        try:
            loss = _lm_loss(fwd[0], batch, preset.bf16)
        except Exception as e:  # noqa: BLE001 - no compiler, unsupported op, ...: the eager model is the same
            if fwd[0] is model:
                raise
            print(f"[zoo target] torch.compile failed ({type(e).__name__}: {str(e)[:200]}); training eagerly",
                  file=sys.stderr)
            fwd[0] = model
            loss = _lm_loss(model, batch, preset.bf16)
        backward(loss)
        return loss.item()

    def log_curve(st: FitState) -> None:
        if (st.step - 1) % log_every == 0 or st.step == preset.steps:
            curve.append((st.step - 1, round(st.loss, 4)))

    def postfix(st: FitState) -> dict:
        tok_s = st.step * preset.batch_size * preset.seq_len / (time.perf_counter() - t0)
        return {"loss": f"{st.ema:.3f}", "tok_s": f"{tok_s:.0f}"}

    bar = cm.progress_bar(preset.steps, "target", progress)
    run = fit(train_step, opt, params, Budget(preset.steps, max_seconds),
              follow_budget(lambda s: lr_at(s, preset), preset.steps), preset.grad_clip, on_step=log_curve, bar=bar,
              postfix=postfix)
    if bar is not None:
        bar.close()
    steps_run, ema = run.steps_run, run.ema
    secs = time.perf_counter() - t0
    cpu = time.process_time() - c0
    tokens = steps_run * preset.batch_size * preset.seq_len
    model.eval()
    return {
        "steps": steps_run,
        "train_tokens": tokens,
        "stream_tokens": int(stream.numel()),
        "epochs": round(tokens / max(1, stream.numel()), 3),
        "train_seconds": round(secs, 2),
        "train_cpu_seconds": round(cpu, 2),  # all threads; ~ threads x wall on an otherwise idle machine
        "tokens_per_second": round(tokens / max(secs, 1e-9), 1),
        "final_loss_ema": round(float(ema), 4) if ema is not None else None,
        "loss_curve": curve,
    }


# ------------------------------------------------------------------------------------------- evaluation


def token_byte_lengths(tok) -> torch.Tensor:
    """Bytes of text each token id stands for (specials: 0), for a byte-level BPE tokenizer."""
    raw = getattr(tok, "backend_tokenizer", tok)
    vocab = raw.get_vocab(with_added_tokens=True)
    special = {t.content for t in raw.get_added_tokens_decoder().values() if t.special}
    out = torch.zeros(max(vocab.values()) + 1, dtype=torch.float64)
    for t, i in vocab.items():
        out[i] = 0 if t in special else len(t)  # ByteLevel maps each byte to one character
    return out


@torch.no_grad()
def evaluate_ppl(
    model,
    stream: torch.Tensor,
    seq_len: int,
    max_tokens: int | None = None,
    batch_size: int = 16,
    token_bytes: torch.Tensor | None = None,
) -> dict:
    """Held-out perplexity over non-overlapping windows of ``seq_len`` predicted tokens (fp32)."""
    w = seq_len + 1
    n = (stream.numel() - 1) // seq_len
    if max_tokens is not None:
        n = min(n, max(1, max_tokens // seq_len))
    if n < 1:
        raise ValueError("eval stream too short")
    starts = torch.arange(n) * seq_len
    device = next(model.parameters()).device
    nll, count, nbytes = 0.0, 0, 0.0
    was_training = model.training
    model.eval()
    for i in range(0, n, batch_size):
        idx = starts[i : i + batch_size, None] + torch.arange(w)[None, :]
        batch = stream[idx.clamp_max(stream.numel() - 1)]
        logits = model(input_ids=batch[:, :-1].to(device), use_cache=False).logits.float()
        tgt = batch[:, 1:].to(device)
        nll += float(
            torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"
            )
        )
        count += tgt.numel()
        if token_bytes is not None:
            nbytes += float(token_bytes[batch[:, 1:]].sum())
    model.train(was_training)
    out = {"eval_tokens": count, "nll": nll / count, "ppl": math.exp(nll / count)}
    if token_bytes is not None and nbytes > 0:
        out["bits_per_byte"] = nll / math.log(2) / nbytes
    return out


# ------------------------------------------------------------------------------------------ finishing


@torch.no_grad()
def reset_untrained_rows(model, rows: Sequence[int], exclude: Sequence[int] = ()) -> dict:
    """Set input-embedding ``rows`` to the mean of the other rows, rescaled to their mean L2 norm.

    Used for ``<|pad|>`` and ``<|mask|>``: rows no input ever used.  Returns norms before/after.
    With tied embeddings this would also move the output row, so it refuses.
    """
    emb = model.get_input_embeddings().weight
    if model.get_output_embeddings() is not None and model.get_output_embeddings().weight is emb:
        raise ValueError("reset_untrained_rows needs untied embeddings (the row is also an LM-head row)")
    skip = set(int(r) for r in rows) | set(int(r) for r in exclude)
    keep = torch.tensor([i for i in range(emb.shape[0]) if i not in skip])
    trained = emb[keep].float()
    mean = trained.mean(0)
    target_norm = trained.norm(dim=1).mean()
    new = mean * (target_norm / mean.norm().clamp_min(1e-12))
    before = {int(r): round(float(emb[r].norm()), 4) for r in rows}
    for r in rows:
        emb[int(r)] = new.to(emb.dtype)
    return {
        "rows": [int(r) for r in rows],
        "norm_before": before,
        "norm_after": round(float(new.norm()), 4),
        "mean_row_norm": round(float(target_norm), 4),
    }


def generation_config_for(eos_id: int, pad_id: int, max_length: int):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False, max_length=max_length
    )


def save_target(model, out_dir: str | Path, eos_id: int = 0, pad_id: int = 1) -> list[str]:
    """Write config.json, model.safetensors (fp32) and generation_config.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    model.generation_config = generation_config_for(eos_id, pad_id, model.config.max_position_embeddings)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Writing model shards" bar: noise, even under --quiet
    try:
        model.save_pretrained(str(out_dir), safe_serialization=True)
        plain_modes(out_dir)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return sorted(p.name for p in out_dir.iterdir())


@torch.no_grad()
def greedy_continue(
    model, input_ids: Sequence[int], max_new_tokens: int, eos_id: int | None = None
) -> list[int]:
    """Plain greedy decode with the HF cache (no ``generate`` config surprises); stops at ``eos_id``."""
    model.eval()
    ids = torch.tensor([list(input_ids)], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    nxt = int(out.logits[0, -1].argmax())
    new = [nxt]
    for _ in range(max_new_tokens - 1):
        if eos_id is not None and nxt == eos_id:
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = int(out.logits[0, -1].argmax())
        new.append(nxt)
    return new


def repetition_stats(ids: Sequence[int]) -> dict:
    """Degeneracy indicators for a generated sequence: distinct-token fraction and longest single-token run."""
    if not ids:
        return {"distinct_frac": 0.0, "longest_run": 0}
    longest = run = 1
    for a, b in zip(ids, ids[1:], strict=False):
        run = run + 1 if a == b else 1
        longest = max(longest, run)
    return {"distinct_frac": round(len(set(ids)) / len(ids), 3), "longest_run": longest}
