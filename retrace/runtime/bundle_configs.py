"""The model configs of an engine bundle, read from its manifest (the bundle's graph directories hold
only the ONNX files): shared by every backend that runs a bundle (ONNX Runtime, TensorRT)."""

from __future__ import annotations

import dataclasses

from retrace.engines.bundle import Bundle, BundleError
from retrace.models.config import DrafterConfig, Qwen3Config


def bundle_configs(bundle: Bundle) -> tuple[Qwen3Config, DrafterConfig | None]:
    """(target config with the bundle's EOS ids, drafter config with the bundle's block size or None)."""
    tm = bundle.model("target")
    if tm is None or bundle.graph("target") is None:
        raise BundleError(f"{bundle.root}: bundle has no target model")
    where = bundle.root / "manifest.json"
    target = Qwen3Config.from_dict(tm["config"], where, tm.get("generation_config"))
    if tm.get("eos_token_ids") is not None:
        target = dataclasses.replace(target, eos_token_ids=tuple(tm["eos_token_ids"]))
    dm = bundle.model("drafter")
    if dm is None:
        return target, None
    dc = DrafterConfig.from_dict(dm["config"], where)
    return target, dataclasses.replace(dc, block_size=int(bundle.limits.get("block_size") or dc.block_size))
