"""retrace.bench: ReTrace against its peers (transformers, transformers' DFlash, onnxruntime-genai) in one
run: interleaved timing, acceptance, fidelity, agreement of greedy outputs, JSON, plots, README table."""

from retrace.bench.config import BenchConfig
from retrace.bench.report import render_markdown
from retrace.bench.runner import run_and_report, run_bench

__all__ = ["BenchConfig", "run_bench", "run_and_report", "render_markdown"]
