"""Shared fixtures. Keep this small and generic; builders live in tests/helpers.py."""

from __future__ import annotations

import itertools
import json
import os

# Threads that wait passively: with torch's default busy-waiting, a loaded 2-core machine runs 4-6x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# the suite runs two workers on two cores: ONNX Runtime workers block between kernels (spinning pays on a core
# of its own, not on an oversubscribed one; runtime/ort_spinning.py)
os.environ.setdefault("RETRACE_ORT_SPINNING", "0")

import pytest  # noqa: E402
import run_shared  # noqa: E402
from helpers import TinyPair, write_drafter, write_target
from runtime_fixtures import single_thread

from retrace.export import export_cache


@pytest.fixture(scope="session", autouse=True)
def run_shared_root(tmp_path_factory):
    """The directory pytest-xdist's workers share for this run's shared builds (tests/run_shared.py)."""
    base = tmp_path_factory.getbasetemp()
    run_shared.ROOT = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    # one export per distinct model and settings in the whole run (retrace/export/export_cache.py)
    os.environ.setdefault(export_cache.ENV, str(run_shared.ROOT / "export-cache"))
    yield
    run_shared.ROOT = None


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module's tests and fixtures (tiny matrices: faster, and immune to a busy
    machine's scheduling). Modules use it with `pytestmark = pytest.mark.usefixtures("one_thread")`;
    module-scoped fixtures that build models request it too."""
    with single_thread():
        yield


@pytest.fixture
def tiny_pair(tmp_path):
    """Factory: `tiny_pair(**kw) -> TinyPair`, a new random target + drafter under this test's tmp_path.

    Each call writes new directories (safe to modify or corrupt). Keyword arguments (all optional):

    Target (transformers Qwen3ForCausalLM.save_pretrained):
      vocab=128, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=None (hidden // heads),
      intermediate=96, tie=False (tie_word_embeddings), rope_theta=10000.0,
      rope_form="rope_parameters" (transformers 5 form) or "rope_theta" (4.x top-level form),
      max_pos=512, eos_token_id=None, seed=0.
    Drafter (z-lab format, sizes follow the target):
      draft_layers=1, block_size=8, target_layer_ids=None (omitted from config: z-lab default,
      n // 2 for one drafter layer), mask_token_id=None (vocab - 1), draft_intermediate=None
      (target's), draft_rope_form="rope_theta", conditioner=None | "zero" | "random", draft_seed=1,
      draft_overrides=None (dict applied to the drafter's config.json last).
    For drafters that do not fit their target, call helpers.write_drafter directly.
    """
    counter = itertools.count()

    def make(
        *,
        draft_layers: int = 1,
        block_size: int = 8,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        draft_intermediate: int | None = None,
        draft_rope_form: str = "rope_theta",
        conditioner: str | None = None,
        draft_seed: int = 1,
        draft_overrides: dict | None = None,
        **target_kw,
    ) -> TinyPair:
        root = tmp_path / f"pair{next(counter)}"
        target_dir = write_target(root / "target", **target_kw)
        drafter_dir = write_drafter(
            root / "drafter",
            target_dir,
            layers=draft_layers,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            mask_token_id=mask_token_id,
            intermediate=draft_intermediate,
            rope_form=draft_rope_form,
            conditioner=conditioner,
            seed=draft_seed,
            config_overrides=draft_overrides,
        )
        return TinyPair(target_dir, drafter_dir)

    return make


@pytest.fixture(scope="session")
def zoo_target_stage(tmp_path_factory):
    """The tiny zoo's target stage (`build_target_stage(size="test", seed=0)`, this process's numerics), built
    once per test run (pytest-xdist's workers share it: their base temp directories share the run's): (directory,
    metrics of that first build). Tests must not change its target/, prompts/ or data/ (copy them to change them)."""
    from filelock import FileLock

    from retrace.train.zoo_target import build_target_stage

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out, first = root / "zoo-target-stage", root / "zoo-target-stage.json"
    with FileLock(str(root / "zoo-target-stage.lock")):
        if not first.exists():
            first.write_text(json.dumps(build_target_stage(out, size="test", seed=0, progress=False)))
    return out, json.loads(first.read_text())
