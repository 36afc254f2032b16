"""In-place K/V on ONNX Runtime (retrace.runtime.kv_inplace): the target graph's Concat + Attention become
GroupQueryAttention over the slots' caches bound whole as past and present. Call by call it gives the
logits, taps and cache entries of the portable graph (gather mode): ragged prefill, batched verify,
scattered slots and a draft tree's verify; it is the default on the CPU and refuses what it cannot do."""

from __future__ import annotations

import onnx
import pytest
import torch
from export_fixtures import pair_and_bundle
from runtime_fixtures import call_both

from retrace.errors import RetraceError
from retrace.runtime import kv_inplace
from retrace.runtime.onnxruntime_backend import OnnxRuntimeBackend

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def backends(one_thread):
    built = pair_and_bundle()
    pair = {m: OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=3, threads=1, verify=False, kv_mode=m)
            for m in ("gather", None)}
    return built, pair["gather"], pair[None]


def test_default_is_inplace_and_the_graph_has_no_past_copies(backends):
    _, ref, new = backends
    assert new.kv_mode == "inplace" and ref.kv_mode == "gather" and ref.inplace is None
    layers = new.target_config.layers.num_hidden_layers
    assert new.inplace.layers == layers
    sess = new.tgraph.sess
    assert not [o.name for o in sess.get_outputs() if o.name.startswith("new_key_")]
    assert len([o for o in sess.get_outputs() if o.name.startswith("present_")]) == 2 * layers
    assert {"seqlens_k", "query_seqlens", "total_sequence_length"} <= {i.name for i in sess.get_inputs()}


def test_calls_match_the_portable_graph(backends):
    built, ref, new = backends
    V = ref.target_config.vocab_size
    g = torch.Generator().manual_seed(2)
    lens = {0: 11, 1: 4, 2: 7}
    for s, n in lens.items():  # ragged prefill, one slot at a time
        call_both(ref, new, torch.tensor([s]), torch.randint(0, V, (1, n), generator=g), torch.arange(n)[None],
                   torch.tensor([[n - 1]]))
    for slots, T in (([0, 1], 3), ([0, 2], 2), ([0, 1, 2], 1)):  # contiguous and scattered slots, T > 1
        slots_t = torch.tensor(slots)
        past = torch.tensor([lens[s] for s in slots])
        call_both(ref, new, slots_t, torch.randint(0, V, (len(slots), T), generator=g),
                   past[:, None] + torch.arange(T), torch.arange(T).expand(len(slots), T).contiguous())
        for s in slots:
            lens[s] += T
    for s, n in lens.items():  # the entries written (past them: a pad row's, retrace.runtime.row_invariance)
        assert torch.allclose(ref.tcache.kv[:, s, :, :n], new.tcache.kv[:, s, :, :n], atol=1e-5)


def test_a_scattered_prefill_from_position_0_gathers_nothing(one_thread, monkeypatch):
    """Prompts grouped by length put scattered slots in one prefill call while the slot between them is live:
    the call reads none of its slots' past, so it binds an empty buffer instead of gathering their caches (the
    same logits, taps and written entries as the portable graph; the live slot untouched)."""
    built = pair_and_bundle()
    ref, new = (OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=3, threads=1, verify=False, kv_mode=m)
                for m in ("gather", None))
    V = ref.target_config.vocab_size
    g = torch.Generator().manual_seed(7)
    call_both(ref, new, torch.tensor([1]), torch.randint(0, V, (1, 6), generator=g), torch.arange(6)[None],
              torch.tensor([[5]]))  # slot 1 live
    live = new.tcache.kv[:, 1, :, :6].clone()
    gathers = []
    real = torch.index_select
    cache = new.tcache.kv.data_ptr()
    monkeypatch.setattr(torch, "index_select",
                        lambda x, *a, **k: gathers.append(x.data_ptr() == cache) or real(x, *a, **k))
    call_both(ref, new, torch.tensor([0, 2]), torch.randint(0, V, (2, 5), generator=g),
              torch.arange(5).expand(2, 5), torch.tensor([[4], [4]]))
    monkeypatch.undo()
    assert not any(gathers)  # nothing read from the in-place backend's caches
    for s in (0, 2):
        assert torch.allclose(ref.tcache.kv[:, s, :, :5], new.tcache.kv[:, s, :, :5], atol=1e-5)
    assert torch.equal(new.tcache.kv[:, 1, :, :6], live)
    # and the next step of both rows (a scattered decode with slot 1 live: a gather) still agrees
    call_both(ref, new, torch.tensor([0, 2]), torch.randint(0, V, (2, 1), generator=g),
              torch.tensor([[5], [5]]), torch.tensor([[0], [0]]))


def test_scattered_slots_with_free_gaps_run_over_the_covering_range(one_thread):
    """Slots [0, 2] once slot 1 is released: the in-place backend runs rows 0..2 (slot 1 a dummy row) instead
    of gathering the caches, and gives the gather graph's logits, taps and entries; the rows it was asked for
    come back bit-identical to the same rows of a contiguous call (fp32 rows do not depend on the call's
    width); while slot 1 is live the call gathers (test above)."""
    built = pair_and_bundle()
    ref, new = (OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=3, threads=1, verify=False, kv_mode=m)
                for m in ("gather", None))
    V = ref.target_config.vocab_size
    g = torch.Generator().manual_seed(5)
    lens = {0: 9, 1: 5, 2: 6}
    for s, n in lens.items():
        call_both(ref, new, torch.tensor([s]), torch.randint(0, V, (1, n), generator=g), torch.arange(n)[None],
                  torch.tensor([[n - 1]]))
    assert new.cover.plan([0, 2], 1) is None  # slot 1 holds a live cache
    for be in (ref, new):
        be.release(1)
    assert new.cover.plan([0, 2], 17) is None  # wider than a verify (a prefill): gathered
    spans = []
    plan = new.cover.plan
    new.cover.plan = lambda slots, tokens: spans.append(r := plan(slots, tokens)) or r
    for T in (1, 3):
        ids = torch.randint(0, V, (2, T), generator=g)
        past = torch.tensor([lens[0], lens[2]])
        call_both(ref, new, torch.tensor([0, 2]), ids, past[:, None] + torch.arange(T), torch.arange(T).expand(2, T))
        lens[0] += T
        lens[2] += T
    assert [r[0] for r in spans] == [[0, 1, 2]] * 2 and spans[0][1] == [0, 2]
    for s in (0, 2):
        assert torch.allclose(ref.tcache.kv[:, s, :, :lens[s]], new.tcache.kv[:, s, :, :lens[s]], atol=1e-5)
    # the rows asked for equal the same rows computed in a contiguous call (slot 1 live again)
    ids = torch.randint(0, V, (2, 2), generator=g)
    pos = torch.tensor([[lens[0]], [lens[2]]]) + torch.arange(2)
    covered = new.target(torch.tensor([0, 2]), ids, pos, torch.arange(2).expand(2, 2))
    new.cover.free.clear()
    for s in (0, 2):  # one-row calls: the same rows, not covered
        alone = new.target(torch.tensor([s]), ids[s // 2:s // 2 + 1], pos[s // 2:s // 2 + 1], torch.arange(2)[None])
        assert torch.equal(covered[0][s // 2], alone[0][0]) and torch.equal(covered[1][s // 2], alone[1][0])


def test_another_attention_form_is_left_alone_and_explicit_inplace_refuses(backends, monkeypatch):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))
    before = model.SerializeToString()
    assert kv_inplace.to_inplace_kv(model, 4, 2, 16) is None and model.SerializeToString() == before
    onnx.checker.check_model(model)

    built, _, _ = backends
    monkeypatch.setattr("retrace.runtime.onnxruntime_backend.to_inplace_kv", lambda *a, **k: None)
    assert OnnxRuntimeBackend.from_bundle(built.bundle, verify=False).kv_mode == "gather"  # auto: falls back
    with pytest.raises(RetraceError, match="needs the exported attention form"):
        OnnxRuntimeBackend.from_bundle(built.bundle, verify=False, kv_mode="inplace")


def test_inplace_needs_the_caches_on_the_providers_device(backends):
    """The in-place form shares the caches with the operator: they must sit on the first provider's device
    (with CUDA first, on the GPU through a CUDA torch, which this machine lacks: the caches stay in host
    memory, so in place is refused; asking for device="cuda" is one clear error)."""
    built, _, _ = backends
    cuda_first = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(RetraceError, match="torch.cuda.is_available\\(\\) is False.*device='cpu'"):
        OnnxRuntimeBackend.from_bundle(built.bundle, verify=False, providers=cuda_first, device="cuda")
    with pytest.raises(RetraceError, match="the K/V caches live on cpu, not on CUDAExecutionProvider's device"):
        OnnxRuntimeBackend.from_bundle(built.bundle, verify=False, kv_mode="inplace", providers=cuda_first)


def test_an_onnxruntime_without_the_operator_falls_back_to_the_portable_graph(backends, monkeypatch):
    """A rewritten graph this ONNX Runtime cannot load (older versions lack GroupQueryAttention's newer
    inputs; here an unknown op stands in): auto mode serves the exported graph (gather), exactly."""
    import retrace.runtime.onnxruntime_backend as orb

    real = orb.to_inplace_kv

    def broken(model, *a, **k):
        info = real(model, *a, **k)
        for n in model.graph.node:
            if n.op_type == "GroupQueryAttention":
                n.op_type = "GroupQueryAttentionFromTheFuture"
        return info

    monkeypatch.setattr(orb, "to_inplace_kv", broken)
    built, ref, _ = backends
    be = OnnxRuntimeBackend.from_bundle(built.bundle, max_batch=3, threads=1, verify=False)
    assert be.kv_mode == "gather" and be.inplace is None
    ids = torch.arange(1, 8)[None]
    a = be.target(torch.tensor([2]), ids, torch.arange(7)[None], torch.tensor([[6]]))
    b = ref.target(torch.tensor([2]), ids, torch.arange(7)[None], torch.tensor([[6]]))
    assert torch.equal(a[0], b[0])
    with pytest.raises(RetraceError, match="cannot load the target graph"):
        OnnxRuntimeBackend.from_bundle(built.bundle, verify=False, kv_mode="inplace")
