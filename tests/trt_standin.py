"""A stand-in for `tensorrt` / `tensorrt.plugin` that validates what the decorators receive the way
TensorRT's own `tensorrt.plugin` does when a decorator is applied (read against NVIDIA/TensorRT
python/packaging/bindings_wheel/tensorrt/plugin/_validate.py): every register argument annotated, no
defaults, tensors before attributes, serializable attribute types, a TensorDesc return; autotune / impl
/ aot_impl parameter lists equal to the registered tensors, then a subset of the attributes in
registration order, then `outputs` (+ `stream` [+ `tactic`] for impl, + `tactic` for aot_impl);
annotated attributes typed as registered; impl returns None; aot_impl MUST be annotated
tuple[str | bytes, str | bytes, KernelLaunchParams, SymIntExprs]. A definition TensorRT would refuse
raises ValueError here too, so `register()` fails in a test exactly where it would fail on a GPU machine.
"""

from __future__ import annotations

import inspect
import math
import types
import typing

SERIALIZABLE = (int, float, bytes, bool, str)
RESERVED_ATTRS = {"outputs", "stream", "tactic"}


class Shape(list):
    def numel(self):
        return math.prod(self)


class TensorDesc:
    def __init__(self, shape, dtype):
        self.shape_expr = Shape(shape)
        self.dtype = dtype

    @property
    def ndim(self):
        return len(self.shape_expr)

    def like(self):
        return TensorDesc(list(self.shape_expr), self.dtype)


class Tensor:
    pass


class KernelLaunchParams:
    pass


class SymExprs(list):
    pass


class SymIntExprs(SymExprs):
    @classmethod
    def from_tuple(cls, items):
        return cls(items)


class _Def:
    def __init__(self, tensors: list[str], attrs: dict[str, type]):
        self.tensors, self.attrs = tensors, attrs


def _is_desc(annotation) -> bool:
    return inspect.isclass(annotation) and issubclass(annotation, TensorDesc)


def _parse_register(fn) -> _Def:
    sig = inspect.signature(fn)
    tensors, attrs = [], {}
    for name, p in sig.parameters.items():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise ValueError(f"register: argument {name} is not positional-or-keyword or keyword-only")
        if p.annotation is p.empty:
            raise ValueError(f"register: argument {name} does not have a type annotation")
        if p.default is not p.empty:
            raise ValueError(f"register: argument {name} has a default value")
        if _is_desc(p.annotation):
            if attrs:
                raise ValueError(f"register: TensorDescs and attributes interspersed in {sig}")
            tensors.append(name)
            continue
        if not tensors:
            raise ValueError(f"register: TensorDescs must come first in {sig}")
        if name in RESERVED_ATTRS:
            raise ValueError(f"register: '{name}' is not allowed as an attribute name")
        if p.annotation not in SERIALIZABLE:
            raise ValueError(f"register: attribute {name} of type {p.annotation} is not serializable")
        attrs[name] = p.annotation
    ret = sig.return_annotation
    if ret is sig.empty:
        raise ValueError(f"No return annotation found for register function. Received signature {sig}.")
    outs = typing.get_args(ret) if typing.get_origin(ret) is tuple else (ret,)
    if not all(_is_desc(a) for a in outs):
        raise ValueError(f"register: return type {ret} is not TensorDesc or Tuple[TensorDesc]")
    return _Def(tensors, attrs)


def _check_params(kind: str, fn, d: _Def, tail: list[str], element) -> None:
    sig = inspect.signature(fn)
    used = []
    for name, p in sig.parameters.items():
        a = p.annotation
        if name in d.attrs:
            used.append(name)
        if a is p.empty:
            continue
        if name == "outputs":
            if typing.get_origin(a) is not tuple or not all(issubclass(x, element) for x in typing.get_args(a)):
                raise ValueError(f"{kind}: 'outputs' should be a Tuple[{element.__name__}], got {a}")
        elif name in ("stream", "tactic"):
            if not issubclass(a, int):
                raise ValueError(f"{kind}: '{name}' should be an int")
        elif inspect.isclass(a) and issubclass(a, (TensorDesc, Tensor)):
            if name not in d.tensors:
                raise ValueError(f"{kind}: unexpected tensor '{name}'")
        elif name not in d.attrs:
            raise ValueError(f"{kind}: unexpected attribute '{name}'")
        elif a != d.attrs[name]:
            raise ValueError(f"{kind}: attribute '{name}' annotated {a}, registered {d.attrs[name]}")
    expected = d.tensors + [n for n in d.attrs if n in used] + tail
    if list(sig.parameters) != expected:
        raise ValueError(f"Signature of the {kind} function '{sig}' does not match the expected input arg "
                         f"schema: ({', '.join(expected)})")


def _str_or_bytes(a) -> bool:
    if typing.get_origin(a) in (typing.Union, types.UnionType):
        return all(x in (str, bytes) for x in typing.get_args(a))
    return a in (str, bytes)


def _check_aot_return(fn) -> None:
    sig = inspect.signature(fn)
    ret = sig.return_annotation
    if ret is sig.empty:
        raise ValueError(f"No return annotation found for aot_impl function. Received signature {sig}.")
    args = typing.get_args(ret) if typing.get_origin(ret) is tuple else ()
    if not (len(args) == 4 and _str_or_bytes(args[0]) and _str_or_bytes(args[1])
            and inspect.isclass(args[2]) and issubclass(args[2], KernelLaunchParams)
            and inspect.isclass(args[3]) and issubclass(args[3], SymExprs)):
        raise ValueError(f"aot_impl: return annotation {ret}, expected "
                         "tuple[str | bytes, str | bytes, KernelLaunchParams, SymIntExprs]")


def make_tensorrt(version: str = "10.14.1"):
    """(tensorrt, tensorrt.plugin) module objects; `trtp.defined[(kind, plugin_id)]` holds each function."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.Builder = object
    trt.float32, trt.float16, trt.bfloat16 = "FLOAT", "HALF", "BF16"
    trtp = types.ModuleType("tensorrt.plugin")
    trtp.defined, defs = {}, {}

    def register(plugin_id):
        def deco(fn):
            ns, _, name = plugin_id.partition("::")
            if not ns or not name or "." in ns or "." in name or ns in ("trt", "tensorrt", "std"):
                raise ValueError(f"register: bad plugin id {plugin_id!r}")
            defs[plugin_id] = _parse_register(fn)
            trtp.defined[("register", plugin_id)] = fn
            return fn
        return deco

    def stage(kind, tail, element, extra=None):
        def factory(plugin_id):
            def deco(fn):
                if plugin_id not in defs:
                    raise ValueError(f"{kind}: plugin {plugin_id} is not registered")
                tails = tail(fn) if callable(tail) else tail
                _check_params(kind, fn, defs[plugin_id], tails, element)
                if extra:
                    extra(fn)
                trtp.defined[(kind, plugin_id)] = fn
                return fn
            return deco
        return factory

    def impl_tail(fn):
        return ["outputs", "stream"] + (["tactic"] if "tactic" in inspect.signature(fn).parameters else [])

    def impl_return(fn):
        ret = inspect.signature(fn).return_annotation
        if ret is not inspect.Signature.empty and ret is not None:
            raise ValueError("impl: return annotation should be None")

    trtp.register = register
    trtp.autotune = stage("autotune", ["outputs"], TensorDesc)
    trtp.impl = stage("impl", impl_tail, Tensor, impl_return)
    trtp.aot_impl = stage("aot_impl", ["outputs", "tactic"], TensorDesc, _check_aot_return)
    trtp.TensorDesc, trtp.Tensor = TensorDesc, Tensor
    trtp.from_shape_expr = lambda shape, dtype: TensorDesc(list(shape), dtype)
    trtp.cdiv = lambda a, b: -(-a // b)
    trtp.KernelLaunchParams = KernelLaunchParams
    trtp.SymInt32 = lambda v: ("i32", v)
    trtp.SymIntExprs = SymIntExprs
    trtp.AutoTuneCombination = lambda types_, layouts, tactics: (types_, layouts, tactics)
    trt.plugin = trtp
    return trt, trtp
