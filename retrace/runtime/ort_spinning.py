"""How ONNX Runtime's intra-op workers wait between the parallel kernels of a run (the CPU provider).

A step of the 0.6B-shape int4 target runs ~300 parallel kernels of 30-150 us each. Workers that block between
them pay a futex wake per kernel; workers that spin unboundedly take the cores from the loop's own work between
runs and from everything else on a shared machine. The default is in between:

- spin, but at most `RETRACE_ORT_SPIN_US` microseconds (default 50: `session.intra_op.spin_duration_us`), then
  block; the gaps between a run's kernels are a few microseconds, so the spin catches them;
- stop spinning when a run returns (`session.force_spinning_stop`): the loop's torch work between runs keeps
  its core.

`RETRACE_ORT_SPINNING=0` blocks always (the default until 2026-12-03); `RETRACE_ORT_SPIN_US=0` spins for ONNX
Runtime's own duration. Measured in docs/onnxruntime-backend.md, "Spinning".
"""

from __future__ import annotations

import os

from retrace.errors import RetraceError

DEFAULT_SPIN_US = 50


def spinning_entries(environ=os.environ) -> dict[str, str]:
    """The session config entries for the workers' wait policy, from RETRACE_ORT_SPINNING / RETRACE_ORT_SPIN_US."""
    spin = environ.get("RETRACE_ORT_SPINNING", "1").strip().lower()
    if spin in ("0", "false", "no", "off"):
        return {"session.intra_op.allow_spinning": "0"}
    if spin not in ("1", "true", "yes", "on"):
        raise RetraceError(f"RETRACE_ORT_SPINNING={spin!r}: use 1 (spin, bounded by RETRACE_ORT_SPIN_US) or 0")
    raw = environ.get("RETRACE_ORT_SPIN_US", str(DEFAULT_SPIN_US)).strip()
    if not raw.isdigit():
        raise RetraceError(f"RETRACE_ORT_SPIN_US={raw!r}: a whole number of microseconds (0: ONNX Runtime's own)")
    entries = {"session.intra_op.allow_spinning": "1", "session.force_spinning_stop": "1"}
    if int(raw):
        entries["session.intra_op.spin_duration_us"] = str(int(raw))
    return entries
