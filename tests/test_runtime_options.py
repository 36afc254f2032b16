"""Runtime options are one object (retrace/runtime/options.py): checked when made, carried whole from the
command line and the API to the scheduler; the click options are declared once (retrace/cli_options.py);
SamplingParams imports without torch, and the Triton stand-in serves with that same class."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner
from runtime_fixtures import hf_greedy, load_hf_target, write_pair

from retrace.cli import main
from retrace.cli_options import FLAGS
from retrace.errors import RetraceError
from retrace.runtime import Runtime, RuntimeOptions, SamplingParams, Scheduler
from retrace.runtime.options import InvalidOption
from retrace.runtime.prompt_lookup import PromptLookup

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 9, 2, 7], [11, 3, 3, 8, 1, 4]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_thread):
    return write_pair(tmp_path_factory.mktemp("options"), vocab=128, block_size=8, conditioner="random", seed=5)


def test_sampling_params_import_without_torch():
    code = ("import sys\n"
            "from retrace.runtime.sampling_params import SamplingParams\n"
            "from retrace.export.triton import standin\n"
            "assert standin.SamplingParams is SamplingParams\n"
            "p = SamplingParams(max_new_tokens=3, temperature=1e-7, stop='x')\n"
            "assert p.greedy and p.stop == ('x',)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    from retrace.runtime import sampling

    assert sampling.SamplingParams is SamplingParams  # the old import path is the same class


@pytest.mark.parametrize(("kw", "message"), [
    ({"block_size": 0}, "block_size must be positive, got 0"),
    ({"max_batch": -1}, "max_batch must be positive, got -1"),
    ({"max_seq_len": 0}, "max_seq_len must be positive, got 0"),
    ({"threads": 10**6}, "threads 1000000 must be in 1.."),
    ({"verify_policy": "greedy"}, "unknown verify policy 'greedy' (choose from adaptive, fixed)"),
    ({"tree_budget": 1}, "tree budget must be 0 (chain) or >= 2 nodes"),
    ({"tree_sources": "topk,beam"}, "tree sources ['beam']: choose one or more of topk, suffix, target"),
])
def test_a_bad_option_is_refused_when_made(kw, message):
    with pytest.raises(RetraceError) as e:
        RuntimeOptions(**kw)
    assert message in str(e.value)
    with pytest.raises(RetraceError):  # a changed copy is checked again
        RuntimeOptions().replace(**kw)


def test_options_are_normalized_once():
    o = RuntimeOptions(tree_sources="target, topk", eos_ids=[3, 4])
    assert o.tree_sources == ("topk", "target") and o.eos_ids == (3, 4)
    assert RuntimeOptions.of(o, tree_budget=4) == RuntimeOptions(tree_sources=("topk", "target"), eos_ids=(3, 4),
                                                                 tree_budget=4)
    assert RuntimeOptions.of(o) is o
    err = pytest.raises(InvalidOption, RuntimeOptions, max_batch=0).value
    assert (err.field, err.problem) == ("max_batch", "must be positive, got 0")


def test_options_travel_whole_to_the_scheduler(pair):
    """One options object from from_dirs to the backend's limits and the scheduler's round settings; the
    keyword form builds the same object, and both decode the target's own greedy continuation."""
    lookup = PromptLookup(max_rows=3)
    opts = RuntimeOptions(block_size=4, verify_policy="fixed", tree_budget=6, tree_sources="suffix,topk",
                          prompt_lookup=lookup, max_batch=3, max_seq_len=64, threads=1)
    rt = Runtime.from_dirs(*pair, options=opts)
    assert rt.options is opts and rt.block_size == 4
    assert (rt.backend.max_batch, rt.backend.max_seq_len) == (3, 64)
    sched = rt.scheduler()
    assert (sched.block_size, sched.policy.name, sched.tree_budget, sched.tree_sources) == (
        4, "fixed", 6, ("topk", "suffix"))
    assert sched.lookup is lookup
    kw = Runtime.from_dirs(*pair, block_size=4, verify_policy="fixed", tree_budget=6, tree_sources="suffix,topk",
                           prompt_lookup=lookup, max_batch=3, max_seq_len=64, threads=1)
    assert kw.options == opts
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    hf = load_hf_target(pair[0])
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    for r in (rt, kw):
        assert [x.token_ids for x in r.generate(PROMPTS, params, "retrace")] == want
    assert Runtime(rt.backend, rt.codec, block_size=4).options == RuntimeOptions(block_size=4)


def test_prompt_lookup_first_is_the_default_and_off_turns_it_off(pair):
    """The runtime looks up first by default (runtime/proposers/lookup_first.py); `--prompt-lookup off|on|first`
    maps to False / True / "first"; what measures the drafter alone runs without it (training rollouts and
    `retrace eval`, the bench's drafter-only systems: `retrace bench` runs lookup systems only when asked)."""
    from retrace.cli_options import options_from_flags
    from retrace.runtime.proposers.lookup_first import LookupFirstPlan
    from retrace.train.rollout import run_requests

    rt = Runtime.from_dirs(*pair, max_batch=2, max_seq_len=64)
    sched = rt.scheduler()
    assert RuntimeOptions().prompt_lookup == "first" and sched.lookup.first and type(sched.plan) is LookupFirstPlan
    assert Runtime(rt.backend, rt.codec, prompt_lookup=False).scheduler().lookup is None
    for flag, want in ((None, False), ("off", False), ("on", True), ("first", "first")):
        assert options_from_flags({"prompt_lookup": flag}).prompt_lookup == want
    declared = {c: {p.opts[0]: p for p in main.commands[c].params} for c in ("generate", "serve", "bench")}
    assert [declared[c]["--prompt-lookup"].default for c in ("generate", "serve", "bench")] == ["first", "first", "off"]
    _, rollout = run_requests(rt.backend, [PROMPTS[0]], "retrace", 4, 0.0, 0, verify_policy="adaptive")
    assert rollout.lookup is None


def test_backend_checks_are_made_with_the_runtime(pair):
    rt = Runtime.from_dirs(*pair, max_batch=2, max_seq_len=32)
    with pytest.raises(RetraceError, match=r"block size 9 must be in 2\.\.8 \(the drafter's block_size\)"):
        Runtime(rt.backend, block_size=9)
    with pytest.raises(RetraceError, match="tree budget 30 leaves no room for any request in the max length 32"):
        Runtime(rt.backend, tree_budget=30)
    with pytest.raises(RetraceError, match="block size 9 must be in"):  # the scheduler alone checks the same
        Scheduler(rt.backend, None, RuntimeOptions(block_size=9))
    assert Scheduler(rt.backend, None, RuntimeOptions(eos_ids=(7,))).eos_ids == {7}


def test_bundle_options_refused_where_they_cannot_apply(tmp_path):
    with pytest.raises(RetraceError, match=r"--compile applies to the torch backend \(--target/--drafter\)"):
        Runtime.from_bundle(tmp_path, options=RuntimeOptions(compile=True))


def test_the_runtime_flags_are_declared_once():
    """generate and serve take every runtime option, bench and eval the ones they use: each the same
    declaration (flag, parameter name, type), eval with its own defaults."""
    commands = {c: main.commands[c] for c in ("generate", "serve", "bench", "eval")}
    declared = {c: {p.opts[0]: p for p in cmd.params} for c, cmd in commands.items()}
    for param, flag, kw in FLAGS.values():
        for c in ("generate", "serve"):
            p = declared[c][flag.split("/")[0]]  # "--on/--off": a boolean flag pair, declared by its first
            assert p.name == param and p.is_flag == (kw.get("is_flag", False) or "/" in flag)
            assert "default" not in kw or p.default == kw["default"]
    for c, fields in (("bench", ("threads", "verify_policy", "tree_budget", "tree_sources", "prompt_lookup",
                                 "device", "dtype", "compile")),
                      ("eval", ("max_batch", "block_size", "threads", "verify_policy", "tree_budget",
                                "tree_sources", "device", "dtype"))):
        for field in fields:
            param, flag, kw = FLAGS[field]
            p = declared[c][flag]
            assert p.name == param and type(p.type) is type(declared["generate"][flag].type)
    assert (declared["eval"]["--verify-policy"].default, declared["eval"]["--max-batch"].default) == ("fixed", 32)


@pytest.mark.parametrize(("extra", "needle"), [
    (("--max-batch", "0"), "error: --max-batch must be positive, got 0"),
    (("--threads", "1000000"), "error: --threads 1000000 must be in 1.."),
    (("--tree-sources", "beam"), "error: tree sources ['beam']"),
])
def test_a_bad_flag_is_named_by_its_flag(pair, extra, needle):
    res = CliRunner().invoke(main, ["generate", "--target", str(pair[0]), "--drafter", str(pair[1]),
                                    "--prompt-ids", "1,2", "--max-new-tokens", "2", *extra])
    assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output
