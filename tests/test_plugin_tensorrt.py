"""TensorRT plugin definitions, tested without TensorRT: the clear missing-dependency error, the
tactic and type tables, the launch grid, and the registered descriptor / autotune / AOT functions
driven through a stand-in of `tensorrt.plugin` (tests/trt_standin.py) that validates each decorated
function as TensorRT does and records what `register()` defines. The AOT functions really run
`triton.compile` (PTX for sm_90, no GPU needed). No `from __future__ import annotations` in this file:
TensorRT validates annotation objects, and postponed annotations would be strings."""

import sys
import types

import pytest
import trt_standin

from retrace.plugins import tensorrt_plugin as tp
from retrace.plugins import triton_kernel as tk
from retrace.plugins.errors import RetraceMissingDependency


def test_register_without_tensorrt_is_one_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    monkeypatch.setattr(tp, "_registered", False)
    with pytest.raises(RetraceMissingDependency) as info:
        tp.register()
    msg = str(info.value)
    assert "pip install tensorrt" in msg and "a Linux machine with an NVIDIA GPU" in msg
    assert isinstance(info.value, ImportError) and info.value.__cause__ is None


def test_register_with_a_stub_tensorrt_package(monkeypatch):
    """PyPI's `tensorrt` without NVIDIA's index is a stub without the API: same clear error."""
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    monkeypatch.setattr(tp, "_registered", False)
    with pytest.raises(RetraceMissingDependency, match="pip install tensorrt"):
        tp.register()


def test_autotune_type_strings():
    dep, free = "FP32|FP16|BF16", "FP32*FP16*BF16"
    fusion = [x.strip() for x in tp.autotune_types(tp.FUSION).split(",")]
    assert fusion == [dep] * 3 + [free, free] + [dep] * 6  # x..correction, features, valid, weights, out
    refine = [x.strip() for x in tp.autotune_types(tp.REFINE).split(",")]
    assert refine == [dep] * 3 + ["FP32"]  # memory, correction, w_refine -> fp32 refined
    fuse = [x.strip() for x in tp.autotune_types(tp.FUSE).split(",")]
    assert fuse == [dep, "FP32", free, free] + [dep] * 5  # x, refined, features, valid, 4 weights, out
    # TensorRT's rules: an entry uses '|' or '*', not both; all '|' entries have the same length
    for plugin in (tp.FUSION, tp.REFINE, tp.FUSE):
        entries = [x.strip() for x in tp.autotune_types(plugin).split(",")]
        assert not any("|" in e and "*" in e for e in entries)
        assert {len(e.split("|")) for e in entries if "|" in e} == {3}


def test_tactics_are_the_tile_table():
    assert tp.tactics(tp.REFINE) == tp.tactics(tp.FUSE) == [1, 2, 3, 4]
    assert all(tk.TILE_BY_TACTIC[t].tactic == t for t in tp.tactics(tp.FUSE))
    assert tp.tactics(tp.FUSION) == []


def test_launch_grid():
    t = tk.Tile(7, 16, 64, 32)
    assert tk.launch_grid(10, 24, t) == (1, 1)
    assert tk.launch_grid(16 * 8, 4096, t) == (8, 64)
    assert tk.launch_grid(17, 65, t) == (2, 2)


# ---- a stand-in for tensorrt / tensorrt.plugin that validates like TensorRT (tests/trt_standin.py) ----

_Desc = trt_standin.TensorDesc


def _fake_tensorrt(version: str = "10.14.1"):
    return trt_standin.make_tensorrt(version)


@pytest.fixture
def fake_trt(monkeypatch):
    trt, trtp = _fake_tensorrt()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(tp, "_registered", False)
    monkeypatch.setenv(tp.TARGET_ENV, "cuda:90")
    tp.register()
    tp.register()  # idempotent
    return trt, trtp


def test_standin_refuses_what_tensorrt_refuses():
    """The stand-in's validation is TensorRT's: an aot_impl without its return annotation (the defect the
    plugins had) or with a parameter list off the schema fails when the decorator is applied."""
    trt, trtp = _fake_tensorrt()
    D = trtp.TensorDesc

    @trtp.register("demo::Op")
    def desc(x: D, scale: float) -> D:
        return x.like()

    def no_return(x: D, scale: float, outputs: tuple[D], tactic: int):
        return None

    with pytest.raises(ValueError, match="No return annotation found for aot_impl function"):
        trtp.aot_impl("demo::Op")(no_return)

    def wrong_order(scale: float, x: D, outputs: tuple[D], tactic: int) -> tuple[str, str, trtp.KernelLaunchParams,
                                                                                 trtp.SymIntExprs]:
        return None

    with pytest.raises(ValueError, match="does not match the expected input arg schema"):
        trtp.aot_impl("demo::Op")(wrong_order)
    with pytest.raises(ValueError, match="does not have a type annotation"):
        trtp.register("demo::Bad")(lambda x: x)

    def ok(x: D, scale: float, outputs: tuple[D], tactic: int) -> tuple[str | bytes, str | bytes,
                                                                         trtp.KernelLaunchParams, trtp.SymIntExprs]:
        return None

    assert trtp.aot_impl("demo::Op")(ok) is ok


@pytest.mark.parametrize("version", ["10.8.0", "10.7.0.23"])
def test_register_needs_tensorrt_10_9(monkeypatch, version):
    """aot_impl / KernelLaunchParams / SymIntExprs arrived in 10.9: an older TensorRT is one clear error."""
    trt, trtp = _fake_tensorrt(version)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.setattr(tp, "_registered", False)
    with pytest.raises(RetraceMissingDependency) as info:
        tp.register()
    assert "pip install 'tensorrt>=10.9'" in str(info.value) and f"found tensorrt {version}" in str(info.value)
    assert not trtp.defined  # refused before anything was defined


def test_registered_definitions(fake_trt):
    trt, trtp = fake_trt
    kinds = {(k, p) for k, p in trtp.defined}
    assert kinds == {("register", tp.FUSION), ("autotune", tp.FUSION), ("impl", tp.FUSION),
                     ("register", tp.REFINE), ("autotune", tp.REFINE), ("aot_impl", tp.REFINE),
                     ("register", tp.FUSE), ("autotune", tp.FUSE), ("aot_impl", tp.FUSE)}
    n, b, d, f = 2, 16, 64, 3
    x = _Desc([n, b, d], trt.float16)
    w = _Desc([d, d], trt.float16)
    out = trtp.defined[("register", tp.FUSION)](x, x, x, _Desc([n, b, f], trt.float16), _Desc([n, b], trt.float16),
                                                w, w, w, w, w, 1e-6)
    assert (list(out.shape_expr), out.dtype) == ([n, b, d], trt.float16)
    refined = trtp.defined[("register", tp.REFINE)](x, x, w)
    assert (list(refined.shape_expr), refined.dtype) == ([n, b, d], trt.float32)
    combos = trtp.defined[("autotune", tp.FUSE)](*[x] * 8, (x,))
    assert combos == [(tp.autotune_types(tp.FUSE), "LINEAR", [1, 2, 3, 4])]
    assert trtp.defined[("autotune", tp.FUSION)](*[x] * 10, (x,)) == [(tp.autotune_types(tp.FUSION), "LINEAR", None)]


@pytest.mark.parametrize("dtype_attr,mask_attr,tactic", [("float16", "float32", 1), ("float32", "float32", 3)])
def test_aot_impls_compile_triton_to_ptx(fake_trt, dtype_attr, mask_attr, tactic):
    trt, trtp = fake_trt
    dt, mdt = getattr(trt, dtype_attr), getattr(trt, mask_attr)
    n, b, d, f = 2, 16, 96, 3
    x, feats, valid = _Desc([n, b, d], dt), _Desc([n, b, f], mdt), _Desc([n, b], mdt)
    tile = tk.TILE_BY_TACTIC[tactic]
    grid = (-(-n * b // tile.block_m), -(-d // tile.block_n))

    name, ptx, launch, extra = trtp.defined[("aot_impl", tp.REFINE)](x, x, _Desc([d, 2 * d], dt),
                                                                      (x,), tactic)
    assert name == "gsf_refine_kernel" and f".entry {name}(" in ptx and ".target sm_90" in ptx
    assert (launch.grid_x, launch.grid_y, launch.block_x) == (*grid, tile.num_warps * 32)
    assert 0 < launch.shared_mem <= tk.SHARED_MEM_LIMIT
    assert extra == [("i32", n * b), ("i32", d)]  # n_rows, d: after the inputs, before the output

    name, ptx, launch, extra = trtp.defined[("aot_impl", tp.FUSE)](
        x, _Desc([n, b, d], trt.float32), feats, valid, _Desc([d, 2 * d + f], dt), _Desc([d], dt),
        _Desc([d], dt), _Desc([d, d], dt), 1e-6, (x,), tactic)
    assert name == "gsf_fuse_kernel" and f".entry {name}(" in ptx
    assert (launch.grid_x, launch.grid_y) == grid
    assert extra == [("i32", n * b), ("i32", d), ("i32", f)]
    names = {"FLOAT": "FP32", "HALF": "FP16"}
    key = ("fuse", names[dt], tactic, 1e-6, "cuda:90", names[mdt], names[mdt])
    # cached under the dtypes of x and of features/valid: several nodes of one engine share a compile
    assert tp.compiled(*key).ptx == ptx
