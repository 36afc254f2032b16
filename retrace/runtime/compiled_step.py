"""The torch backend's step functions under torch.compile (`retrace generate --compile`).

The target's step and the drafter's block step (models/cached_step.py) are compiled with `fullgraph=True`
(a graph break is an error, never a silent fallback to Python) and dynamic shapes (the batch, the verify
width, the drafter's context length and the cache window, a bucket of the past, vary: one graph serves
them). The steps write the caches in place: an index write into the slots' rows, passed whole, which
inductor keeps in place (a write into a narrower window view was copied back whole per call: models/
cached_step.py).
If the compiler itself fails (no C++ toolchain, an unsupported op on this build), the step falls back to
eager once, with a warning, and stays eager.

Each step is compiled as its own function (a `partial`'s function with its bound arguments passed at each
call): dynamo keeps one cache of graphs per code object, at most `recompile_limit` (8) entries, and compiled
`partial`s all share one wrapper's code object, so the four steps shared 8 graphs and a runtime that needed
more ran eagerly from then on, silently. And each argument keeps the kind of tensor (inference tensor or
not) of its first call: dynamo guards on it, and the runtime's inputs are one or the other depending on where
they were made (inside a backend's `torch.inference_mode` or in the loop); a change of kind recompiled the
step (2 of the 8 compiles of tests/test_runtime_compile.py's inductor test).

On the CPU inductor compiles with `freezing` (the weights are constants of the graph: inductor prepacks each
linear layer's weight for oneDNN/MKL): at the Qwen3-0.6B shape the 168 projections of a 2-16 row step run
2.5-4x faster than through `F.linear` (docs/static-cache.md), at the price of a packed copy of the
projection weights per compiled step and a longer first compile. The weights must not change after the first
call (a runtime's do not); `freeze=False` (RETRACE_COMPILE_FREEZING=0) compiles without it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from functools import partial

import torch
import torch.fx.experimental._config
from torch import nn

COMPILERS = ("inductor", "aot_eager", "eager")  # inductor: generated kernels; the others check the trace only


class CompiledStep:
    def __init__(self, module: nn.Module | Callable, what: str, compiler: str = "inductor", freeze: bool = False):
        """freeze: inductor's `freezing` (weights as prepacked constants; for CPU steps, see above)."""
        if compiler not in COMPILERS:
            raise ValueError(f"compiler {compiler!r}: choose from {', '.join(COMPILERS)}")
        self.module, self.what = module, what
        self.freeze = freeze and compiler == "inductor" and os.environ.get("RETRACE_COMPILE_FREEZING", "1") != "0"
        fn, self.bound, self.bound_kw = ((module.func, module.args, module.keywords) if isinstance(module, partial)
                                         else (module, (), {}))
        self.compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=compiler)
        self.fallback = False
        self.kinds: list | None = None  # per argument: is_inference() of its first call's tensors

    def __call__(self, *args, **kwargs):
        if self.fallback:
            return self.module(*args, **kwargs)
        try:
            return self._run(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:  # the compiler, not the model, failed
            warnings.warn(f"torch.compile of the {self.what} step failed ({type(e.__cause__ or e).__name__}); "
                          "running it eagerly", RuntimeWarning, stacklevel=2)
            self.fallback = True
            return self.module(*args, **kwargs)

    def _run(self, *args, **kwargs):
        args = self._same_kinds(args)
        # read when a call compiles (or recompiles), not from torch.compile's options=: set around every call (a
        # plain attribute swap, ~6 us; `config.patch` costs ~20 us per call here). freezing: see above. No duck
        # sizing: dynamo would otherwise tie sizes that are equal by chance at the first compile (a verify
        # width of 8 and Qwen3's 8 K/V heads, a 128-column window and the head dimension) and recompile when
        # they part. Floats specialised: under dynamic=True every float attribute the steps read (each RMSNorm's
        # eps, the embedding's norm_type) became a symbol that inductor's scalar pass then specialised anyway by
        # restarting the whole trace: two traces and a half-finished compile per step, ~10 s of a ~78 s first
        # compile at the test's pair (docs/static-cache.md; they are model constants, no step takes a float
        # that varies)
        cfg, fx, dyn = torch._inductor.config, torch.fx.experimental._config, torch._dynamo.config
        old = cfg.freezing, fx.use_duck_shape, dyn.specialize_float
        cfg.freezing, fx.use_duck_shape, dyn.specialize_float = self.freeze or old[0], False, True
        try:
            return self.compiled(*self.bound, *args, **self.bound_kw, **kwargs)
        finally:
            cfg.freezing, fx.use_duck_shape, dyn.specialize_float = old

    def _same_kinds(self, args: tuple) -> tuple:
        """args with each tensor (top level, or in a tuple or list argument) of the kind it had at the first
        call: a copy made in or out of inference mode where it differs (small index tensors in practice)."""
        kinds = [_kinds(a) for a in args]
        if self.kinds is None:
            self.kinds = kinds
        if kinds == self.kinds:
            return args
        first = (self.kinds + [None] * len(args))[:len(args)]
        return tuple(_as_kind(a, want) for a, want in zip(args, first, strict=True))


def _kinds(arg):
    if isinstance(arg, torch.Tensor):
        return arg.is_inference()
    if isinstance(arg, (tuple, list)):
        return tuple(_kinds(a) for a in arg)
    return None


def _as_kind(arg, want):
    if isinstance(arg, torch.Tensor):
        if want is None or arg.is_inference() == want:
            return arg
        with torch.inference_mode(want):
            return arg.clone()
    if isinstance(arg, (tuple, list)) and isinstance(want, tuple) and len(want) == len(arg):
        items = [_as_kind(a, w) for a, w in zip(arg, want, strict=True)]
        return type(arg)(*items) if hasattr(arg, "_fields") else type(arg)(items)
    return arg


class TwoRowDecode(CompiledStep):
    """The compiled target step (CPU, frozen) whose one-token, one-row calls run as two identical rows.

    dynamo specialises a size of 1, so a batch-1 decode compiles to its own graph, and inductor's frozen
    one-row linear layers take a slower path than two rows do (the Qwen3-0.6B projection stack: 82 ms at one
    row, 54-65 at two, docs/static-cache.md). The second row repeats the token at the same position: both rows
    write the same K/V into the same cache column and see the same columns, so row 0's logits are the call's,
    and the decode shares the graph (and the kernels) of the multi-row calls. Arguments: `target_step`'s after
    its bound ones (input_ids, positions, k_window, v_window, logits_index, tree_mask, width)."""

    def _run(self, input_ids, positions, k_window, v_window, logits_index, tree_mask=None, width=None):
        if not self.freeze or input_ids.shape != (1, 1) or tree_mask is not None:
            return super()._run(input_ids, positions, k_window, v_window, logits_index, tree_mask, width)
        logits, taps = super()._run(input_ids.repeat(1, 2), positions.repeat(1, 2), k_window, v_window,
                                    logits_index, None, width)
        return logits, taps[:, :1]
