"""The serving seam (retrace/runtime/serving_protocol.py): the real Runtime and the Triton model's stand-in
both have every member the Engine and the Triton adapter read, and the one Engine serves both exactly."""

from __future__ import annotations

import inspect

import pytest
from runtime_fixtures import hf_greedy, load_hf_target, write_pair
from triton_fixtures import write_standin_bundle

from retrace.export.triton import standin
from retrace.export.triton.serving import RuntimeAdapter
from retrace.runtime import Engine, Runtime, SamplingParams
from retrace.runtime import serving_protocol as sp

pytestmark = pytest.mark.usefixtures("one_thread")


def members(proto) -> set[str]:
    """A Protocol's attributes and methods (its own, not object's)."""
    own = set(getattr(proto, "__annotations__", {}))
    own |= {n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")}
    return own


def missing(obj, proto) -> list[str]:
    return sorted(n for n in members(proto) if not hasattr(obj, n))


@pytest.fixture(scope="module")
def runtimes(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("seam")
    target, drafter = write_pair(root, vocab=128, block_size=8, conditioner="random", seed=4)
    real = Runtime.from_dirs(target, drafter, max_batch=2, max_seq_len=64, verify_policy="fixed")
    fake = standin.create_runtime(str(write_standin_bundle(root / "bundle")), max_batch=2, step_delay_s=0.0)
    return {"real": (real, target), "standin": (fake, None)}


@pytest.mark.parametrize("which", ["real", "standin"])
def test_both_runtimes_have_every_member_of_the_seam(runtimes, which):
    rt, _ = runtimes[which]
    assert missing(rt, sp.ServableRuntime) == []
    assert missing(rt.backend, sp.ServedBackend) == [] and missing(rt.backend.target_config, sp.TargetLimits) == []
    assert missing(rt.codec, sp.Codec) == []
    sched = rt.scheduler()
    assert missing(sched, sp.ServingScheduler) == []
    req = sched.add([65, 66, 67], SamplingParams(max_new_tokens=3), "ar")
    events = []
    while not req.finished:
        events += sched.step()
    assert missing(req, sp.ServedRequest) == [] and all(missing(e, sp.ServedEvent) == [] for e in events)
    assert req.error is None and req.finish_reason == "length" and len(req.result()["token_ids"]) == 3
    adapter = RuntimeAdapter(rt)  # the Triton model's view: limits straight from the seam
    assert adapter.max_batch == 2 and adapter.vocab_size == 128 and adapter.reserve == sched.block_size + 1
    assert adapter.params(type("Spec", (), {"sampling_kwargs": lambda self: {"max_new_tokens": 4}})()) == \
        SamplingParams(max_new_tokens=4)


def test_one_engine_serves_both_exactly(runtimes):
    real, target = runtimes["real"]
    fake, _ = runtimes["standin"]
    prompt = [5, 9, 2, 7]
    with Engine(real) as eng:
        got = eng.submit(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), "retrace").result(60)
    assert got.token_ids == hf_greedy(load_hf_target(target), prompt, 8)
    with Engine(fake) as eng:
        got = eng.submit("abc", SamplingParams(max_new_tokens=6), "retrace").result(60)
    assert got.text == standin.expected_output("abc", 6)
