"""The LM head in ONNX Runtime, rewritten at load time: prepacked, and once per process when it is shared.

ONNX Runtime's CPU kernels prepack a constant B operand of MatMul/Gemm into a private copy per session, so
the exported head (`retrace.models.layers.lm_head`: the [V, d] table as the unpacked A operand, which two
sessions can share) is slow for few rows (figures: docs/bench/shared-weights.md).
`rewrite_head` turns it into Gemm(rows, W, transB=1), W as stored, either inside the graph (prepacked by
that session; for a small table, a copy per session costs little and saves a call) or cut off, the graph
outputting the rows it would score, for one `LmHead` session that holds the only packed copy for the target
and the drafter (a table of LM_HEAD_SESSION_MIN_BYTES or more the drafter shares). ONNX Runtime maps the
table from the target's data file itself and drops that mapping once packed, so the embedding Gathers'
shared mapping (retrace.runtime.shared_weights) is the only other view of it, read only where they touch
it. Cost: one more ONNX Runtime call per target / draft call. Layouts alone:
benchmarks/lm_head_layouts.py. The bundle is unchanged (the TensorRT backend reads the same graphs whole).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from retrace.engines.bundle import BundleError
from retrace.runtime.graph_prune import prune
from retrace.runtime.head_graph import HeadGraph
from retrace.runtime.lm_head_nbits import nbits_head_model, rewrite_nbits_head
from retrace.runtime.ort_io_binding import ELEMENT_DTYPE, BoundSession

# the folder ONNX Runtime resolves a graph's external data against when the graph is given as bytes
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


# a table at least this large gets one LM head session (one packed copy; one more call per target / draft
# call, ~0.03 ms: 2% of a GEMV over 16 MiB, 10-15% of a zoo-size ar step); a smaller one is prepacked in
# each graph (a packed copy per session and the mapping: at most ~48 MiB more; the 0.6B table's 622 MB
# that way gave a peak RSS of 4.22 GB against 3.00 GB with the head session)
LM_HEAD_SESSION_MIN_BYTES = 16 << 20


def rewrite_head(path: Path, cut: bool, model=None) -> HeadGraph | None:
    """The graph with its exported LM head, Reshape(Transpose(MatMul(W, Transpose(rows)))) -> `logits` (the
    A-operand form of retrace.models.layers.lm_head), rewritten: cut off (`logits` replaced by `rows`, for
    an LmHead session) or, cut=False, as Gemm(rows, W, transB=1) inside the graph (prepacked by this
    session). `model`: the graph already loaded (and rewritten otherwise, e.g. retrace.runtime.kv_inplace;
    not changed here) instead of `path`'s. None for a graph without that head (bundles from before it: used
    as they are) when `model` is None, else `model` as it is."""
    import onnx
    from onnx import helper

    from retrace.runtime.shared_weights import tensor_bytes

    if model is not None:
        m = onnx.ModelProto()
        m.CopyFrom(model)
    else:
        m = onnx.load(str(path), load_external_data=False)
    if (quantized := rewrite_nbits_head(m, cut)) is not None:  # an int4 / int8 bundle's head
        return quantized
    g = m.graph
    producer = {o: n for n in g.node for o in n.output}
    inits = {i.name: i for i in g.initializer}
    chain = []
    name, ops = "logits", ("Reshape", "Transpose", "MatMul", "Transpose")
    for op in ops:
        n = producer.get(name)
        if n is None or n.op_type != op:
            return None if model is None else HeadGraph(m.SerializeToString(), None, "", 0, set(inits))
        chain.append(n)
        name = n.input[1] if op == "MatMul" else n.input[0]
    reshape, t_out, matmul, t_in = chain
    weight = matmul.input[0]
    if weight not in inits or len(inits[weight].dims) != 2:
        return None if model is None else HeadGraph(m.SerializeToString(), None, "", 0, set(inits))
    rows, w = t_in.input[0], inits[weight]
    if cut:
        for n in chain:
            g.node.remove(n)
        out = next(o for o in g.output if o.name == "logits")
        at = list(g.output).index(out)
        g.output.remove(out)
        g.output.insert(at, helper.make_tensor_value_info(rows, w.data_type, ["rows", int(w.dims[1])]))
    else:
        at = list(g.node).index(t_in)
        for n in chain[1:]:
            g.node.remove(n)
        g.node.insert(at, helper.make_node("Gemm", [rows, weight], [reshape.input[0]], name="lm_head_gemm",
                                           transB=1))
    prune(g)  # drop what only the LM head used (its shape arithmetic too)
    return HeadGraph(m.SerializeToString(), rows if cut else None, weight, tensor_bytes(w),
                     {i.name for i in g.initializer})


def _gemm_head(w):
    """A one-node graph logits = Gemm(rows, w, transB=1) over the [V, d] initializer w -> (model, V, elem)."""
    from onnx import helper

    V, d = (int(x) for x in w.dims)
    graph = helper.make_graph([helper.make_node("Gemm", ["rows", w.name], ["logits"], transB=1)], "lm_head",
                              [helper.make_tensor_value_info("rows", w.data_type, ["rows", d])],
                              [helper.make_tensor_value_info("logits", w.data_type, ["rows", V])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model, V, w.data_type


class LmHead:
    """logits = rows @ W^T in its own session (W prepacked once; the only packed copy in the process)."""

    def __init__(self, graph_path: Path, weight: str, options, providers: list, device: torch.device | str = "cpu"):
        import onnx

        quantized = nbits_head_model(graph_path, weight)  # an int4 / int8 bundle's MatMulNBits head
        if quantized is None:
            w = next((i for i in onnx.load(str(graph_path), load_external_data=False).graph.initializer
                      if i.name == weight), None)
            if w is None or len(w.dims) != 2:
                raise BundleError(f"{graph_path}: no [V, d] initializer {weight!r} for the LM head")
            quantized = _gemm_head(w)
        options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(graph_path.parent))
        self._open(*quantized, options, providers, device, f"{graph_path}: LM head {weight!r}")

    @classmethod
    def of_rows(cls, table: np.ndarray, options, providers: list, device: torch.device | str = "cpu") -> LmHead:
        """A head over the given [V', d] rows (a draft vocabulary's rows of the target's table, a copy that
        ONNX Runtime packs and then drops: the packed rows are the only copy kept)."""
        from onnx import numpy_helper

        w = numpy_helper.from_array(np.ascontiguousarray(table), "lm_head_rows")
        return cls.of_model(_gemm_head(w), options, providers, device, "draft vocabulary head")

    @classmethod
    def of_model(cls, head_model: tuple, options, providers: list, device: torch.device | str = "cpu",
                 what: str = "LM head") -> LmHead:
        """A head over a built one-node graph (model, V, elem), e.g. lm_head_nbits.nbits_rows_model's."""
        head = cls.__new__(cls)
        head._open(*head_model, options, providers, device, what)
        return head

    def _open(self, model, V: int, elem: int, options, providers: list, device, what: str) -> None:
        import onnxruntime as ort

        if elem not in ELEMENT_DTYPE:
            raise BundleError(f"{what} has element type {elem}, not float32/16/bf16")
        self.sess = ort.InferenceSession(model.SerializeToString(), options, providers=providers)
        self.bound = BoundSession(self.sess)
        self.op_types = tuple(n.op_type for n in model.graph.node)  # Gemm, or MatMulNBits (int4 / int8)
        self.vocab, self.dtype, self.device = V, ELEMENT_DTYPE[elem], torch.device(device)

    def __call__(self, rows: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
        """rows [R, d] (R = prod(lead)) -> logits [*lead, V], on the session's device (bound where they are)."""
        rows = rows.to(self.device).contiguous()
        out = torch.empty(rows.shape[0], self.vocab, dtype=self.dtype, device=self.device)
        self.bound.run({"rows": rows}, {"logits": out})
        return out.view(*lead, self.vocab)
