"""Section `scale`: ReTrace at a larger scale, a zoo-style pair trained on the machine itself.

corpus (site-packages .py, split by file) -> byte-level BPE -> Qwen3 target (~63M params on the GPU preset)
trained for a wall-time budget -> DFlash drafter (budget) -> ReTrace conditioner (budget) -> tau of dflash
vs retrace on held-out prompts, paired per prompt, T=0 and T=1 -> greedy losslessness vs the target's own
AR decode -> suffix-headroom oracles (benchmarks/suffix_headroom.py) on rollouts of training prompts.
Every stage reuses the zoo's code (retrace.train.*); only the sizes and the time budgets are new.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from retrace.gpucheck.record import log
from retrace.train import prompts as prompts_mod
from retrace.train import target_lm
from retrace.train import tokenizer as tok_mod


@dataclass(frozen=True)
class ScaleConfig:
    # corpus / tokenizer
    max_train_chars: int = 60_000_000
    max_eval_chars: int = 3_000_000
    tokenizer_chars: int = 8_000_000  # the BPE is trained on this prefix of the train files
    vocab_size: int = 8192
    # target (~63M params: 8 x 6.3M layers + 2 x 6.3M embedding / LM head)
    hidden: int = 768
    layers: int = 8
    heads: int = 12
    kv_heads: int = 4
    head_dim: int = 64
    intermediate: int = 2048
    seq_len: int = 512
    batch_size: int = 32
    lr: float = 1.5e-3
    warmup: int = 150
    target_steps: int = 6000  # the cap and the schedule's length; the budget usually ends it first
    target_seconds: float = 150.0
    compile: bool = False
    ppl_tokens: int = 262_144
    # DFlash drafter
    block_size: int = 16
    dflash_layers: int = 2
    dflash_prompts: int = 1024
    dflash_new_tokens: int = 96
    dflash_batch: int = 32
    dflash_gen_batch: int = 256
    dflash_steps: int = 4000
    dflash_lr: float = 2e-3
    dflash_seconds: float = 75.0
    # conditioner
    cond_rollout_prompts: int = 192
    cond_batch: int = 16
    cond_seconds: float = 40.0
    # evaluation
    eval_prompts: int = 64
    eval_new_tokens: int = 96
    eval_batch: int = 64
    temperatures: tuple[float, ...] = (0.0, 1.0)
    lossless_prompts: int = 8
    headroom_prompts: int = 64
    headroom_new_tokens: int = 96
    train_eval_prompts: int = 16  # runtime tau the trainers log on validation prompts
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


GPU = ScaleConfig()
DRY = ScaleConfig(max_train_chars=300_000, max_eval_chars=80_000, tokenizer_chars=300_000, vocab_size=512,
                  hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32, intermediate=192, seq_len=128,
                  batch_size=8, warmup=5, target_steps=60, target_seconds=5.0, ppl_tokens=2048, block_size=8,
                  dflash_layers=1, dflash_prompts=48, dflash_new_tokens=24, dflash_batch=8, dflash_gen_batch=48,
                  dflash_steps=30, dflash_seconds=5.0, cond_rollout_prompts=8, cond_batch=8, cond_seconds=4.0,
                  eval_prompts=6, eval_new_tokens=16, eval_batch=8, lossless_prompts=3, headroom_prompts=6,
                  headroom_new_tokens=16, train_eval_prompts=3)


def _step(result: dict, name: str, fn, save=None):
    """A sub-step whose failure is recorded but does not stop the remaining evaluation steps."""
    t = time.perf_counter()
    try:
        result[name] = fn()
    except Exception as e:  # noqa: BLE001 - recorded in the JSON
        import traceback

        result[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        result.setdefault("errors", []).append(name)
        log(f"scale/{name}: ERROR {type(e).__name__}: {e}")
    result.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 2)
    log(f"scale/{name}: {result['seconds'][name]:.1f}s")
    if save is not None:
        save()


def build_data(c: ScaleConfig, work: Path, result: dict):
    from retrace.gpucheck import site_corpus

    t = time.perf_counter()
    split = site_corpus.load(c.max_train_chars, c.max_eval_chars)
    result["corpus"] = split.summary()
    texts, n = [], 0
    for f in split.train:
        if n >= c.tokenizer_chars:
            break
        texts.append(f.text)
        n += len(f.text)
    tok = tok_mod.train_bpe(texts, c.vocab_size)
    train_stream = target_lm.pack_stream(tok_mod.encode_batch(tok, [f.text for f in split.train]), tok_mod.EOS_ID)
    eval_stream = target_lm.pack_stream(tok_mod.encode_batch(tok, [f.text for f in split.eval]), tok_mod.EOS_ID)
    result["tokenizer"] = {"vocab": tok.get_vocab_size(), "trained_on_chars": n,
                           "train_tokens": int(train_stream.numel()), "eval_tokens": int(eval_stream.numel()),
                           "seconds": round(time.perf_counter() - t, 2)}
    log(f"scale: corpus {result['corpus']['train_files']} / {result['corpus']['eval_files']} files, "
        f"tokens {result['tokenizer']}")
    evalp = prompts_mod.code_prompts(split.eval, tok, c.eval_prompts, c.seed)
    trainp = prompts_mod.train_prompts(split.train, tok, c.dflash_prompts + 64 + c.headroom_prompts, c.seed)
    prompts_mod.write_jsonl(work / "prompts" / "code.jsonl", evalp)
    prompts_mod.write_jsonl(work / "data" / "train_prompts.jsonl", trainp)
    result["prompts"] = {"eval": len(evalp), "train": len(trainp)}
    return tok, train_stream, eval_stream


def train_target(c: ScaleConfig, tok, train_stream, eval_stream, work: Path, device, result: dict) -> None:
    preset = target_lm.TargetPreset(
        vocab_size=tok.get_vocab_size(), hidden_size=c.hidden, intermediate_size=c.intermediate,
        num_layers=c.layers, num_heads=c.heads, num_kv_heads=c.kv_heads, head_dim=c.head_dim,
        max_position_embeddings=max(1024, c.seq_len), seq_len=c.seq_len, batch_size=c.batch_size,
        steps=c.target_steps, lr=c.lr, warmup_steps=c.warmup, compile=c.compile, eval_tokens=c.ppl_tokens)
    config = target_lm.make_config(preset, tok.get_vocab_size(), tok_mod.EOS_ID, tok_mod.PAD_ID)
    model = target_lm.build_model(config, c.seed).to(device)
    params = target_lm.count_params(model)
    log(f"scale: target {params['total'] / 1e6:.1f}M params, budget {c.target_seconds}s on {device}")
    st = target_lm.train_target(model, train_stream, preset, seed=c.seed, progress=False, log_every=100,
                                max_seconds=c.target_seconds)
    target_lm.reset_untrained_rows(model, [tok_mod.PAD_ID, tok_mod.MASK_ID], exclude=[tok_mod.EOS_ID])
    ev = target_lm.evaluate_ppl(model, eval_stream, c.seq_len, c.ppl_tokens, batch_size=16,
                                token_bytes=target_lm.token_byte_lengths(tok))
    result["target"] = {"params": params, **{k: v for k, v in st.items()}, "held_out_ppl": round(ev["ppl"], 3),
                        "bits_per_byte": round(ev.get("bits_per_byte", float("nan")), 4),
                        "ppl_eval_tokens": ev["eval_tokens"]}
    log(f"scale: target {st['steps']} steps, {st['tokens_per_second']:.0f} tok/s, held-out ppl {ev['ppl']:.2f}")
    target_lm.save_target(model.float().cpu(), work / "target", tok_mod.EOS_ID, tok_mod.PAD_ID)
    tok_mod.save_tokenizer(tok, work / "target", model_max_length=preset.max_position_embeddings)
    del model


def train_drafter(c: ScaleConfig, work: Path, device, result: dict) -> None:
    from retrace.train.dflash import DFlashConfig, train_dflash

    cfg = DFlashConfig(block_size=c.block_size, num_layers=c.dflash_layers, init="copy",
                       num_prompts=c.dflash_prompts, val_prompts=64, max_new_tokens=c.dflash_new_tokens,
                       gen_batch=c.dflash_gen_batch, steps=c.dflash_steps, batch_size=c.dflash_batch,
                       blocks_per_seq=16, lr=c.dflash_lr, warmup=min(60, c.dflash_steps // 10), eval_every=0,
                       save_every=0, eval_tau_prompts=c.train_eval_prompts,
                       eval_tau_new_tokens=min(64, c.dflash_new_tokens),
                       max_train_seconds=c.dflash_seconds, seed=c.seed, device=str(device))
    m = train_dflash(work / "target", work / "drafter", work / "data" / "train_prompts.jsonl", cfg, progress=False)
    result["dflash"] = {k: m.get(k) for k in ("steps", "train_loss", "val", "val_runtime_tau", "drafter_params",
                                               "timed_out", "seconds", "target_layer_ids")}
    log(f"scale: dflash {result['dflash']}")


def train_conditioner(c: ScaleConfig, work: Path, device, result: dict) -> None:
    from retrace.train.conditioner import ConditionerConfig, train_conditioner

    cfg = ConditionerConfig(phases=1, steps_per_phase=100_000, rollout_prompts=c.cond_rollout_prompts,
                            rollout_batch=min(128, c.cond_rollout_prompts), max_new_tokens=c.dflash_new_tokens,
                            num_prompts=c.dflash_prompts, val_prompts=64, eval_prompts=c.train_eval_prompts,
                            eval_new_tokens=min(64, c.dflash_new_tokens), batch_size=c.cond_batch, warmup=20,
                            diagnose_seqs=c.train_eval_prompts, max_train_seconds=c.cond_seconds, seed=c.seed,
                            device=str(device))
    m = train_conditioner(work / "target", work / "drafter", work / "data" / "train_prompts.jsonl", None, cfg,
                          progress=False)
    fin = m.get("final") or {}
    result["conditioner"] = {"steps": m.get("steps"), "mean_gate": m.get("mean_gate"), "seconds": m.get("seconds"),
                             "val_dflash_runtime_tau": m.get("val_dflash_runtime_tau"),
                             "val_retrace_runtime_tau": fin.get("val_runtime"),
                             "train_vs_dflash": fin.get("train_vs_dflash"), "diagnose": fin.get("diagnose_before")}
    log(f"scale: conditioner steps {m.get('steps')}, gate {m.get('mean_gate')}")


def evaluate(c: ScaleConfig, work: Path, device, result: dict, save=None) -> None:
    from retrace.gpucheck import decode
    from retrace.train.evaluate import tau_by_mode
    from retrace.train.rollout import make_backend, run_requests

    torch.backends.cuda.matmul.allow_tf32 = False  # decoding in fp32 proper: near-ties must not flip
    target, drafter = decode.load(work, torch.float32, device)
    prompts = decode.held_out_prompts(work, c.eval_prompts)
    modes = ("dflash", "retrace") if drafter.conditioner is not None else ("dflash",)
    for T in c.temperatures:
        def tau_at(T=T):
            rep = tau_by_mode(target, drafter, prompts, modes, c.eval_new_tokens, T, None, c.eval_batch, c.seed,
                              device)
            log(f"scale: T={T:g} " + ", ".join(f"{m} {v['tau']}" for m, v in rep["modes"].items())
                + f", paired {rep.get('paired')}")
            return rep
        _step(result, f"tau_T{T:g}", tau_at, save)

    def lossless():
        n = min(c.lossless_prompts, len(prompts))
        B = drafter.config.block_size
        max_len = max(len(p) for p in prompts[:n]) + c.eval_new_tokens + B + 2
        outs = {}
        for mode in ("ar", *modes):
            rolls, _ = run_requests(make_backend(target, drafter, n, max_len, device), prompts[:n], mode,
                                    c.eval_new_tokens, 0.0, c.seed)
            outs[mode] = [r.output_ids for r in rolls]
        return {"prompts": n, **{f"{m}_equals_ar": outs[m] == outs["ar"] for m in modes},
                "identical_prompts": {m: sum(a == b for a, b in zip(outs[m], outs["ar"], strict=True))
                                      for m in modes}}
    _step(result, "lossless", lossless, save)

    def headroom():
        import tempfile

        from benchmarks import suffix_headroom as sh
        from retrace.train.datasets_io import prepare_prompts

        train, _ = prepare_prompts(work / "target", work / "data" / "train_prompts.jsonl", 256, None, 64, 0)
        with tempfile.TemporaryDirectory() as tmp:
            rows = sh.block_rows(work / "target", sh.zero_conditioner_copy(work / "drafter", Path(tmp)),
                                 train[-c.headroom_prompts:], c.headroom_new_tokens, 123, device=device)
        return sh.analyse(rows)
    _step(result, "headroom", headroom, save)


def run(result: dict, c: ScaleConfig, work: Path, device: torch.device, save=None) -> None:
    """`save()` rewrites the report: called after every stage, so a timeout keeps what was measured."""
    save = save or (lambda: None)
    result["config"] = c.to_dict()
    result["work_dir"] = str(work)
    torch.backends.cuda.matmul.allow_tf32 = True  # training: TF32 where fp32 remains (bf16 autocast elsewhere)
    torch.backends.cudnn.allow_tf32 = True
    t = time.perf_counter()
    tok, train_stream, eval_stream = build_data(c, work, result)
    result.setdefault("seconds", {})["data"] = round(time.perf_counter() - t, 2)
    save()
    for name, fn in (("target", lambda: train_target(c, tok, train_stream, eval_stream, work, device, result)),
                     ("dflash", lambda: train_drafter(c, work, device, result))):
        t = time.perf_counter()
        fn()  # nothing after these can run without them: their errors end the section
        result["seconds"][name] = round(time.perf_counter() - t, 2)
        log(f"scale/{name}: {result['seconds'][name]:.1f}s")
        save()
    # without a conditioner the evaluation still measures dflash and the headroom oracles
    _step(result, "conditioner_stage", lambda: train_conditioner(c, work, device, result), save)
    evaluate(c, work, device, result, save)
    if result.get("errors"):
        raise RuntimeError(f"scale sub-steps failed: {result['errors']}")


def with_overrides(c: ScaleConfig, **kw) -> ScaleConfig:
    return replace(c, **{k: v for k, v in kw.items() if v is not None})
