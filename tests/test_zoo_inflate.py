"""`retrace zoo inflate`: a function-preserving expansion of a zoo pair (target, drafter, conditioner) to a
bigger shape: greedy ar / dflash / retrace identical, real-id logits equal, padded ids never produced."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from retrace.cli import main
from retrace.models.drafter import load_pair
from retrace.train.inflate import Shape, make_plan
from retrace.train.inflate_check import greedy_identity, logit_parity, sampled_padding

SMALL = dict(vocab=128, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, intermediate=96)
# hidden x4, head_dim x2 (as the small zoo -> Qwen3-0.6B), layers +2, heads x2, vocab x3
BIG = ["--hidden-size", "256", "--layers", "6", "--heads", "8", "--kv-heads", "4", "--head-dim", "32",
       "--intermediate-size", "192", "--vocab-size", "384"]


def _fake_zoo(tiny_pair, root, **kw):
    pair = tiny_pair(conditioner="random", target_layer_ids=kw.pop("taps", [1, 3]), draft_layers=2,
                     **SMALL, **kw)
    zoo = root / "zoo"
    shutil.copytree(pair.target, zoo / "target")
    shutil.copytree(pair.drafter, zoo / "drafter")
    (zoo / "prompts").mkdir()
    g = torch.Generator().manual_seed(0)
    for name in ("code", "docs"):
        rows = [{"prompt_ids": torch.randint(0, 127, (int(n),), generator=g).tolist()}
                for n in torch.randint(3, 20, (6,), generator=g)]
        (zoo / "prompts" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return zoo


@pytest.fixture(scope="module")
def inflated(tmp_path_factory):
    from conftest import tiny_pair as factory  # noqa: F401  (module-scoped use of the helper builders)
    from helpers import write_drafter, write_target

    root = tmp_path_factory.mktemp("inflate")
    t = write_target(root / "p" / "target", **{k: v for k, v in SMALL.items()})
    d = write_drafter(root / "p" / "drafter", t, layers=2, block_size=8, target_layer_ids=[1, 3],
                      mask_token_id=None, intermediate=None, rope_form="rope_theta", conditioner="random", seed=1,
                      config_overrides=None)
    zoo = root / "zoo"
    shutil.copytree(t, zoo / "target")
    shutil.copytree(d, zoo / "drafter")
    (zoo / "prompts").mkdir()
    g = torch.Generator().manual_seed(0)
    for name in ("code", "docs"):
        rows = [{"prompt_ids": torch.randint(0, 127, (int(n),), generator=g).tolist()}
                for n in torch.randint(3, 20, (6,), generator=g)]
        (zoo / "prompts" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / "big"
    res = CliRunner().invoke(main, ["zoo", "inflate", "--from", str(zoo), "--out", str(out), *BIG,
                                    "--check-prompts", "8", "--check-new-tokens", "24", "--sample-tokens", "2000",
                                    "--quiet"])
    assert res.exit_code == 0, res.output
    return zoo, out
