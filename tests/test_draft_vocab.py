"""The draft vocabulary (retrace.models.draft_vocab): the drafter's head over a subset of the target's ids.

- The map files: EAGLE-3 d2t offsets / t2d mask, written atomically by `retrace train draft-vocab` (from
  the target's greedy responses or a responses file), validated on load (bad ids, sizes, a missing or
  corrupt file: errors naming the file).
- The head: draft logits at the subset's ids equal the full head's there, -inf elsewhere (torch, ONNX
  Runtime bundle); with a subset holding every token the full head drafts, the drafts, and so every
  acceptance length, are exactly the full head's (the mapping is right, not only lossless).
- Greedy output is the target's own (transformers) with a restricting subset in dflash, retrace, tree and
  prompt-lookup rounds on torch and on an ONNX Runtime bundle, and every draft is a subset token.
- Sampling stays the target's distribution (chi-square, tests/test_runtime_sampling.py's check) with a
  subset that leaves out tokens the target samples.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from export_fixtures import cli_build
from run_shared import shared_build
from runtime_fixtures import hf_greedy, load_hf_target, single_thread, write_pair
from safetensors.torch import load_file, save_file

import retrace.runtime.proposers.chain as chain_module
from retrace.errors import CheckpointError, RetraceError
from retrace.models.config import Qwen3Config
from retrace.models.draft_vocab import META, TENSORS, DraftVocab, count_tokens, coverage_of, from_counts
from retrace.models.drafter import load_pair
from retrace.runtime import Runtime, SamplingParams
from retrace.runtime.prompt_lookup import PromptLookup

VOCAB = 96
BLOCK = 8
MAX_NEW = 40
PROMPT_LENS = [6, 1, 13, 3]

pytestmark = pytest.mark.usefixtures("one_thread")


def write_vocab(drafter, ids, vocab=VOCAB) -> DraftVocab:
    v = DraftVocab(torch.tensor(sorted(set(ids)), dtype=torch.int64), vocab, {"coverage": None})
    v.save(drafter)
    return v


def drafter_copy(src, dst, ids=None):
    shutil.copytree(src, dst)
    if ids is not None:
        write_vocab(dst, ids)
    return dst


class DraftSpy:
    """Records every draft the drafter proposes (runtime/proposers/chain.py propose_tokens)."""

    def __init__(self, monkeypatch):
        self.drafts: set[int] = set()
        orig = chain_module.propose_tokens

        def spy(*args):
            drafts, q = orig(*args)
            self.drafts |= set(drafts.reshape(-1).tolist())
            return drafts, q

        monkeypatch.setattr(chain_module, "propose_tokens", spy)


@functools.cache
def shared_world() -> dict:
    """The pair (export_fixtures' session pair: same sizes and seed), a restricting draft vocabulary and their
    `--tree-mask` bundle, built once per session: tests/test_engine_ort_tree.py opens the same bundle with
    `draft_vocab=False` (the full head) for its tree checks. Shared by pytest-xdist's workers (run_shared.py)."""
    with single_thread():
        root, record = shared_build("draft-vocab-world", _build_world)
    restricted = root / "drafter-restricted"
    return dict(root=root, target=root / "target", drafter=root / "drafter", restricted=restricted,
                vocab=DraftVocab.load(restricted, VOCAB), bundle=root / "bundle", **record)


@pytest.fixture(scope="module")
def world(one_thread):
    return shared_world()


def _build_world(root) -> dict:
    target, drafter = write_pair(root, vocab=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=96,
                                 block_size=BLOCK, conditioner="random", seed=3)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in PROMPT_LENS]
    hf = load_hf_target(target)
    greedy = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    # a subset that leaves out about a third of the tokens the target itself produces here
    counts = count_tokens(greedy, VOCAB)
    used = int((counts > 0).sum())
    restricted = drafter_copy(drafter, root / "drafter-restricted")
    vocab = from_counts(counts, size=max(2, used * 2 // 3))
    vocab.save(restricted)
    assert 0.3 < vocab.coverage < 1
    bundle = root / "bundle"
    cli_build(target, restricted, bundle, 4, 160, "--tree-mask", "--quiet")
    return dict(prompts=prompts, greedy=greedy)


# -- the map ---------------------------------------------------------------------------------------------------
def test_from_counts_size_coverage_and_always():
    counts = torch.tensor([5, 0, 9, 1, 3, 0, 2, 0])  # total 20
    v = from_counts(counts, size=2)
    assert v.ids.tolist() == [0, 2] and v.meta["coverage"] == 0.7
    assert from_counts(counts, coverage=0.7).ids.tolist() == [0, 2]  # 14/20 reached with two ids
    assert from_counts(counts, coverage=0.71).ids.tolist() == [0, 2, 4]
    assert from_counts(counts, size=2, always=(7,)).ids.tolist() == [2, 7]  # EOS kept, the rest by count
    assert from_counts(counts, coverage=0.7, always=(7,)).ids.tolist() == [0, 2, 7]  # EOS on top of the coverage
    assert v.d2t.tolist() == [0, 1]  # EAGLE-3 offsets: target id = draft id + d2t[draft id]
    assert (torch.arange(v.size) + v.d2t).tolist() == v.ids.tolist()
    assert v.t2d.tolist() == [True, False, True, False, False, False, False, False]


def test_files_round_trip_and_expand(tmp_path):
    v = from_counts(torch.tensor([4, 0, 1, 7, 0, 2]), size=3, meta={"source": "x"})
    v.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [META, TENSORS]  # no temp files left
    back = DraftVocab.load(tmp_path, 6)
    assert back.ids.tolist() == [0, 3, 5] and back.coverage == v.coverage and back.meta["source"] == "x"
    assert json.loads((tmp_path / META).read_text())["draft_vocab_size"] == 3
    sub = torch.tensor([[1.0, 2.0, 3.0]])
    full = back.expand(sub)
    assert full[0, [0, 3, 5]].tolist() == [1.0, 2.0, 3.0] and torch.isinf(full[0, [1, 2, 4]]).all()
    assert DraftVocab.load(tmp_path / "nothing-here", 6) is None


def _tamper(d, **tensors):
    t = load_file(str(d / TENSORS))
    t.update(tensors)
    save_file(t, str(d / TENSORS))


@pytest.mark.parametrize("case,match", [
    ("out-of-range", "outside the target vocab"),
    ("unsorted", "strictly increasing"),
    ("t2d-shape", "t2d must be bool"),
    ("t2d-disagrees", "t2d and d2t disagree"),
    ("meta-size", "draft_vocab_size"),
    ("meta-target", "target_vocab_size"),
    ("no-json", META + ": file not found"),
    ("no-tensors", TENSORS + ": file not found"),
    ("corrupt", "cannot read safetensors"),
    ("no-d2t", "no 'd2t'"),
])
def test_bad_map_files_name_the_file(tmp_path, case, match):
    v = from_counts(torch.tensor([4, 0, 1, 7, 0, 2]), size=3)
    v.save(tmp_path)
    meta = json.loads((tmp_path / META).read_text())
    if case == "out-of-range":
        _tamper(tmp_path, d2t=torch.tensor([0, 2, 9]))
    elif case == "unsorted":
        _tamper(tmp_path, d2t=torch.tensor([3, -1, 3]))
    elif case == "t2d-shape":
        _tamper(tmp_path, t2d=torch.zeros(5, dtype=torch.bool))
    elif case == "t2d-disagrees":
        _tamper(tmp_path, t2d=torch.tensor([True, True, False, True, False, False]))
    elif case in ("meta-size", "meta-target"):
        meta["draft_vocab_size" if case == "meta-size" else "target_vocab_size"] = 4
        (tmp_path / META).write_text(json.dumps(meta))
    elif case == "no-json":
        (tmp_path / META).unlink()
    elif case == "no-tensors":
        (tmp_path / TENSORS).unlink()
    elif case == "corrupt":
        (tmp_path / TENSORS).write_bytes(b"\x10\x00garbage")
    elif case == "no-d2t":
        save_file({"t2d": v.t2d}, str(tmp_path / TENSORS))
    with pytest.raises(CheckpointError, match=match) as e:
        DraftVocab.load(tmp_path, 6)
    assert str(tmp_path) in str(e.value)


def test_train_draft_vocab_cli(world, tmp_path):
    """From the target's greedy responses to prompts, and from a responses file: the same counts, the same
    map; --coverage picks the fewest ids; bad options are refused before anything is written."""
    from retrace.cli import main

    target, prompts, greedy = world["target"], world["prompts"], world["greedy"]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    a = drafter_copy(world["drafter"], tmp_path / "a")
    r = CliRunner().invoke(main, ["train", "draft-vocab", "--target", str(target), "--drafter", str(a), "--data",
                                  str(data), "--max-new-tokens", str(MAX_NEW), "--coverage", "0.9", "--json"])
    assert r.exit_code == 0, r.output
    va = DraftVocab.load(a, VOCAB)
    counts = count_tokens(greedy, VOCAB)
    assert va.coverage >= 0.9
    eos = set(Qwen3Config.from_dir(target).eos_token_ids)
    rarest = min((t for t in va.ids.tolist() if t not in eos), key=lambda t: (int(counts[t]), -t))
    assert coverage_of(torch.tensor([t for t in va.ids.tolist() if t != rarest]), counts) < 0.9  # the fewest
    assert json.loads(r.output)["draft_vocab_size"] == va.size
    b = drafter_copy(world["drafter"], tmp_path / "b")
    resp = tmp_path / "responses.json"
    resp.write_text(json.dumps({"responses": greedy}))
    r = CliRunner().invoke(main, ["train", "draft-vocab", "--target", str(target), "--drafter", str(b),
                                  "--responses", str(resp), "--size", str(va.size)])
    assert r.exit_code == 0, r.output
    assert DraftVocab.load(b, VOCAB).ids.tolist() == va.ids.tolist()
    c = drafter_copy(world["drafter"], tmp_path / "c")
    for args, msg in ((["--size", "5", "--coverage", "0.5"], "exactly one of --size and --coverage"),
                      (["--size", str(VOCAB + 1)], "must be in 1.."),
                      (["--coverage", "1.5"], "must be in (0, 1]")):
        r = CliRunner().invoke(main, ["train", "draft-vocab", "--target", str(target), "--drafter", str(c),
                                      "--responses", str(resp), *args])
        assert r.exit_code != 0 and msg in r.output, r.output
    assert not (c / TENSORS).exists() and not (c / META).exists()


# -- the head --------------------------------------------------------------------------------------------------
def test_torch_head_is_the_full_heads_rows(world):
    target, full = load_pair(world["target"], world["drafter"])
    _, sub = load_pair(world["target"], world["restricted"])
    assert full.draft_vocab is None and sub.draft_vocab.ids.tolist() == world["vocab"].ids.tolist()
    h = torch.randn(2, 5, 64)
    a, b = full.logits(h), sub.logits(h)
    ids = sub.draft_vocab.ids
    torch.testing.assert_close(b[..., ids], a[..., ids], rtol=1e-5, atol=1e-5)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(b[..., outside]).all()
    _, no_map = load_pair(world["target"], world["restricted"], draft_vocab=False)
    assert no_map.draft_vocab is None


def test_bundle_records_the_map_and_ort_head_matches_torch(world):
    from retrace.engines.bundle import Bundle
    from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

    b = Bundle.open(world["bundle"])
    entry = b.model("drafter")["draft_vocab"]
    assert entry["draft_vocab_size"] == world["vocab"].size and entry["coverage"] == world["vocab"].coverage
    assert "draft_vocab/" + TENSORS in b.manifest["files"]
    be = OnnxRuntimeBackend(b, threads=1, lm_head_session=True)
    assert be.draft_head is not None and be.draft_head.vocab == world["vocab"].size
    assert be.draft_vocab.ids.tolist() == world["vocab"].ids.tolist()
    full = OnnxRuntimeBackend(b, threads=1, draft_vocab=False)
    assert full.draft_vocab is None
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 3, be.drafter_config.num_taps * 64, generator=g)
    pos = torch.arange(3).unsqueeze(0)
    block = torch.randint(0, VOCAB - 1, (1, BLOCK), generator=g)
    bpos = torch.arange(3, 3 + BLOCK).unsqueeze(0)
    slots = torch.tensor([0])
    _, a = full.draft(slots, ctx, pos, block, bpos, None)
    _, s = be.draft(slots, ctx, pos, block, bpos, None)
    ids = be.draft_vocab.ids
    assert be.draft_ids.tolist() == ids.tolist() and full.draft_ids is None
    assert s.shape[-1] == ids.numel() and a.shape[-1] == VOCAB  # over the subset only: draft_ids names them
    torch.testing.assert_close(s, a[..., ids].float(), rtol=1e-4, atol=1e-4)
    be.use_draft_vocab(None)  # the full head again, on the same loaded bundle
    assert be.draft_ids is None
    _, f = be.draft(slots, ctx, pos, block, bpos, None)
    torch.testing.assert_close(f.float(), a.float(), rtol=1e-4, atol=1e-4)
    with pytest.raises(RetraceError, match="needs a backend opened on a bundle with a draft vocabulary"):
        full.use_draft_vocab(world["vocab"])


def test_subset_of_every_draft_gives_the_full_heads_drafts(world, monkeypatch, tmp_path):
    """A subset holding every token the full head drafts on these prompts: the same drafts, so the same
    acceptance lengths, round for round (a wrong id map would change them)."""
    spy = DraftSpy(monkeypatch)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    full = Runtime.from_dirs(world["target"], world["drafter"], verify_policy="fixed")
    want = full.generate(world["prompts"], params, "retrace")
    drafted = set(spy.drafts)
    assert len(drafted) < VOCAB - 10  # a real subset
    d = drafter_copy(world["drafter"], tmp_path / "d", ids=drafted)
    spy.drafts.clear()
    sub = Runtime.from_dirs(world["target"], d, verify_policy="fixed")
    got = sub.generate(world["prompts"], params, "retrace")
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.stats["accepted_hist"] for r in got] == [r.stats["accepted_hist"] for r in want]
    assert spy.drafts == drafted


# -- greedy: the target's own tokens in every mode and backend ------------------------------------------------
RUNS = {  # name -> (mode, Runtime options)
    "dflash": ("dflash", {}),
    "retrace": ("retrace", {}),
    "tree": ("retrace", {"tree_budget": 12}),
    "prompt-lookup": ("dflash", {"prompt_lookup": PromptLookup(max_rows=4)}),
}


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("run", list(RUNS))
def test_greedy_is_the_targets_own_decode(world, monkeypatch, backend, run):
    mode, opts = RUNS[run]
    spy = DraftSpy(monkeypatch)
    if backend == "torch":
        rt = Runtime.from_dirs(world["target"], world["restricted"], max_batch=4, max_seq_len=160,
                               verify_policy="fixed", **opts)
    else:
        rt = Runtime.from_bundle(world["bundle"], threads=1, verify_policy="fixed", **opts)
        assert rt.backend.draft_head is not None
    res = rt.generate(world["prompts"], SamplingParams(max_new_tokens=MAX_NEW), mode)
    assert [r.token_ids for r in res] == world["greedy"], f"{backend} {run}"
    subset = set(world["vocab"].ids.tolist())
    assert spy.drafts and spy.drafts <= subset, sorted(spy.drafts - subset)
    produced = {t for g in world["greedy"] for t in g}
    assert produced - subset  # the target produced tokens the drafter cannot draft (and still exact)


def test_bad_map_in_a_drafter_or_bundle_is_refused(world, tmp_path):
    d = drafter_copy(world["restricted"], tmp_path / "bad")
    (d / META).unlink()
    with pytest.raises(CheckpointError, match=str(d / META)):
        Runtime.from_dirs(world["target"], d)
    from retrace.export.cli import main

    r = CliRunner().invoke(main, ["build", "--target", str(world["target"]), "--drafter", str(d), "--out",
                                  str(tmp_path / "b"), "--quiet"])
    assert r.exit_code != 0 and str(d / META) in r.output and not (tmp_path / "b").exists()
    b = tmp_path / "bundle"
    shutil.copytree(world["bundle"], b)
    m = json.loads((b / "manifest.json").read_text())
    from retrace.engines.bundle import Bundle, write_manifest
    from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

    for entry in ({"size": 3}, {"dir": "../.."}):
        m["models"]["drafter"]["draft_vocab"] = entry
        write_manifest(b, m)
        with pytest.raises(RetraceError, match="must name the folder"):
            OnnxRuntimeBackend(Bundle.open(b), threads=1)


# -- sampling: the target's distribution ----------------------------------------------------------------------
def test_sampling_with_a_draft_vocab_is_the_targets_distribution(monkeypatch, tmp_path):
    """tests/test_runtime_sampling.py's chi-square check (T=1, retrace mode) with a 5-of-8 subset that leaves
    out tokens of non-negligible target probability: q = 0 there, so p/q and max(0, p - q) stay exact."""
    import test_runtime_sampling as ts

    with single_thread():
        target, drafter = write_pair(tmp_path, vocab=ts.V, hidden=32, layers=2, heads=2, kv_heads=1,
                                     intermediate=48, block_size=4, tokenizer=False, seed=2)
        sd = load_file(target / "model.safetensors")
        sd["lm_head.weight"] = sd["lm_head.weight"] * 4.0
        save_file(sd, str(target / "model.safetensors"), metadata={"format": "pt"})
        hf = load_hf_target(target)
        import itertools

        with torch.no_grad():
            seqs = torch.tensor([ts.PROMPT + list(t) for t in itertools.product(range(ts.V), repeat=ts.NEW - 1)])
            logits = hf(seqs).logits[:, len(ts.PROMPT) - 1:]
        joint = ts.exact_joint(logits, {"temperature": 1.0})
        marg = joint.sum(dim=(1, 2, 3, 4))  # the first new token's distribution
        left_out = marg.argsort(descending=True)[1:4].tolist()  # three likely tokens, not the likeliest
        assert float(marg[left_out].sum()) > 0.1
        write_vocab(drafter, [t for t in range(ts.V) if t not in left_out], vocab=ts.V)
        spy = DraftSpy(monkeypatch)
        outs, stats = ts.sample(target, drafter, {"temperature": 1.0}, 6000)
    assert spy.drafts and not spy.drafts & set(left_out)
    for name, (p_value, df, power) in ts.check(outs, joint).items():
        assert power > 0.9 and p_value > ts.ALPHA, f"{name}: chi-square p={p_value:.2e} (df {df})"
    assert stats["tau"] > 1.1, stats["tau"]


# -- the draft space: the round over the subset (runtime/draft_space.py) ---------------------------------------
def test_draft_space_maps_ids_and_refuses_logits_over_another_space():
    from retrace.runtime.draft_space import DraftSpace

    space = DraftSpace(torch.tensor([1, 4, 6]), 8)
    assert space.size == 3 and not space.full and DraftSpace(None, 8).size == 8
    assert space.tokens(torch.tensor([[2, 0]])).tolist() == [[6, 1]]
    assert space.index_of(torch.tensor([6, 5, 1])).tolist() == [2, -1, 0]
    q = torch.tensor([[0.5, 0.25, 0.25]])
    assert space.probs_full(q).tolist() == [[0, 0.5, 0, 0, 0.25, 0, 0.25, 0]]
    assert torch.isneginf(space.logits_full(q)[0, [0, 2, 3, 5, 7]]).all()
    with pytest.raises(RetraceError, match="logits over 8 ids, its draft space has 3"):
        space.check(torch.zeros(1, 2, 8), object())


def test_suffix_features_over_the_subset_are_the_expanded_logits_features():
    """kept_features with the draft logits over the subset equals the same call on the logits expanded to the
    target's vocabulary (-inf outside): the drafter's probability of d_j, and 0 for a d_j outside the subset
    (a tree path's token from another source)."""
    from retrace.runtime.draft_space import DraftSpace
    from retrace.runtime.suffix_memory import align, kept_features

    g = torch.Generator().manual_seed(0)
    N, B, V = 2, 6, 40
    space = DraftSpace(torch.tensor([0, 3, 5, 9, 17, 22, 31, 39]), V)
    sub = torch.randn(N, B - 1, space.size, generator=g)
    block = torch.cat([torch.randint(0, V, (N, 1), generator=g), space.tokens(sub.argmax(-1))], 1)
    block[1, 3] = 7  # not in the subset
    verify = torch.randn(N, B, V, generator=g)
    old, _, corr = align(torch.tensor([0, 1]), B, torch.full((N,), B - 1))
    args = (verify, verify.argmax(-1), old, corr, range(0, B - 1))
    want = kept_features(block, verify, space.logits_full(sub), *args[1:])
    got = kept_features(block, verify, sub, *args[1:], space)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert got[..., 2].gt(0).any() and (got[1, :, 2][old[1] == 3] == 0).all()


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_backends_draft_over_the_subset(world, backend):
    """With a draft vocabulary the draft call's logits are over the subset (draft_ids names their target ids);
    the dense-past torch backend (the model's own forward, what rollouts run) keeps them at target ids."""
    from retrace.runtime.torch_concat import ConcatTorchBackend

    rt = (Runtime.from_dirs(world["target"], world["restricted"], max_batch=2, max_seq_len=160) if backend == "torch"
          else Runtime.from_bundle(world["bundle"], threads=1, max_batch=2))
    assert rt.backend.draft_ids.tolist() == world["vocab"].ids.tolist()
    if backend == "torch":
        target, drafter = load_pair(world["target"], world["restricted"])
        assert ConcatTorchBackend(target, drafter, max_batch=2, max_seq_len=160).draft_ids is None
