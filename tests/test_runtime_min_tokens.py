"""A minimum length (`min_tokens`) and `ignore_eos` stay lossless: the output equals transformers' greedy
decode with `min_new_tokens` (EOS logits masked until the minimum), for every mode, with drafts that
propose the EOS too early (an oracle drafter that follows the unmasked greedy continuation)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from runtime_fixtures import OracleDrafter, copy_with_eos, load_hf_target, write_pair

from retrace.cli import main
from retrace.errors import RetraceError
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.sampling import mask_early_eos
from retrace.runtime.tokenizer import TextCodec
from retrace.runtime.torch_backend import TorchBackend

VOCAB = 128
MAX_NEW = 40
MIN_NEW = (1, 12, MAX_NEW)  # the minimums asked for


pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def hf_decode(hf, prompt: list[int], max_new: int, eos: int | None, min_new: int = 0) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=min_new,
                      do_sample=False, eos_token_id=eos, pad_token_id=0 if eos is None else eos,
                      temperature=None, top_p=None, top_k=None)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def world(tmp_path_factory, one_thread):
    root = tmp_path_factory.mktemp("min-tokens")
    target, drafter = write_pair(root, vocab=VOCAB, block_size=8, conditioner="random", seed=4)
    hf = load_hf_target(target)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in (5, 9, 3)]
    free = [hf_decode(hf, p, MAX_NEW + 10, None) for p in prompts]
    # EOS: a token that prompt 0's continuation produces early (new-token index 4..10) and again later
    eos = next(t for i, t in enumerate(free[0][4:11], 4) if t not in free[0][:i])
    target = copy_with_eos(target, root / "target-eos", eos)
    # transformers' decodes with that EOS, without a minimum (None) and with each minimum the tests ask for
    # (computed once: every parametrization compares against the same references)
    hf_eos = {m: [hf_decode(hf, p, MAX_NEW, eos, m or 0) for p in prompts] for m in (None, *MIN_NEW)}
    return dict(target=target, drafter=drafter, hf=hf, prompts=prompts, free=free, eos=eos, hf_eos=hf_eos)


def runtime(w, oracle: bool, tree: int = 0) -> Runtime:
    be = TorchBackend.from_dirs(w["target"], w["drafter"], max_batch=4, max_seq_len=128)
    if oracle:  # drafts = the unmasked greedy continuation: they propose EOS before the minimum
        be = OracleDrafter(be, {tuple(p): p + f for p, f in zip(w["prompts"], w["free"], strict=True)})
    return Runtime(be, TextCodec.find(w["target"]), verify_policy="fixed", tree_budget=tree)


@pytest.mark.parametrize("oracle,tree", [(False, 0), (True, 0), (True, 12)],
                         ids=["random-drafter", "oracle-drafter", "oracle-drafter-tree12"])
def test_min_tokens_equals_transformers_min_new_tokens(world, oracle, tree):
    eos, prompts = world["eos"], world["prompts"]
    plain = world["hf_eos"][None]
    assert plain[0][-1] == eos and len(plain[0]) <= 11  # without a minimum, prompt 0 stops early
    for min_new in MIN_NEW:
        want = world["hf_eos"][min_new]
        assert all(eos not in w[:min_new] for w in want)
        for mode in ("ar", "dflash", "retrace"):
            res = runtime(world, oracle, tree).generate(
                prompts, SamplingParams(max_new_tokens=MAX_NEW, min_tokens=min_new), mode)
            for i, (r, w) in enumerate(zip(res, want, strict=True)):
                assert r.token_ids == w, f"{mode} min_tokens {min_new} prompt {i}"
                assert r.finish_reason == ("stop" if w[-1] == eos else "length")
    # ignore_eos: the decode without any EOS (transformers with no eos_token_id), EOS tokens included
    res = runtime(world, oracle).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True), "retrace")
    assert [r.token_ids for r in res] == [f[:MAX_NEW] for f in world["free"]]
    assert eos in res[0].token_ids[:11] and all(r.finish_reason == "length" for r in res)


def test_mask_early_eos_positions():
    logits = torch.zeros(2, 4, 6)
    out = mask_early_eos(logits, produced=[0, 5], min_tokens=[2, 7], eos_ids={3, 5})
    assert torch.isinf(out[0, :2][:, [3, 5]]).all() and not torch.isinf(out[0, 2:]).any()
    assert torch.isinf(out[1, :2][:, [3, 5]]).all() and not torch.isinf(out[1, 2:]).any()
    assert not torch.isinf(out[:, :, [0, 1, 2, 4]]).any() and not torch.isinf(logits).any()  # a copy
    assert mask_early_eos(logits, [3, 3], [3, 0], {3}) is logits  # nothing to mask: no copy
    with pytest.raises(RetraceError, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5)


def test_cli_min_tokens_and_ignore_eos(world):
    prompt = ",".join(map(str, world["prompts"][0]))
    base = ["generate", "--target", str(world["target"]), "--drafter", str(world["drafter"]), "--prompt-ids", prompt,
            "--max-new-tokens", str(MAX_NEW), "--json", "--verify-policy", "fixed"]
    import json

    out = json.loads(CliRunner().invoke(main, [*base, "--min-tokens", "12"]).stdout)["outputs"][0]
    assert out["token_ids"] == hf_decode(world["hf"], world["prompts"][0], MAX_NEW, world["eos"], 12)
    out = json.loads(CliRunner().invoke(main, [*base, "--ignore-eos"]).stdout)["outputs"][0]
    assert out["token_ids"] == world["free"][0][:MAX_NEW] and out["finish_reason"] == "length"
    res = CliRunner().invoke(main, [*base, "--min-tokens", str(MAX_NEW + 1)])
    assert res.exit_code != 0 and "min_tokens" in res.stderr
