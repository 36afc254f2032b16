"""The runtime on a device, checked on the CPU.

- Device and dtype are first-class: by name, one clear error for an absent CUDA, a bundle backend refuses
  a device it does not run on, `retrace generate --device cuda` fails in one line, `retrace-export triton
  --device cuda` writes a GPU instance group.
- The round stays on the backend's device: with torch's default device set to `meta` during a generate,
  any tensor the loop made without naming the device would be a meta tensor and fail; outputs are the same.
- At most 2 conversions of a tensor to host values per round (`.item()`, `.tolist()`, `.cpu()`,
  `.numpy()`, `bool()` / `int()` / `float()` / `__index__` of a tensor), counted with a TorchFunctionMode
  between consecutive target calls, in dflash and retrace modes, batch 1 and 8, fixed and adaptive policy,
  and with prompt lookup (its rounds alone, or between drafter rounds), batch 1 and 4.
"""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from runtime_fixtures import hf_greedy, load_hf_target, write_pair
from torch.overrides import TorchFunctionMode
from triton_fixtures import write_standin_bundle

from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.device import CPU, read, resolve_device, resolve_dtype, to_device
from retrace.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")
NO_CUDA = not torch.cuda.is_available()
PROMPTS = [[5, 9, 2], [7], [1, 2, 3, 4, 5, 6], [11, 3], [8, 8, 8, 8], [60, 61, 62], [4], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory, one_thread):
    return write_pair(tmp_path_factory.mktemp("device"), vocab=128, block_size=8, conditioner="random", seed=3)


# -- device and dtype by name ------------------------------------------------------------------------------
@pytest.mark.skipif(not NO_CUDA, reason="CUDA is present here")
def test_absent_cuda_is_one_clear_error(pair):
    with pytest.raises(RetraceError, match=r"--device cuda: CUDA is not available on this machine .*use --device cpu"):
        resolve_device("cuda")
    with pytest.raises(RetraceError, match="CUDA is not available"):  # before any weight is read
        Runtime.from_dirs(*pair, device="cuda")
    res = CliRunner().invoke(_main(), ["generate", "--target", str(pair[0]), "--drafter", str(pair[1]),
                                       "--prompt-ids", "1,2", "--device", "cuda", "--json"])
    assert res.exit_code == 2 and "error: --device cuda: CUDA is not available" in res.output
    assert "Traceback" not in res.output


def test_bench_and_eval_pass_the_device_flags_on(pair, tmp_path, monkeypatch):
    """`retrace bench` hands --device/--dtype/--compile/--no-cuda-graphs to the torch systems' runtime (the
    config the lineup builds it from); `retrace eval` hands --device/--dtype to its rollouts."""
    import retrace.bench.runner as runner
    import retrace.train.evaluate as evaluate

    seen = {}
    monkeypatch.setattr(runner, "run_and_report", lambda cfg, *a, **k: seen.__setitem__("bench", cfg) or {})
    monkeypatch.setattr(evaluate, "evaluate", lambda *a: seen.__setitem__("eval", a) or {})
    monkeypatch.setattr(evaluate, "format_report", lambda rep: "")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n')
    src = ["--target", str(pair[0]), "--drafter", str(pair[1]), "--prompts", str(prompts)]
    flags = ["--device", "cpu", "--dtype", "bfloat16"]
    res = CliRunner().invoke(_main(), ["bench", *src, *flags, "--compile", "--no-cuda-graphs", "--no-build-engine"])
    assert res.exit_code == 0, res.output
    cfg = seen["bench"]
    assert (cfg.device, cfg.dtype, cfg.compile_steps, cfg.cuda_graphs) == ("cpu", "bfloat16", True, False)
    res = CliRunner().invoke(_main(), ["bench", *src, "--no-build-engine"])
    assert res.exit_code == 0 and seen["bench"].cuda_graphs is None  # default: the backend's (on CUDA only)
    res = CliRunner().invoke(_main(), ["eval", *src, *flags])
    assert res.exit_code == 0, res.output
    args = seen["eval"]
    assert args[11] == "cpu" and args[-1] == "bfloat16"  # evaluate(..., threads, device, ..., dtype)


def test_bad_names_are_refused():
    with pytest.raises(RetraceError, match="'tpu': the runtime runs on cpu or cuda|not a device"):
        resolve_device("tpu")
    with pytest.raises(RetraceError, match=r"--dtype 'int8': choose from bfloat16, float16, float32"):
        resolve_dtype("int8")
    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype(None) is torch.float32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_reaches_weights_caches_and_the_first_token(pair, dtype):
    """--dtype puts the weights and the K/V caches in that dtype; the prefill's first token is the argmax
    of that same half-precision target."""
    rt = Runtime.from_dirs(*pair, max_batch=2, max_seq_len=64, dtype=dtype, verify_policy="fixed")
    be = rt.backend
    want = resolve_dtype(dtype)
    assert be.device == torch.device("cpu")
    assert be.target_model.lm_head.weight.dtype == want and be.drafter_model.fc.weight.dtype == want
    assert be.tcache.k[0].dtype == want and be.dcache.v[0].dtype == want
    prompt = PROMPTS[2]
    out = rt.generate([prompt], SamplingParams(max_new_tokens=4), "retrace")[0].token_ids
    model = be.target_model
    past = model.empty_past(1)
    logits = model(torch.tensor([prompt]), torch.arange(len(prompt)).unsqueeze(0), *past,
                   torch.zeros(1, dtype=torch.long),
                   torch.tensor([[len(prompt) - 1]]))[0]
    assert out[0] == int(logits[0, 0].argmax())


def test_bundle_backends_refuse_a_device_they_do_not_run_on(tmp_path, monkeypatch):
    from retrace.runtime import api

    with pytest.raises(RetraceError, match="a bundle's dtype is fixed when it is built"):
        Runtime.from_bundle(tmp_path, backend="onnxruntime", dtype="bfloat16")
    monkeypatch.setattr(api, "resolve_device", torch.device)  # as on a machine with CUDA
    with pytest.raises(RetraceError, match=r"the onnxruntime backend runs on cpu, not cuda; for --device cuda run "
                                           r"the torch backend"):
        Runtime.from_bundle(tmp_path, backend="onnxruntime", device="cuda")
    assert api._bundle_device("onnxruntime", "cpu", None) == {}
    assert api._bundle_device("tensorrt", "cuda:1", None) == {"device": "cuda:1"}  # TensorRT takes its GPU


def test_triton_repository_for_cuda_is_a_gpu_instance_group(tmp_path):
    from retrace.export.triton.repository import RepositoryError, write_repository

    bundle = write_standin_bundle(tmp_path / "b")
    repo = write_repository(bundle, tmp_path / "gpu", instances=2, backend="tensorrt", device="cuda",
                            vendor_package=False)
    cfg = (repo / "retrace" / "config.pbtxt").read_text()
    assert "count: 2 kind: KIND_GPU" in cfg and 'key: "RETRACE_DEVICE" value: { string_value: "cuda" }' in cfg
    with pytest.raises(RepositoryError,
                       match="the onnxruntime backend runs on cpu: device 'cuda' needs a tensorrt bundle"):
        write_repository(bundle, tmp_path / "bad", backend="onnxruntime", device="cuda", vendor_package=False)
    assert not (tmp_path / "bad").exists()


# -- the round stays on the device ------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    dict(mode="retrace", policy="fixed"),
    dict(mode="retrace", policy="adaptive", min_tokens=6),
    dict(mode="dflash", policy="fixed", temperature=1.0),
    dict(mode="retrace", policy="fixed", tree_budget=6),
    dict(mode="retrace", policy="fixed", tree_budget=6, temperature=1.0),
    dict(mode="dflash", policy="fixed", prompt_lookup=True, temperature=0.0),
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_every_tensor_of_the_round_names_the_backends_device(pair, case):
    case = dict(case)
    mode, policy = case.pop("mode"), case.pop("policy")
    rt_kw = {k: case.pop(k) for k in ("tree_budget", "prompt_lookup") if k in case}
    params = SamplingParams(max_new_tokens=20, seed=5, **case)

    def run(meta: bool):
        rt = Runtime.from_dirs(*pair, max_batch=4, max_seq_len=96, verify_policy=policy, **rt_kw)
        if meta:
            torch.set_default_device("meta")
        try:
            return [r.token_ids for r in rt.generate(PROMPTS[:3], params, mode)]
        finally:
            torch.set_default_device(None)

    assert run(True) == run(False)


# -- host reads per round ---------------------------------------------------------------------------------
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
              torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class HostReads(TorchFunctionMode):
    """Counts every conversion of a tensor to host values; `marks` holds the count at each target call."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.marks: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


class CountingBackend:
    """The torch backend, marking the host-read count at every target call (a round's verify or a prefill)."""

    def __init__(self, inner: TorchBackend, reads: HostReads):
        self.inner, self.reads = inner, reads

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def target(self, *args, **kwargs):
        self.reads.marks.append(self.reads.count)
        return self.inner.target(*args, **kwargs)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("mode", ["dflash", "retrace"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_at_most_two_host_reads_per_round(pair, batch, mode, policy):
    """Between two target calls (one round: draft, choose K, verify, accept, remember, commit) at most 2
    conversions to host values: the policy's K (adaptive) and the commit's one read; and the output is
    still the target's own greedy decode."""
    reads = HostReads()
    be = TorchBackend.from_dirs(*pair, max_batch=8, max_seq_len=96)
    from retrace.runtime.tokenizer import TextCodec

    rt = Runtime(CountingBackend(be, reads), TextCodec.find(pair[0]), verify_policy=policy)
    prompts = PROMPTS[:batch]
    with reads:
        outs = rt.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), mode)
    reads.marks.append(reads.count)
    per_round = [b - a for a, b in zip(reads.marks, reads.marks[1:], strict=False)]
    assert len(per_round) >= 10 and max(per_round) <= 2, per_round
    if batch == 1:
        hf = load_hf_target(pair[0])
        assert outs[0].token_ids == hf_greedy(hf, prompts[0], 24)


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("drafts", ["never", "sometimes"])
def test_prompt_lookup_rounds_read_the_host_at_most_twice(pair, batch, drafts):
    """Prompt lookup builds its drafts on the host from host lists (its lengths carry their host copy):
    its rounds, alone or between drafter rounds, read the host at most twice too; the output is the target's."""
    from runtime_fixtures import LinearCost, steep_cost_policy

    from retrace.runtime.prompt_lookup import PromptLookup
    from retrace.runtime.verify_policy import AdaptivePolicy

    reads = HostReads()
    be = TorchBackend.from_dirs(*pair, max_batch=8, max_seq_len=96)
    policy = (AdaptivePolicy(8, LinearCost(0.1, 50.0), learn_cost=False) if drafts == "never"
              else steep_cost_policy(8))
    rt = Runtime(CountingBackend(be, reads), None, verify_policy=policy, prompt_lookup=PromptLookup(max_rows=4))
    prompts = [[5, 9, 2, 7] * 3, [1, 2, 3] * 4, [11, 3] * 5, [8, 1, 8, 2] * 2][:batch]
    with reads:
        outs = rt.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), "retrace")
    reads.marks.append(reads.count)
    per_round = [b - a for a, b in zip(reads.marks, reads.marks[1:], strict=False)]
    assert rt.run_stats()["prompt_lookup"]["rounds"] > 0
    assert len(per_round) >= 10 and max(per_round) <= 2, per_round
    hf = load_hf_target(pair[0])
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]


def test_read_is_the_values():
    t = torch.tensor([[1, 2], [3, 4]])
    assert read(t) == [[1, 2], [3, 4]]


def _main():
    from retrace.cli import main

    return main


# -- the cost model learns from the stopwatch ----------------------------------------------------------------
class Ticks:
    """A stopwatch whose every interval between two consecutive marks is 1 ms."""

    def __init__(self):
        self.n = 0

    def mark(self) -> int:
        self.n += 1
        return self.n

    def seconds(self, start: int, end: int) -> float:
        return (end - start) * 1e-3


def test_the_cost_model_sees_the_stopwatchs_times(pair):
    """The adaptive policy's cost model learns the loop stopwatch's durations (CUDA events on CUDA, host
    timers on the CPU), read after the round's one host read."""
    from retrace.runtime.stopwatch import CudaStopwatch, HostStopwatch, stopwatch_for

    assert isinstance(stopwatch_for(torch.device("cuda")), CudaStopwatch)
    assert isinstance(stopwatch_for(torch.device("cpu")), HostStopwatch)
    rt = Runtime.from_dirs(*pair, max_batch=2, max_seq_len=64, verify_policy="adaptive", prompt_lookup=False)
    sched = rt.scheduler()
    assert isinstance(sched.clock, HostStopwatch)
    sched.clock = Ticks()
    rt.generate(PROMPTS[:2], SamplingParams(max_new_tokens=12, ignore_eos=True), "dflash")
    cost = sched.policy.cost
    seen = [s for tables in (cost.verify_s, cost.draft_s) for table in tables.values() for s in table.values()]
    assert seen and all(s == pytest.approx(1e-3) for s in seen), cost.to_dict()
    rounds = sched.stats["dflash"].rounds // 2  # both rows run every round (same length)
    assert rt.run_stats()["time"]["verify_s"] == pytest.approx(1e-3 * rounds)


def test_to_device_keeps_values_and_dtype_and_ignores_the_default_device():
    torch.set_default_device("meta")  # a tensor built without naming its device would land here
    try:
        ints, floats, flags = to_device([[1, 2], [3, 4]], CPU), to_device([0.5], CPU, torch.float64), \
            to_device([True, False], CPU)
    finally:
        torch.set_default_device(None)
    assert ints.device == CPU and ints.dtype == torch.int64 and ints.tolist() == [[1, 2], [3, 4]]
    assert floats.dtype == torch.float64 and flags.dtype == torch.bool and flags.tolist() == [True, False]
