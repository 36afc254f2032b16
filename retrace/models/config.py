"""Config parsing for Qwen3 targets, DFlash drafters and ReTrace conditioners.

Both RoPE forms are read: transformers 4.x writes `rope_theta` at the top level, transformers 5 writes
`rope_parameters: {rope_type, rope_theta}`. A checkpoint that uses a feature we do not implement
(rope scaling, sliding windows, attention bias) is refused with a message instead of silently differing.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from retrace.errors import CheckpointError, UnsupportedConfigError


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(cfg).__name__}")
    return cfg


@contextmanager
def _bad_values(path: Path):
    """Turn int()/float()/.get() failures on malformed config values into one CheckpointError naming the file."""
    try:
        yield
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: invalid value in config ({type(e).__name__}: {e})") from None


def _count(cfg: dict, key: str, path: Path, default: int | None = None) -> int:
    """cfg[key] as a positive integer (2048.0 is fine; 2048.5, -5, "8" and true are not)."""
    v = cfg.get(key, default)
    ok = (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
    if not ok or int(v) < 1:
        raise CheckpointError(f"{path}: {key}={v!r} must be a positive integer")
    return int(v)


def _dir(directory: str | Path, what: str) -> Path:
    d = Path(directory)
    if d.is_file():
        raise CheckpointError(f"{d}: is a file; the {what} is a directory (with config.json and *.safetensors)")
    if not d.is_dir():
        raise CheckpointError(f"{d}: {what} not found")
    return d


def _require(cfg: dict, keys: list[str], path: Path) -> None:
    missing = [k for k in keys if k not in cfg]
    if missing:
        raise CheckpointError(f"{path}: missing required config keys {missing}")


def _theta(v, key: str, path: Path) -> float:
    """A RoPE base: a positive, finite number (not a string, not a bool)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise CheckpointError(f"{path}: {key}={v!r} must be a positive number")
    return float(v)


def parse_rope_theta(cfg: dict, path: Path, default: float | None = None) -> float:
    """The RoPE base from either form. Scaled RoPE is refused in both (transformers merges a legacy
    `rope_scaling` into `rope_parameters`, so a linear `rope_scaling` beside `rope_parameters` would apply)."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedConfigError(f"{path}: rope_scaling type {rope_type!r} is not supported (only default "
                                         "RoPE)")
    if isinstance(params, dict) and params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedConfigError(f"{path}: rope_parameters.rope_type={rope_type!r} is not supported (only "
                                         "'default')")
        if "rope_theta" in params:
            return _theta(params["rope_theta"], "rope_parameters.rope_theta", path)
    if "rope_theta" in cfg:
        return _theta(cfg["rope_theta"], "rope_theta", path)
    if default is not None:
        return default
    raise CheckpointError(f"{path}: no RoPE theta (neither 'rope_theta' nor 'rope_parameters.rope_theta')")


def _refuse_sliding(cfg: dict, path: Path) -> None:
    if cfg.get("use_sliding_window"):
        raise UnsupportedConfigError(f"{path}: use_sliding_window=true is not supported (full attention only)")
    layer_types = cfg.get("layer_types") or []
    bad = sorted({t for t in layer_types if t != "full_attention"})
    if bad:
        raise UnsupportedConfigError(f"{path}: layer_types {bad} are not supported (full_attention only)")
    if cfg.get("attention_bias"):
        raise UnsupportedConfigError(f"{path}: attention_bias=true is not supported by Qwen3 adapters here")


@dataclass(frozen=True)
class LayerConfig:
    """The decoder-layer geometry shared by the target and the drafter."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    def validate(self, path: Path) -> None:
        for k, v in asdict(self).items():
            if isinstance(v, int) and v <= 0:
                raise CheckpointError(f"{path}: {k}={v} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                f"{path}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise CheckpointError(f"{path}: head_dim={self.head_dim} must be even for RoPE")


def _layer_config(cfg: dict, path: Path, default_theta: float | None = None) -> LayerConfig:
    _require(cfg, ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps"],
             path)
    heads = _count(cfg, "num_attention_heads", path)
    hidden = _count(cfg, "hidden_size", path)
    eps = cfg["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps <= 0:
        raise CheckpointError(f"{path}: rms_norm_eps={eps!r} must be a positive number")
    lc = LayerConfig(
        hidden_size=hidden,
        intermediate_size=_count(cfg, "intermediate_size", path),
        num_hidden_layers=_count(cfg, "num_hidden_layers", path),
        num_attention_heads=heads,
        num_key_value_heads=(_count(cfg, "num_key_value_heads", path, heads) if cfg.get("num_key_value_heads")
                             else heads),
        head_dim=_count(cfg, "head_dim", path) if cfg.get("head_dim") else hidden // heads,
        rms_norm_eps=float(eps),
        rope_theta=parse_rope_theta(cfg, path, default_theta),
    )
    lc.validate(path)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfigError(f"{path}: hidden_act={act!r} is not supported (silu only)")
    return lc


def _int_list(v) -> list[int]:
    if v is None:
        return []
    return [int(x) for x in (v if isinstance(v, list) else [v])]


@dataclass(frozen=True)
class Qwen3Config:
    layers: LayerConfig
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def num_hidden_layers(self) -> int:
        return self.layers.num_hidden_layers

    @classmethod
    def from_dict(cls, cfg: dict, path: Path, generation: dict | None = None) -> Qwen3Config:
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type not in (None, "qwen3") and "Qwen3ForCausalLM" not in archs:
            raise UnsupportedConfigError(f"{path}: model_type={model_type!r} is not a Qwen3 causal LM")
        _refuse_sliding(cfg, path)
        _require(cfg, ["vocab_size"], path)
        eos = _int_list((generation or {}).get("eos_token_id")) or _int_list(cfg.get("eos_token_id"))
        return cls(
            layers=_layer_config(cfg, path),
            vocab_size=_count(cfg, "vocab_size", path),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=_count(cfg, "max_position_embeddings", path, 40960),
            eos_token_ids=tuple(eos),
            pad_token_id=cfg.get("pad_token_id"),
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, directory: str | Path) -> Qwen3Config:
        d = _dir(directory, "target directory")
        gen_path = d / "generation_config.json"
        generation = read_json(gen_path) if gen_path.is_file() else None
        with _bad_values(d / "config.json"):
            return cls.from_dict(read_json(d / "config.json"), d / "config.json", generation)

    def to_dict(self) -> dict:
        return asdict(self)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps: one per drafter layer, evenly spaced over layers 1..n-3 (n // 2 for one layer)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    layers: LayerConfig
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_dict(cls, cfg: dict, path: Path, default_theta: float | None = None) -> DrafterConfig:
        _refuse_sliding(cfg, path)
        dflash = cfg.get("dflash_config") or {}
        mask_id = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if mask_id is None:
            raise CheckpointError(f"{path}: missing dflash_config.mask_token_id")
        _require(cfg, ["block_size", "vocab_size"], path)
        layers = _layer_config(cfg, path, default_theta)
        n_target = cfg.get("num_target_layers")
        ids = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if ids is None:
            if n_target is None:
                raise CheckpointError(f"{path}: needs dflash_config.target_layer_ids or num_target_layers")
            ids = default_target_layer_ids(int(n_target), layers.num_hidden_layers)
        block = int(cfg["block_size"])
        if block < 2:
            raise CheckpointError(f"{path}: block_size={block} must be >= 2")
        return cls(
            layers=layers,
            vocab_size=_count(cfg, "vocab_size", path),
            block_size=block,
            mask_token_id=int(mask_id),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=None if n_target is None else int(n_target),
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, directory: str | Path) -> DrafterConfig:
        d = _dir(directory, "drafter directory")
        with _bad_values(d / "config.json"):
            return cls.from_dict(read_json(d / "config.json"), d / "config.json")

    def check_fits(self, target: Qwen3Config, where: Path) -> None:
        """Every way a drafter can fail to fit its target, as one clear message."""
        problems = []
        if self.hidden_size != target.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab_size {target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} is outside the target vocab (size "
                            f"{target.vocab_size})")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} do not exist in a {target.num_hidden_layers}-layer target")
        if self.num_target_layers is not None and self.num_target_layers != target.num_hidden_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target's {target.num_hidden_layers} layers")
        if problems:
            raise CheckpointError(f"{where}: drafter does not fit the target: " + "; ".join(problems))

    def to_zlab_dict(self) -> dict:
        lc = self.layers
        out = dict(self.raw)
        out.pop("rope_parameters", None)
        out.update(
            architectures=["DFlashDraftModel"],
            model_type=out.get("model_type", "qwen3"),
            hidden_size=lc.hidden_size,
            intermediate_size=lc.intermediate_size,
            num_hidden_layers=lc.num_hidden_layers,
            num_attention_heads=lc.num_attention_heads,
            num_key_value_heads=lc.num_key_value_heads,
            head_dim=lc.head_dim,
            rms_norm_eps=lc.rms_norm_eps,
            rope_theta=lc.rope_theta,
            hidden_act="silu",
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            dflash_config={"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
        )
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        return out
