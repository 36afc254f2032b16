"""Acceptance metrics of a serving process: one set for every server (the Triton model and `retrace serve`).

A server calls :meth:`ServingMetrics.observe` once per finished request with its mode and its stats dict
(``Request.result()["stats"]``, i.e. :meth:`AcceptStats.to_dict`). The totals are read as plain numbers
(:meth:`snapshot`), as Prometheus text (:meth:`prometheus_text`, for an HTTP ``/metrics``), or mirrored
into another metrics system by name (:data:`COUNTERS`, :data:`HISTOGRAMS`, e.g. Triton's ``pb_utils``).

Per mode (label ``mode``):
  retrace_requests_total          finished requests (label ``finish_reason`` too)
  retrace_rounds_total            draft/verify rounds (a round of `ar` or without a draft counts too)
  retrace_output_tokens_total     committed tokens
  retrace_draft_tokens_total      draft slots the drafter filled
  retrace_verified_tokens_total   drafts sent to the target to verify (the verify policy's K per round)
  retrace_accepted_tokens_total   drafts the target accepted (bonus tokens not counted)
  retrace_accepted_length         histogram of accepted drafts per round (tau - 1 per round)
  retrace_verify_length           histogram of verified drafts per round (the chosen K)
  retrace_time_to_first_token_seconds    histogram over requests: from `add` to the first token (queueing and
                                         prefill; long prompts in chunks: docs/serving.md)
  retrace_time_per_output_token_seconds  histogram over requests: mean time between tokens after the first
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass, field

COUNTERS = {
    "requests": ("retrace_requests_total", "Finished requests"),
    "rounds": ("retrace_rounds_total", "Draft/verify rounds"),
    "tokens": ("retrace_output_tokens_total", "Committed output tokens"),
    "drafted": ("retrace_draft_tokens_total", "Draft slots filled by the drafter"),
    "verified": ("retrace_verified_tokens_total", "Drafts sent to the target for verification"),
    "accepted": ("retrace_accepted_tokens_total", "Drafts accepted by the target (bonus tokens not counted)"),
}
HISTOGRAMS = {
    "accepted_hist": ("retrace_accepted_length", "Accepted drafts per round"),
    "verify_hist": ("retrace_verify_length", "Drafts verified per round"),
}

LATENCIES = {  # stats key -> (metric name, help): seconds per request, in LATENCY_BUCKETS
    "ttft_s": ("retrace_time_to_first_token_seconds", "Time from a request's arrival to its first token"),
    "tpot_s": ("retrace_time_per_output_token_seconds", "Mean time between a request's tokens after its first"),
}
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)  # upper bounds, s


@dataclass
class _ModeTotals:
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    finish_reasons: dict[str, int] = field(default_factory=dict)
    hists: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in HISTOGRAMS})
    # per latency: requests in each LATENCY_BUCKETS bucket (not cumulative; the last one: above them all), the sum
    latency: dict[str, list[int]] = field(default_factory=lambda: {k: [0] * (len(LATENCY_BUCKETS) + 1)
                                                                     for k in LATENCIES})
    latency_sum: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LATENCIES, 0.0))


def request_counts(stats: dict) -> dict[str, int]:
    """The counter increments of one finished request, from its stats dict."""
    acc, ver = stats.get("accepted_hist") or [], stats.get("verify_hist") or []
    return {
        "requests": 1,
        "rounds": int(stats.get("rounds") or 0),
        "tokens": int(stats.get("tokens") or 0),
        "drafted": int(stats.get("drafted") or 0),
        "verified": sum(k * n for k, n in enumerate(ver)),
        "accepted": sum(a * n for a, n in enumerate(acc)),
    }


class ServingMetrics:
    """Thread-safe totals over finished requests, per mode."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._modes: dict[str, _ModeTotals] = {}

    def observe(self, mode: str, stats: dict, finish_reason: str | None = None) -> None:
        counts = request_counts(stats)
        with self._lock:
            t = self._modes.setdefault(mode, _ModeTotals())
            for k, v in counts.items():
                t.counters[k] += v
            reason = finish_reason or "unknown"
            t.finish_reasons[reason] = t.finish_reasons.get(reason, 0) + 1
            for key in HISTOGRAMS:
                for i, n in enumerate(stats.get(key) or []):
                    h = t.hists[key]
                    if i >= len(h):
                        h.extend([0] * (i + 1 - len(h)))
                    h[i] += n
            for key in LATENCIES:
                if (v := stats.get(key)) is not None:
                    t.latency[key][bisect.bisect_left(LATENCY_BUCKETS, v)] += 1
                    t.latency_sum[key] += v

    def snapshot(self) -> dict[str, dict]:
        """{mode: {"requests": .., "rounds": .., ..., "finish_reasons": {..}, "accepted_hist": [..], ...}}"""
        with self._lock:
            return {m: {**t.counters, "finish_reasons": dict(t.finish_reasons),
                        **{k: list(v) for k, v in t.hists.items()},
                        **{k: {"counts": list(t.latency[k]), "sum": t.latency_sum[k]} for k in LATENCIES}}
                    for m, t in self._modes.items()}

    def prometheus_text(self) -> bytes:
        """The totals in Prometheus' text exposition format (prometheus_client renders it)."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)


class _Collector:
    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        snap = self.metrics.snapshot()
        for key, (name, doc) in COUNTERS.items():
            labels = ["mode", "finish_reason"] if key == "requests" else ["mode"]
            fam = CounterMetricFamily(name.removesuffix("_total"), doc, labels=labels)
            for mode, s in snap.items():
                if key == "requests":
                    for reason, n in sorted(s["finish_reasons"].items()):
                        fam.add_metric([mode, reason], n)
                else:
                    fam.add_metric([mode], s[key])
            yield fam
        for key, (name, doc) in HISTOGRAMS.items():
            fam = HistogramMetricFamily(name, doc, labels=["mode"])
            for mode, s in snap.items():
                buckets, cum, total = [], 0, 0
                for value, n in enumerate(s[key]):
                    cum += n
                    total += value * n
                    buckets.append((str(float(value)), cum))
                buckets.append(("+Inf", cum))
                fam.add_metric([mode], buckets, sum_value=total)
            yield fam
        bounds = [str(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        for key, (name, doc) in LATENCIES.items():
            fam = HistogramMetricFamily(name, doc, labels=["mode"])
            for mode, s in snap.items():
                cum = list(itertools.accumulate(s[key]["counts"]))
                fam.add_metric([mode], list(zip(bounds, cum, strict=True)), sum_value=s[key]["sum"])
            yield fam
