"""The torch backend's row invariance (runtime/torch_backend.py `row_invariant`): every target call of up to
16 tokens at 16 columns (rows at their batch bucket), a wider call (a prefill) row by row over each row's
tokens, so a row's logits, taps and K/V are the same bits whatever the call's width, the other rows of its
bucket and the prompts prefilled beside it.

- Bit for bit (torch.equal, not allclose), fp32 on the CPU: the rows of one T-token call equal the T decode
  steps of plain decoding (runtime/row_invariance.py `rows_matching_decodes`), also where the calls straddle
  an attention-window bucket; a row decoded beside a different other row equals itself; a batched prefill
  of prompts of different lengths equals each prompt prefilled alone.
- Token-exact against transformers' greedy decode with it on: ar, dflash, retrace, 8 requests joining and
  leaving 3 slots, the adaptive policy; every padded target call at the one shape.
- It needs the padded steps: asking for it with static shapes off is refused, naming both; on from the CLI
  (`--row-invariance`) and the Python API; the default: on CUDA only.
"""

from __future__ import annotations

import pytest
import torch
from runtime_fixtures import OracleDrafter, hf_greedy, load_hf_target, steep_cost_policy, write_pair

from retrace.cli_options import options_from_flags
from retrace.errors import RetraceError
from retrace.models.drafter import load_pair
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.device import index_tensor
from retrace.runtime.options import RuntimeOptions
from retrace.runtime.row_invariance import rows_matching_decodes
from retrace.runtime.torch_backend import TorchBackend

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, SEQ, MAX_NEW = 512, 160, 40
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    # wide enough that the CPU's fp32 GEMM picks different kernels for different row counts
    target, drafter = write_pair(tmp_path_factory.mktemp("rowinv"), vocab=VOCAB, hidden=256, heads=4, kv_heads=2,
                                 intermediate=512, block_size=8, conditioner="random", seed=5)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (6, 19, 3, 24, 11, 2, 17, 9)]
    return target, drafter, prompts


def _backend(world, **kw):
    t, d = load_pair(*world[:2])
    return TorchBackend(t, d, max_seq_len=SEQ, **{"max_batch": 4, "row_invariant": True, **kw})


def test_verify_rows_equal_the_decode_steps_bit_for_bit(world):
    be = _backend(world)
    for prefill in (6, 58):  # 58 + 9 crosses the 64-column window bucket
        got = rows_matching_decodes(be, prefill=prefill)
        assert got == {w: w for w in got}, (prefill, got)
    assert {(b.rows, b.width) for b in be.runner.calls if b.step == "target"} == {(1, 16)}


def test_a_row_is_the_same_bits_beside_other_rows_and_prefilled_with_other_prompts(world):
    _, _, prompts = world
    a, b = prompts[1], prompts[3]  # 19 and 24 tokens: a prefill wider than every bucket
    alone, together = _backend(world), _backend(world)
    for slot, p in ((0, a), (1, b)):
        la, ta = alone.target(index_tensor([slot], CPU), torch.tensor([p]), index_tensor([list(range(len(p)))], CPU),
                              index_tensor([[len(p) - 1]], CPU))
        if slot == 0:
            first = (la, ta)
    T = max(len(a), len(b))
    ids = torch.tensor([a + [0] * (T - len(a)), b])
    lt, tt = together.target(index_tensor([0, 1], CPU), ids, index_tensor([list(range(T))] * 2, CPU),
                             index_tensor([[len(a) - 1], [len(b) - 1]], CPU))
    assert torch.equal(lt[0], first[0][0]) and torch.equal(tt[0, :len(a)], first[1][0])
    assert torch.equal(lt[1], la[0]) and torch.equal(tt[1], ta[0])
    for s in (0, 1):  # the caches hold the same K/V bits over each prompt
        n = len(a) if s == 0 else len(b)
        for ca, cb in zip(alone.tcache.k + alone.tcache.v, together.tcache.k + together.tcache.v, strict=True):
            assert torch.equal(ca[s, :, :n], cb[s, :, :n])
    # a decode step of slot 0 is the same bits whatever the other row of its bucket holds
    beside = together.target(index_tensor([0, 1], CPU), torch.tensor([[7], [7]]), index_tensor([[len(a)]] * 2, CPU),
                             index_tensor([[0]] * 2, CPU))[0][0]
    other = alone.target(index_tensor([0, 1], CPU), torch.tensor([[7], [300]]), index_tensor([[len(a)], [len(b)]], CPU),
                         index_tensor([[0]] * 2, CPU))[0][0]
    assert torch.equal(beside, other)


def _runtime(world, max_batch, **opts):
    _, _, prompts = world
    hf = load_hf_target(world[0])
    greedy = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    be = OracleDrafter(_backend(world, max_batch=max_batch), {tuple(p): p + g for p, g in zip(prompts, greedy,
                                                                                              strict=True)})
    return Runtime(be, None, RuntimeOptions(**opts)), greedy


def test_token_exact_with_requests_joining_and_leaving(world):
    _, _, prompts = world
    rt, greedy = _runtime(world, 3, verify_policy=steep_cost_policy(8))  # 8 requests in 3 slots, K varies
    for mode in ("ar", "dflash", "retrace"):
        out = rt.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), mode)
        assert [r.token_ids for r in out] == greedy, mode
    assert rt.run_stats()["tau"] > 1.5
    calls = rt.backend.inner.runner.calls
    assert {b.width for b in calls if b.step == "target"} == {16}
    assert {b.rows for b in calls if b.step == "target"} >= {1, 2, 3}  # the batch buckets as requests come and go


def test_it_needs_the_padded_steps_and_is_on_from_the_cli_and_the_api(world):
    with pytest.raises(RetraceError, match="row invariance.*static_shapes"):
        _backend(world, static_shapes=False)
    assert not _backend(world, row_invariant=None).row_invariant  # the CPU's default: off
    assert options_from_flags({"row_invariance": True}).row_invariant is True
    assert options_from_flags({"row_invariance": None}).row_invariant is None
    rt = Runtime.from_dirs(*world[:2], max_batch=2, max_seq_len=SEQ, row_invariant=True)
    assert rt.backend.row_invariant and rt.backend.static_shapes
