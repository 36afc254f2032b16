"""One copy of the weights the drafter shares with the target (embedding, LM head) in ONNX Runtime.

The drafter graph carries the target's embedding / LM head as initializers named `shared_target.<name>`
(the target graph names them `target.<name>`); the build checks they are byte-identical and records the
pairs in the manifest (`graphs.drafter.shared_initializers`: drafter name -> target name). At load time
each such tensor is mapped ONCE, read-only, from the target's external data file and given to both
sessions with `SessionOptions.add_initializer` (one OrtValue, two names), so neither session reads its
own copy. A prepacked B operand gets a private packed copy per session, so for a large table the LM head
of both graphs runs in one session of its own (retrace.runtime.lm_head_split), and the mapping is read
only where the embedding Gathers touch it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from retrace.engines.bundle import Bundle, BundleError

SHARED_PREFIX = "shared_target."
TARGET_PREFIX = "target."
_DTYPES = {1: np.float32, 10: np.float16, 11: np.float64, 7: np.int64, 2: np.uint8}  # onnx.TensorProto data types


def tensor_bytes(init) -> int:
    """Bytes of an initializer (TensorProto) without loading it: its external data length, or raw data."""
    ext = {e.key: e.value for e in init.external_data}
    if "length" in ext:
        return int(ext["length"])
    if init.raw_data:
        return len(init.raw_data)
    n = int(np.prod(init.dims)) if init.dims else 1
    return n * np.dtype(_DTYPES.get(init.data_type, np.float32)).itemsize


def _initializers(graph_path: Path) -> dict:
    import onnx

    return {i.name: i for i in onnx.load(str(graph_path), load_external_data=False).graph.initializer}


def _map(graph_path: Path, init) -> np.ndarray:
    """The initializer's external data, memory-mapped read-only (nothing is read until it is used)."""
    ext = {e.key: e.value for e in init.external_data}
    dtype = _DTYPES.get(init.data_type)
    if "location" not in ext or dtype is None:
        raise BundleError(f"{graph_path}: initializer {init.name!r} is not an external float or uint8 tensor; it "
                          "cannot be shared (rebuild the bundle with retrace-export build)")
    data = graph_path.parent / ext["location"]
    shape = tuple(int(d) for d in init.dims)
    length = int(np.prod(shape)) * np.dtype(dtype).itemsize
    offset = int(ext.get("offset", 0))
    if "length" in ext and int(ext["length"]) != length or not data.is_file() or data.stat().st_size < offset + length:
        raise BundleError(f"{data}: external data of {init.name!r} does not hold a {'x'.join(map(str, shape))} "
                          f"{np.dtype(dtype).name} tensor at offset {offset}")
    return np.memmap(data, dtype=dtype, mode="r", offset=offset, shape=shape)


def map_initializer(graph_path: Path, name: str) -> np.ndarray:
    """The graph's external initializer `name`, memory-mapped read-only."""
    init = _initializers(graph_path).get(name)
    if init is None:
        raise BundleError(f"{graph_path}: no initializer {name!r}")
    return _map(graph_path, init)


def shared_pairs(target_graph: Path, drafter_graph: Path, check_values: bool = True) -> dict[str, str]:
    """Drafter initializer -> target initializer for every `shared_target.<name>` the target graph holds as
    `target.<name>` with the same shape, dtype and (check_values) bytes: what the build records."""
    t_inits, d_inits = _initializers(target_graph), _initializers(drafter_graph)
    pairs = {}
    for name, init in d_inits.items():
        if not name.startswith(SHARED_PREFIX):
            continue
        t_name = TARGET_PREFIX + name[len(SHARED_PREFIX):]
        t = t_inits.get(t_name)
        if t is None or list(t.dims) != list(init.dims) or t.data_type != init.data_type:
            continue
        if check_values and not np.array_equal(_map(target_graph, t), _map(drafter_graph, init)):
            continue
        pairs[name] = t_name
    return pairs


class SharedWeights:
    """The shared tensors of a bundle, mapped once: `target` and `drafter` are {initializer name: OrtValue}
    for the two sessions' add_initializer (the same OrtValue under both names). Keep this object alive as
    long as the sessions: ONNX Runtime reads the mapped memory in place."""

    def __init__(self, bundle: Bundle, pairs: dict[str, str]):
        from onnxruntime import OrtValue

        where = bundle.root / "manifest.json"
        t_path, d_path = bundle.graph_path("target"), bundle.graph_path("drafter")
        t_inits, d_inits = _initializers(t_path), _initializers(d_path)
        self.pairs = dict(pairs)  # drafter initializer -> target initializer
        self.arrays: dict[str, np.ndarray] = {}
        self.target: dict[str, OrtValue] = {}
        self.drafter: dict[str, OrtValue] = {}
        for d_name, t_name in pairs.items():
            t, d = t_inits.get(t_name), d_inits.get(d_name)
            if t is None or d is None or list(t.dims) != list(d.dims) or t.data_type != d.data_type:
                raise BundleError(f"{where}: graphs.drafter.shared_initializers pairs {d_name!r} with {t_name!r}, "
                                  "but the graphs do not both hold it with one shape and dtype; rebuild the bundle "
                                  "with retrace-export build")
            if t_name not in self.target:
                self.arrays[t_name] = _map(t_path, t)
                self.target[t_name] = OrtValue.ortvalue_from_numpy(self.arrays[t_name])
            self.drafter[d_name] = self.target[t_name]

    @classmethod
    def of(cls, bundle: Bundle) -> SharedWeights | None:
        """The bundle's shared weights, or None for a bundle without a shared_initializers table (built
        before it existed: each session then loads its own copy, as those bundles always did)."""
        graph = bundle.graph("drafter") or {}
        pairs = graph.get("shared_initializers")
        if not pairs:
            return None
        if not isinstance(pairs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in pairs.items()):
            raise BundleError(f"{bundle.root / 'manifest.json'}: graphs.drafter.shared_initializers must map "
                              "drafter initializer names to target initializer names")
        return cls(bundle, pairs)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())
