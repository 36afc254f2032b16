"""The ONNX Runtime backend: runs an engine bundle's target and drafter graphs (retrace-export build).

Caches: per layer one preallocated K and one V array [max_batch, Hkv, max_seq_len, hd] per model, indexed
by absolute position exactly like the torch backend's KVCache (docs/INTERFACES.md): a call at positions
p..p+T-1 writes the new K/V there and attends to entries < p.

Every call goes through ONNX Runtime's IO binding over raw pointers, so nothing is converted or copied on
the way in or out: outputs land in freshly allocated torch tensors that the loop receives as they are.
K/V of the target (`kv_mode`): "inplace" (the default where the graph allows it) rewrites the target
graph's attention at load time into ONNX Runtime's GroupQueryAttention over a shared past/present buffer
(retrace.runtime.kv_inplace): the cache of a contiguous slot range is bound whole, as a view, and the
operator writes the new K/V into it and attends over each row's own length: no copy of the past at all.
The portable graphs' own form takes past K/V as dense [N,Hkv,P,hd], and a cache slice [slots, :, :P] is
strided whenever P < max_seq_len, so "gather" copies the past a call needs into a reusable staging buffer
(P = the longest past in the batch), and the graph's Concat copies it again; "full" binds the whole cache
of a contiguous slot range (no gather, but every call attends over max_seq_len masked entries). The
drafter's cache (one or two layers) always uses gather (or full). benchmarks/decode_context.py times a decode
step against the context length in each mode and in onnxruntime-genai (docs/bench/decode-context.md).

Shared weights: the drafter graph's copy of the target's embedding / LM head is not loaded; both sessions
use one read-only mapping of the target's (retrace.runtime.shared_weights; bundles whose manifest lists
graphs.drafter.shared_initializers; `share_weights=False` loads both copies, as older bundles do), and
their LM head runs in a third session, the only one that prepacks it (retrace.runtime.lm_head_split;
`lm_head_session` forces it on or off; by default on for a float table of 16 MiB or more; an int4 / int8
MatMulNBits head stays in each graph: one session run per call, see `head_session_pays`).

Draft vocabulary (a bundle whose manifest has models.drafter.draft_vocab; retrace.models.draft_vocab): the
drafter graph's head is cut off and its rows are scored in a session of their own over the subset's rows of
the target's (mapped) table, sliced at load time; the draft call's logits are over the subset only and
`draft_ids` says which target ids they are (runtime/draft_space.py: the round works in that space).
`draft_vocab=False` keeps the full head.

Execution providers: CPU by default; CUDA first when onnxruntime-gpu finds a GPU (`providers` picks
explicitly). The caches, the staging buffers and every output live on the first provider's device
(`device`, retrace.runtime.ort_io_binding: torch memory bound by pointer), so a CUDA call uploads only the
loop's small index inputs and brings back only what the loop reads (the logits rows it asked for, the
taps, the drafter's hidden states); the in-place K/V form runs wherever the caches sit on the provider's
device (on CUDA for fp16 / bf16 graphs: ONNX Runtime's CUDA GroupQueryAttention has no fp32 kernel).
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import numpy as np
import torch

from retrace.engines.bundle import Bundle, BundleError, _inside
from retrace.errors import MissingDependencyError, RetraceError
from retrace.models.draft_vocab import DraftVocab
from retrace.models.drafter import SuffixInputs
from retrace.runtime import file_pages
from retrace.runtime.backend import contiguous_range
from retrace.runtime.bundle_configs import bundle_configs
from retrace.runtime.device import host_values, index_tensor
from retrace.runtime.kv_inplace import BIAS, attention_rows, to_inplace_kv, tree_bias
from retrace.runtime.lm_head_nbits import nbits_rows_model
from retrace.runtime.lm_head_split import (
    EXTERNAL_FOLDER_KEY,
    LM_HEAD_SESSION_MIN_BYTES,
    HeadGraph,
    LmHead,
    rewrite_head,
)
from retrace.runtime.ort_io_binding import (
    ELEMENT_DTYPE,
    PROVIDER_DEVICE,
    BoundSession,
    first_provider,
    session_device,
    torch_dtype,
)
from retrace.runtime.ort_spinning import spinning_entries
from retrace.runtime.row_invariance import SPARE, RowWidths, nbits_rule, pad_tree_mask, stricter
from retrace.runtime.shared_weights import SharedWeights, map_initializer
from retrace.runtime.slot_cover import SlotCover

KV_MODES = ("inplace", "gather", "full")
# inputs a device kernel reads on the host (GroupQueryAttention's total_sequence_length): bound from host memory
HOST_INPUTS = {"total_sequence_length"}
# the in-place form (GroupQueryAttention over a shared past/present buffer) per provider: its dtypes
INPLACE_DTYPES = {"cpu": (torch.float32, torch.float16, torch.bfloat16), "cuda": (torch.float16, torch.bfloat16)}


def _ort():
    try:
        import onnxruntime
    except ImportError as e:
        raise MissingDependencyError(
            f"the onnxruntime backend needs the 'onnxruntime' package ({e}); install it with "
            "pip install 'retrace[onnx]' (or onnxruntime-gpu for CUDA)") from None
    return onnxruntime


def default_providers() -> list[str]:
    avail = _ort().get_available_providers()
    return (["CUDAExecutionProvider"] if "CUDAExecutionProvider" in avail else []) + ["CPUExecutionProvider"]


def zeros_on_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Zeros that take memory as they are written. On the CPU an anonymous memory map: its pages are the
    OS's zero page until first written, 4 KiB at a time, so a cache sized for max_seq_len costs what its
    requests' positions fill, not its whole size at load (torch.zeros writes every page; numpy's zeros asks
    for huge pages, which one write maps 2 MiB at a time). Elsewhere torch.zeros."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if not count:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, count * dtype.itemsize)  # the tensor keeps the map alive; unmapped with it
    return torch.frombuffer(pages, dtype=dtype, count=count).view(shape)


class _Cache:
    """K/V of every layer in ONE preallocated tensor [2L, S, Hkv, max_seq_len, hd] on the session's device
    (index 2i = layer i's keys, 2i+1 its values: the graphs' past/new order), so a call's gather and write
    are one tensor op each instead of 2L small ones; ORT reads the staged pasts and writes new K/V through
    raw pointers."""

    def __init__(self, layers: int, slots: int, heads: int, length: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.kv = zeros_on_touch((2 * layers, slots, heads, length, head_dim), dtype, device)
        self.heads, self.head_dim, self.length, self.layers = heads, head_dim, length, layers
        self._staging = torch.empty(0, dtype=dtype, device=device)

    @property
    def k(self) -> list[torch.Tensor]:
        return list(self.kv[0::2])

    @property
    def v(self) -> list[torch.Tensor]:
        return list(self.kv[1::2])

    def past(self, slots: torch.Tensor, length: int, mode: str) -> list[torch.Tensor]:
        """Dense past K/V [N, Hkv, length, hd] per layer, interleaved k0, v0, k1, v1, ..."""
        slots = slots.to(self.kv.device)
        rows = contiguous_range(slots)
        if mode == "full":
            # contiguous slots: views of the caches, no copy (P = max_seq_len); scattered: one gather
            return list(self.kv[:, rows]) if rows is not None else list(self.kv[:, slots].contiguous())
        n = slots.numel()
        need = self.kv.shape[0] * n * self.heads * length * self.head_dim
        if self._staging.numel() < need:  # grow geometrically, never beyond the cache itself
            self._staging = torch.empty(min(max(need, 2 * self._staging.numel()), self.kv.numel()),
                                        dtype=self.kv.dtype, device=self.kv.device)
        dst = self._staging[:need].view(self.kv.shape[0], n, self.heads, length, self.head_dim)
        if length and rows is None:
            torch.index_select(self.kv[:, :, :, :length], 1, slots, out=dst)
        elif length:
            dst.copy_(self.kv[:, rows, :, :length])
        return list(dst)  # dst[j] is contiguous: [N, Hkv, length, hd]

    def new_buffer(self, n: int, t: int) -> torch.Tensor:
        """Where a call's new K/V outputs go: [2L, N, Hkv, T, hd] (dst[j] contiguous, bound to output j)."""
        return torch.empty(self.kv.shape[0], n, self.heads, t, self.head_dim, dtype=self.kv.dtype,
                           device=self.kv.device)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, new: torch.Tensor) -> None:
        """new [2L, N, Hkv, T, hd] written at (slot, position) for every layer."""
        T = positions.shape[1]
        if not T:
            return
        starts = positions[:, 0]
        if bool((positions == starts.unsqueeze(1) + torch.arange(T)).all()):  # consecutive: one slice per row
            for n, (s, p0) in enumerate(zip(slots.tolist(), starts.tolist(), strict=True)):
                self.kv[:, s, :, p0:p0 + T] = new[:, n]
            return
        # index dims (rows, positions) broadcast to [N, T] and move to the front: [N, T, 2L, Hkv, hd]
        dev = self.kv.device
        self.kv[:, slots.to(dev)[:, None], :, positions.to(dev)] = new.permute(1, 3, 0, 2, 4)


class _Graph:
    """One ONNX Runtime session plus its I/O names and dtypes; runs with IO binding over torch memory on
    `device` (feeds built on the host are moved there first, except HOST_INPUTS).
    `shared`: {initializer name: OrtValue} used instead of the graph's own copies (add_initializer);
    `head`: the graph with its LM head rewritten (retrace.runtime.lm_head_split); cut off when `rows` is set."""

    def __init__(self, path: Path, options, providers: list, what: str, shared: dict | None = None,
                 head: HeadGraph | None = None, device: torch.device | str = "cpu"):
        ort = _ort()
        self.device = torch.device(device)
        model, self.rows = str(path), None  # rows: the output that replaces logits in a split graph
        if head is not None:
            model, self.rows = head.model, head.rows
            shared = {k: v for k, v in (shared or {}).items() if k in head.initializers}
            options.add_session_config_entry(EXTERNAL_FOLDER_KEY, str(path.parent))
        for name, value in (shared or {}).items():
            options.add_initializer(name, value)
        try:
            self.sess = ort.InferenceSession(model, options, providers=providers)
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            raise RetraceError(f"{path}: ONNX Runtime {ort.__version__} cannot load the {what} graph ({e}). "
                               "Bundles need onnxruntime >= 1.22 (opset 23)") from None
        self.bound = BoundSession(self.sess)
        self.inputs = {i.name: i.type for i in self.sess.get_inputs()}
        self.outputs = {o.name: o.type for o in self.sess.get_outputs()}
        self.past_names = [n for n in self.inputs if n.startswith(("past_key_", "past_value_"))]
        self.new_names = [n for n in self.outputs if n.startswith(("new_key_", "new_value_"))]

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(self.inputs[name] if name in self.inputs else self.outputs[name])

    def run(self, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        placed = {name: t.contiguous() if name in HOST_INPUTS else t.to(self.device).contiguous()
                  for name, t in feeds.items()}  # kept alive until the run returns
        self.bound.run(placed, outputs)


class OnnxRuntimeBackend:
    name = "onnxruntime"
    loop_threads = 1  # the forwards run in ONNX Runtime's pool; torch's ops around them on one thread (host_threads)

    def __init__(self, bundle: Bundle, max_batch: int | None = None, max_seq_len: int | None = None,
                 threads: int | None = None, providers: list | None = None, kv_mode: str | None = None,
                 session_options: dict | None = None, share_weights: bool = True,
                 lm_head_session: bool | None = None, device: str | None = None, draft_vocab: bool = True,
                 row_invariant: bool = True, lazy_drafter: bool = False):
        """device: where the caches and outputs live (default: the first execution provider's; "cpu" with a
        CUDA provider keeps them in host memory, ONNX Runtime then copying them per call). draft_vocab=False:
        the drafter's full head even where the bundle has a draft vocabulary. row_invariant=False: target
        calls at their own widths (retrace.runtime.row_invariance; a verify row may then differ from the
        decode step's in the last bits). lazy_drafter=True: the drafter's session and cache are made at the
        first draft call (or open_drafter()), so a process that only decodes plainly (`retrace generate
        --mode ar`) never holds them (~0.02 GB for the 0.6B-shape int4 drafter)."""
        _ort()  # a clear error when onnxruntime is missing, before anything else
        file_pages.release_libraries()  # the code `import torch` / onnxruntime touched (runtime/file_pages.py)
        limits = bundle.limits
        if kv_mode is not None and kv_mode not in KV_MODES:
            raise RetraceError(f"unknown kv_mode {kv_mode!r} (choose from {', '.join(KV_MODES)})")
        self.bundle = bundle
        self.max_batch = _limit("max_batch", max_batch, limits.get("max_batch"), bundle.root)
        self.max_seq_len = _limit("max_seq_len", max_seq_len, limits.get("max_seq_len"), bundle.root)
        tm = bundle.model("target")
        self.target_config, self.drafter_config = bundle_configs(bundle)
        self.has_conditioner = bundle.model("conditioner") is not None

        if threads:
            torch.set_num_threads(int(threads))
        self.providers = list(providers) if providers else default_providers()
        self.device = session_device(self.providers, device)
        # the embedding / LM head the drafter graph shares with the target: one mapped copy for both sessions
        self.shared = SharedWeights.of(bundle) if share_weights and self.drafter_config is not None else None
        # the LM head (retrace.runtime.lm_head_split): a large table the drafter shares runs in one session of
        # its own (the only packed copy; loaded first, while nothing else is resident: a lower peak), a small
        # one is prepacked inside each graph (one call fewer per step)
        t_path, d_path = bundle.graph_path("target"), bundle.graph_path("drafter") if self.drafter_config else None
        # measured on the CPU provider only (runtime/row_invariance.py); other providers' kernels: not padded
        cpu = PROVIDER_DEVICE.get(first_provider(self.providers)) == "cpu"
        body, head = nbits_rules(bundle, self.target_config.layers, threads) if row_invariant and cpu else (None, None)
        # attention's pad row, unless every call has two tokens already: one row a call, whose body rule pads a
        # one-token call (2026-12-07: the pad's 200 Slice / Concat nodes were 5% of the int4 decode step)
        pad_attention = row_invariant and not (self.max_batch == 1 and body in ("two", "pairs"))
        t_model, self.inplace = self._inplace_target(t_path, kv_mode, pad_attention)
        self.kv_mode = "inplace" if self.inplace else (kv_mode or "gather")  # the drafter's: gather or full
        t_head = rewrite_head(t_path, cut=True, model=t_model) if self.shared is not None else None
        d_head = rewrite_head(d_path, cut=True) if t_head is not None else None
        shared_head = (d_head is not None and self.shared.pairs.get(d_head.weight) == t_head.weight
                       and (head_session_pays(t_head) if lm_head_session is None else lm_head_session))
        self.head = None
        if shared_head:
            self.head = LmHead(t_path, t_head.weight, _session_options(threads, session_options), self.providers,
                               self.device)
        else:
            t_head = rewrite_head(t_path, cut=False, model=t_model)
            d_head = rewrite_head(d_path, cut=False) if d_path else None
        try:
            self.tgraph = _Graph(t_path, _session_options(threads, session_options), self.providers, "target",
                                 self.shared.target if self.shared else None, t_head, self.device)
        except RetraceError:
            if self.inplace is None or kv_mode == "inplace":
                raise
            # an ONNX Runtime without this form of GroupQueryAttention (older than the one tested): the graph
            # as exported, with the gather path
            self.inplace, self.kv_mode = None, "gather"
            t_head = rewrite_head(t_path, cut=self.head is not None)
            self.tgraph = _Graph(t_path, _session_options(threads, session_options), self.providers, "target",
                                 self.shared.target if self.shared else None, t_head, self.device)
        self.draft_vocab = bundle_draft_vocab(bundle, self.target_config.vocab_size) if (
            draft_vocab and self.drafter_config is not None) else None
        self.draft_head = self._draft_table = None
        # [Vd] the target ids the draft logits are over (runtime/draft_space.py); None: the whole vocabulary
        self.draft_ids = None if self.draft_vocab is None else self.draft_vocab.ids.to(self.device)
        if self.draft_vocab is not None:
            d_head = self._draft_vocab_head(d_path, threads, session_options) or d_head
        self._dgraph = self._dcache = None
        self._drafter_head = (d_head, threads, session_options)
        self.threads = threads
        self.cover = SlotCover(self.max_batch)
        self.widths = None if body is None else RowWidths(
            tokens=stricter(body, "any" if self.inplace is not None and self.inplace.pad else "two"), rows=head)

        dtype = self.tgraph.dtype("past_key_0")
        tc = self.target_config.layers
        self.tcache = _Cache(tc.num_hidden_layers, self.max_batch, tc.num_key_value_heads, self.max_seq_len + SPARE,
                             tc.head_dim, dtype, self.device)
        self._views: dict[tuple[int, int], tuple[dict, dict]] = {}  # _kv_views, per slot range
        self._taps_width = len(tm.get("tap_layers") or ()) * tc.hidden_size
        if not lazy_drafter:
            self.open_drafter()
        file_pages.after_load(bundle.root)  # the weight files' pages read while loading, the code it ran

    def open_drafter(self) -> _Graph | None:
        """The drafter's session and K/V cache, made once (at load, or at the first draft call with
        lazy_drafter); None for a bundle without a drafter."""
        if self._dgraph is None and self.drafter_config is not None:
            d_head, threads, session_options = self._drafter_head
            g = _Graph(self.bundle.graph_path("drafter"), _session_options(threads, session_options),
                       self.providers, "drafter", self.shared.drafter if self.shared else None, d_head, self.device)
            self._suffix_inputs = "valid" in g.inputs
            if self._suffix_inputs:
                feats = next(i for i in g.sess.get_inputs() if i.name == "features")
                self._num_features = int(feats.shape[-1])
            dc = self.drafter_config.layers
            self._dcache = _Cache(dc.num_hidden_layers, self.max_batch, dc.num_key_value_heads, self.max_seq_len,
                                  dc.head_dim, g.dtype("past_key_0"), self.device)
            self._dgraph = g
            file_pages.after_load(self.bundle.root)  # the drafter file's pages read while prepacking
        return self._dgraph

    @property
    def dgraph(self) -> _Graph | None:
        return self.open_drafter()

    @property
    def dcache(self) -> _Cache | None:
        self.open_drafter()
        return self._dcache

    def _draft_vocab_head(self, d_path: Path, threads, session_options) -> HeadGraph | None:
        """The drafter graph with its head cut off, and self.draft_head: a session over the draft vocabulary's
        rows of the table; None (the full head, restricted) for a graph without the exported head."""
        head = rewrite_head(d_path, cut=True)
        if head is None:
            return None
        self._draft_table = (d_path, head.weight)
        self._head_options = (threads, session_options)
        self.use_draft_vocab(self.draft_vocab)
        return head

    def use_draft_vocab(self, vocab: DraftVocab | None) -> None:
        """Draft over `vocab` from now on (None: the full head), e.g. to compare sizes on one loaded bundle;
        needs a backend loaded with a draft vocabulary (the drafter graph's head cut off)."""
        if self._draft_table is None:
            raise RetraceError("use_draft_vocab needs a backend opened on a bundle with a draft vocabulary")
        if vocab is not None and vocab.target_vocab_size != self.target_config.vocab_size:
            raise RetraceError(f"the draft vocabulary is over {vocab.target_vocab_size} ids, the target's over "
                               f"{self.target_config.vocab_size}")
        d_path, weight = self._draft_table
        V, head = self.target_config.vocab_size, None
        if vocab is not None or self.head is None:  # else the full head runs in the target's LM head session
            rows, options = np.arange(V) if vocab is None else vocab.ids.numpy(), _session_options(*self._head_options)
            # an int4 / int8 head: MatMulNBits over those rows of the packed table, its scales and zero points
            nbits = nbits_rows_model(d_path, weight, rows, self._draft_array, V)
            if nbits is not None:
                head = LmHead.of_model(nbits, options, self.providers, self.device, "draft vocabulary head")
            else:
                table = self._draft_array(weight)
                if table.shape[0] != V:
                    raise BundleError(f"{d_path}: the drafter's LM head has {table.shape[0]} rows, not the target "
                                      f"vocab's {V}")
                head = LmHead.of_rows(table if vocab is None else table[rows], options, self.providers, self.device)
        self.draft_vocab, self.draft_head = vocab, head
        self.draft_ids = None if vocab is None else vocab.ids.to(self.device)

    def _draft_array(self, name: str) -> np.ndarray:
        """A drafter initializer's values: the target's mapping when it is shared (no second copy read),
        else the drafter graph's own, mapped."""
        t_name = self.shared.pairs.get(name) if self.shared is not None else None
        return self.shared.arrays[t_name] if t_name is not None else map_initializer(self._draft_table[0], name)

    def _inplace_target(self, path: Path, kv_mode: str | None, pad_attention: bool):
        """(the target graph rewritten for in-place K/V, its InplaceKV) or (None, None) where the mode is
        not inplace or (auto mode) the graph does not have the exported attention form."""
        if kv_mode not in (None, "inplace"):
            return None, None
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        first = first_provider(self.providers)
        past = next((i for i in model.graph.input if i.name == "past_key_0"), None)
        dtype = ELEMENT_DTYPE.get(past.type.tensor_type.elem_type) if past is not None else None
        where = PROVIDER_DEVICE.get(first)
        why = (f"the K/V caches live on {self.device.type}, not on {first}'s device" if where != self.device.type
               else f"{first}'s GroupQueryAttention has no {dtype} kernel"
               if dtype not in INPLACE_DTYPES.get(where, ()) else None)
        if why is not None:
            if kv_mode == "inplace":
                raise RetraceError(f"kv_mode='inplace' cannot run here ({why}): use kv_mode='gather'")
            return None, None
        c = self.target_config.layers
        # the rotary inside the operator where its position_ids handling was checked (tree depths): the CPU kernel
        inplace = to_inplace_kv(model, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                max_positions=self.max_seq_len + SPARE if where == "cpu" else None,
                                pad_attention=where == "cpu" and pad_attention)
        if inplace is None and kv_mode == "inplace":
            raise RetraceError(f"{path}: kv_mode='inplace' needs the exported attention form (Concat(past, new) "
                               "-> Attention per layer); this graph has another one: use kv_mode='gather'")
        return (model, inplace) if inplace is not None else (None, None)

    @classmethod
    def from_bundle(cls, bundle_dir: str | Path, max_batch: int | None = None, threads: int | None = None,
                    providers: list | None = None, max_seq_len: int | None = None, verify: bool | None = None,
                    **kwargs) -> OnnxRuntimeBackend:
        """Open (and, unless verify=False or RETRACE_VERIFY_BUNDLE=0, hash-verify) a bundle.

        verify=False still checks that every file exists with its recorded size."""
        if verify is None:
            verify = os.environ.get("RETRACE_VERIFY_BUNDLE", "1").lower() not in ("0", "false", "no")
        return cls(Bundle.open(bundle_dir, verify_hashes=verify), max_batch=max_batch, max_seq_len=max_seq_len,
                   threads=threads, providers=providers, **kwargs)

    @property
    def active_providers(self) -> list[str]:
        return self.tgraph.sess.get_providers()

    # -- Backend protocol ------------------------------------------------------------------------------
    def target(self, slots, input_ids, positions, logits_index, tree_mask=None):
        T, K = input_ids.shape[1], logits_index.shape[1]
        cover = self.cover.plan(host_values(slots), T) if self.inplace else None  # scattered: slot_cover.py
        if cover is not None:
            span, rows = cover
            slots = index_tensor(span, self.device)
            input_ids, positions, logits_index, tree_mask = SlotCover.expand(rows, len(span), input_ids, positions,
                                                                             logits_index, tree_mask)
        if self.widths is not None:  # after the cover: the rules depend on the call's rows
            input_ids, positions, logits_index, tree_mask = self.widths.pad(input_ids, positions, logits_index,
                                                                            tree_mask)
        logits, taps = self._target(slots, input_ids, positions, logits_index, tree_mask)
        if cover is not None:
            logits, taps = logits[rows], taps[rows]
        return (logits if logits.shape[1] == K else logits[:, :K].contiguous(),
                taps if taps.shape[1] == T else taps[:, :T].contiguous())

    def _target(self, slots, input_ids, positions, logits_index, tree_mask):
        g = self.tgraph
        N, T = input_ids.shape
        past_len = positions[:, 0].contiguous()
        takes_mask = "tree_mask" in g.inputs or BIAS in g.inputs  # a tree-mask bundle (in place: as a bias)
        if tree_mask is not None and not takes_mask:
            raise RetraceError("this bundle's target graph has no tree_mask input: rebuild it with "
                               "`retrace-export build --tree-mask` for tree verification, or use --tree-budget 0")
        feeds = {"input_ids": input_ids.to(torch.int64), "position_ids": positions.to(torch.int64),
                 "past_len": past_len.to(torch.int64), "logits_index": logits_index.to(torch.int64)}
        if takes_mask:  # a chain's mask is the causal triangle
            feeds["tree_mask"] = (tree_mask if tree_mask is not None
                                  else torch.ones(T, T, dtype=torch.bool).tril().expand(N, T, T)).to(torch.bool)
        K = logits_index.shape[1]
        dev = self.device
        out = {"taps": torch.empty(N, T, self._taps_width, dtype=g.dtype("taps"), device=dev)}
        if g.rows:
            out[g.rows] = torch.empty(N * K, self.target_config.hidden_size, dtype=g.dtype(g.rows), device=dev)
        else:
            out["logits"] = torch.empty(N, K, self.target_config.vocab_size, dtype=g.dtype("logits"), device=dev)
        if self.inplace:
            self._run_inplace(slots, past_len, T, feeds, out)
        else:
            past = self.tcache.past(slots, int(past_len.max()), self.kv_mode)
            feeds.update(zip(g.past_names, past, strict=True))
            if tree_mask is not None:  # node m's K/V at scratch index positions[:, 0] + m (see commit_path)
                positions = past_len.unsqueeze(1) + torch.arange(T)
            new = self.tcache.new_buffer(N, T)
            out.update(zip(g.new_names, new, strict=True))
            g.run(feeds, out)
            self.tcache.write(slots, positions, new)
        logits = self.head(out[g.rows], (N, K)) if g.rows else out["logits"]
        return logits.cpu(), out["taps"].cpu()  # the rows the loop asked for; no copy on the CPU provider

    def _run_inplace(self, slots, past_len, T: int, feeds: dict, out: dict) -> None:
        """One target call on the in-place graph: the slots' caches bound whole as past and present; the
        new K/V land at [past, past + T) of each row (a tree's nodes at their scratch indices, as above)."""
        g = self.tgraph
        N = slots.numel()
        rows_in = attention_rows(T, self.inplace.pad)  # the operator's rows (a pad row: runtime/row_invariance)
        total = int(past_len.max()) + rows_in
        rows = contiguous_range(slots)
        # scattered slots: their caches up to the call's end gathered into a buffer of that capacity (the
        # operator needs only capacity >= past + T), the new entries written back below
        if rows is None:
            src = self.tcache.kv[:, :, :, :total]
            # a call from position 0 (a prefill's first chunk) reads nothing of its slots' past: no gather
            kv = (src.new_empty(src.shape[0], N, *src.shape[2:]) if total == rows_in
                  else torch.index_select(src, 1, slots.to(self.device)))
            caches = dict(zip(g.past_names, kv, strict=True))
            presents = as_presents(caches)
        else:  # the same view objects every call for these rows: bound once (ort_io_binding.BoundSession)
            caches, presents = self._kv_views(rows)
        feeds.update(seqlens_k=(past_len + (rows_in - 1)).to(torch.int32),
                     query_seqlens=torch.full((N,), rows_in, dtype=torch.int32),
                     total_sequence_length=torch.tensor(total, dtype=torch.int32))
        if BIAS in g.inputs:
            mask = pad_tree_mask(feeds["tree_mask"], rows_in)
            feeds[BIAS] = tree_bias(mask, past_len, total, g.dtype(BIAS))
        feeds.update(caches)
        out.update(presents)
        g.run({k: v for k, v in feeds.items() if k in g.inputs}, out)
        if rows is None:  # write the new entries back into the scattered slots
            for n, (s, p0) in enumerate(zip(slots.tolist(), past_len.tolist(), strict=True)):
                self.tcache.kv[:, s, :, p0:p0 + T] = kv[:, n, :, p0:p0 + T]

    def _kv_views(self, rows: slice) -> tuple[dict, dict]:
        """{past name: the cache of slots `rows`} and the same views under the present names (in place),
        made once per slot range."""
        key = (rows.start, rows.stop)
        if key not in self._views:
            caches = dict(zip(self.tgraph.past_names, self.tcache.kv[:, rows], strict=True))
            self._views[key] = caches, as_presents(caches)
        return self._views[key]

    def draft(self, slots, ctx_taps, ctx_positions, block_ids, block_positions, suffix: SuffixInputs | None):
        g = self.dgraph
        dc = self.drafter_config
        N, B = block_ids.shape
        C = ctx_taps.shape[1]
        past_len = ctx_positions[:, 0].contiguous()
        past = self.dcache.past(slots, int(past_len.max()), self.kv_mode)
        feeds = {"ctx_taps": ctx_taps.to(g.dtype("ctx_taps")), "ctx_positions": ctx_positions.to(torch.int64),
                 "block_ids": block_ids.to(torch.int64), "block_positions": block_positions.to(torch.int64),
                 "past_len": past_len.to(torch.int64)}
        feeds.update(zip(g.past_names, past, strict=True))
        if self._suffix_inputs:
            d = dc.hidden_size
            if suffix is None:  # DFlash mode on a ReTrace graph: valid = 0 makes the fusion the identity
                feeds.update(memory=torch.zeros(N, B, d, dtype=g.dtype("memory")),
                             features=torch.zeros(N, B, self._num_features, dtype=g.dtype("features")),
                             valid=torch.zeros(N, B, dtype=g.dtype("valid")),
                             corr_index=torch.zeros(N, B, dtype=torch.int64))
            else:
                feeds.update(memory=suffix.memory.to(g.dtype("memory")),
                             features=suffix.features.to(g.dtype("features")),
                             valid=suffix.valid.to(g.dtype("valid")),
                             corr_index=suffix.corr_index.to(torch.int64).clamp(0, C - 1))
        c, dev = dc.layers, self.device
        out = {"hidden": torch.empty(N, B, c.hidden_size, dtype=g.dtype("hidden"), device=dev)}
        if g.rows:
            out[g.rows] = torch.empty(N * (B - 1), dc.hidden_size, dtype=g.dtype(g.rows), device=dev)
        else:
            out["logits"] = torch.empty(N, B - 1, dc.vocab_size, dtype=g.dtype("logits"), device=dev)
        new = self.dcache.new_buffer(N, C)
        out.update(zip(g.new_names, new, strict=True))
        g.run(feeds, out)
        self.dcache.write(slots, ctx_positions, new)
        hidden = out["hidden"].cpu()
        if self.draft_head is not None:  # over the draft vocabulary when there is one (draft_ids)
            logits = self.draft_head(out[g.rows], (N, B - 1))
        elif self.draft_vocab is not None:  # a drafter graph whose head could not be cut off
            logits = out["logits"].index_select(-1, self.draft_ids)
        else:
            logits = self.head(out[g.rows], (N, B - 1)) if g.rows else out["logits"]
        return (hidden if hidden.dtype == torch.float32 else hidden.float()), logits.cpu()

    def commit_path(self, slots, src_index, dst_pos) -> None:
        kv = self.tcache.kv
        rows, src, dst = (t.to(kv.device) for t in (slots[:, None], src_index, dst_pos))
        kv[:, rows, :, dst] = kv[:, rows, :, src]

    def release(self, slot: int) -> None:
        self.cover.release(slot)  # positions mask stale cache entries; nothing to clear


def as_presents(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{past_<x>: t} -> {present_<x>: t}: the in-place graph writes each layer's new K/V into its past buffer."""
    return {"present_" + name[len("past_"):]: t for name, t in caches.items()}


def nbits_rules(bundle: Bundle, layers, threads: int | None) -> tuple[str, str]:
    """What the target's kernels need for row-invariant calls on this CPU (retrace.runtime.row_invariance), as
    (body, head): the body's MatMulNBits (depths: hidden, attention output, MLP) and the LM head's (depth:
    hidden). A w8a8 bundle's integer matmuls are exact in any row count (retrace.export.w8a8). Attention's
    one-token path is the in-place graph's pad row, or the tokens' "two" without it (the backend's widths)."""
    q = bundle.manifest.get("quantization") or {}
    if not q or q.get("weights") == "w8a8":
        return "any", "any"
    bits, level, block = q.get("bits", 4), q.get("accuracy_level"), q.get("block_size")
    depths = (layers.hidden_size, layers.num_attention_heads * layers.head_dim, layers.intermediate_size)
    body = nbits_rule(block, level, bits, depths, threads)
    head = (nbits_rule(q.get("lm_head_block_size", block), level, bits, (layers.hidden_size,), threads)
            if q.get("lm_head") else "any")
    return body, head


def head_session_pays(head: HeadGraph) -> bool:
    """The default for a shared LM head: its own session for a float table of LM_HEAD_SESSION_MIN_BYTES or
    more (a packed float copy per session is the table again: 0.6B shape, peak RSS 4.22 vs 3.00 GB). A
    MatMulNBits head stays in each graph: one session run per target / draft call instead of two, for a
    packed copy per session (0.6B shape int4: peak RSS 0.89 vs 0.72 GB, 1.05x onnxruntime-genai int4's);
    ONNX Runtime's Python API has no prepacked-weights container to share one packed copy between sessions,
    and an unpacked MatMulNBits dequantizes all of B per call (docs/quantization.md)."""
    return not head.nbits and head.weight_bytes >= LM_HEAD_SESSION_MIN_BYTES


def bundle_draft_vocab(bundle: Bundle, vocab_size: int) -> DraftVocab | None:
    """The draft vocabulary the manifest lists (models.drafter.draft_vocab), validated; None without one."""
    entry = (bundle.model("drafter") or {}).get("draft_vocab")
    if not entry:
        return None
    where = bundle.root / "manifest.json"
    if not isinstance(entry, dict) or not _inside(bundle.root, entry.get("dir")):
        raise BundleError(f"{where}: models.drafter.draft_vocab must name the folder of its files ('dir', inside "
                          "the bundle)")
    vocab = DraftVocab.load(bundle.root / entry["dir"], vocab_size)
    if vocab is None:
        raise BundleError(f"{bundle.root / entry['dir']}: the draft vocabulary the manifest lists is missing")
    return vocab


def _session_options(threads: int | None, entries: dict | None):
    """Fresh SessionOptions per session (shared initializers are added to each separately)."""
    ort = _ort()
    so = ort.SessionOptions()
    so.intra_op_num_threads = int(threads or 0)
    so.inter_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    spinning = spinning_entries()  # bounded spinning, stopped when a run returns (runtime/ort_spinning.py)
    for k, v in {**spinning, **(entries or {})}.items():
        so.add_session_config_entry(k, str(v))
    return so


def _limit(name: str, asked: int | None, built: int | None, root: Path) -> int:
    if asked is None:
        if built is None:
            raise BundleError(f"{root}: manifest has no limits.{name}")
        return int(built)
    asked = int(asked)
    if asked < 1:
        raise RetraceError(f"{name} must be >= 1, got {asked}")
    if built is not None and asked > int(built):
        raise RetraceError(f"{name}={asked} exceeds the bundle's limit {built} (rebuild with "
                           f"retrace-export build --{name.replace('_', '-')} {asked})")
    return asked
