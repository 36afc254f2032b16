"""The serving acceptance metrics (retrace/runtime/serving_metrics.py) as Triton custom metrics.

The python backend's ``pb_utils.MetricFamily`` (tritonserver 2.51: COUNTER, GAUGE and HISTOGRAM) puts them
on Triton's own metrics endpoint (``:8002/metrics``), beside ``nv_inference_*``, with the same names,
labels and meaning as ``ServingMetrics.prometheus_text`` (``retrace serve``): counters per ``mode``
(``retrace_requests_total`` also per ``finish_reason``) and histograms of the accepted and verified
drafts per round, one bucket per length 0..block size.
"""

from __future__ import annotations

import threading
from typing import Any

from retrace.runtime.serving_metrics import COUNTERS, HISTOGRAMS, request_counts


class TritonMetrics:
    """Increments Triton metrics once per finished request (``observe``), from its final stats dict."""

    def __init__(self, pb_utils: Any, max_length: int) -> None:
        mf = pb_utils.MetricFamily
        self.buckets = [float(v) for v in range(max_length + 1)]
        self._families = {key: mf(name=name, description=doc, kind=mf.COUNTER) for key, (name, doc) in COUNTERS.items()}
        self._families.update({key: mf(name=name, description=doc, kind=mf.HISTOGRAM)
                               for key, (name, doc) in HISTOGRAMS.items()})
        self._metrics: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    def _metric(self, key: str, labels: dict[str, str]) -> Any:
        ident = (key, *sorted(labels.items()))
        m = self._metrics.get(ident)
        if m is None:
            fam = self._families[key]
            m = fam.Metric(labels=labels, buckets=self.buckets) if key in HISTOGRAMS else fam.Metric(labels=labels)
            self._metrics[ident] = m
        return m

    def observe(self, mode: str, stats: dict, finish_reason: str | None = None) -> None:
        counts = request_counts(stats)
        with self._lock:
            for key, n in counts.items():
                labels = ({"mode": mode, "finish_reason": finish_reason or "unknown"} if key == "requests"
                          else {"mode": mode})
                self._metric(key, labels).increment(n)
            for key in HISTOGRAMS:
                hist = stats.get(key) or []
                if hist:
                    m = self._metric(key, {"mode": mode})
                    for value, n in enumerate(hist):
                        for _ in range(int(n)):
                            m.observe(float(value))

    def close(self) -> None:
        """Metrics before their families (pb_utils requires that order)."""
        with self._lock:
            self._metrics.clear()
            self._families.clear()
