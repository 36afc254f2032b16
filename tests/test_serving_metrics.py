"""The serving metrics: totals from real requests' stats, and Prometheus text a parser reads back."""

from prometheus_client.parser import text_string_to_metric_families

from retrace.runtime.serving_metrics import ServingMetrics, request_counts


def _stats(accepted, verified, drafted):
    from retrace.runtime.stats import AcceptStats

    s = AcceptStats()
    for a, k in zip(accepted, verified, strict=True):
        s.record(a, k, drafted)
    s.tokens = sum(a + 1 for a in accepted)
    return s.to_dict()


def test_counts_and_prometheus_text():
    m = ServingMetrics()
    m.observe("retrace", _stats([0, 3, 1], [7, 7, 3], 7), "length")
    m.observe("retrace", _stats([2], [2], 7), "stop")
    m.observe("ar", _stats([0, 0], [0, 0], 0), "length")
    snap = m.snapshot()
    r = snap["retrace"]
    assert (r["requests"], r["rounds"], r["tokens"]) == (2, 4, 10)
    assert (r["drafted"], r["verified"], r["accepted"]) == (28, 19, 6)
    assert r["accepted_hist"] == [1, 1, 1, 1] and r["finish_reasons"] == {"length": 1, "stop": 1}
    assert snap["ar"]["verified"] == 0 and snap["ar"]["rounds"] == 2

    fams = {f.name: f for f in text_string_to_metric_families(m.prometheus_text().decode())}
    acc = {s.labels["mode"]: s.value for s in fams["retrace_accepted_tokens"].samples}
    assert acc == {"retrace": 6, "ar": 0}
    reqs = {(s.labels["mode"], s.labels["finish_reason"]): s.value for s in fams["retrace_requests"].samples}
    assert reqs[("retrace", "stop")] == 1 and reqs[("ar", "length")] == 1
    hist = {(s.name, s.labels.get("le")): s.value for s in fams["retrace_accepted_length"].samples
            if s.labels["mode"] == "retrace"}
    assert hist[("retrace_accepted_length_bucket", "1.0")] == 2  # rounds that accepted <= 1 draft
    assert hist[("retrace_accepted_length_bucket", "+Inf")] == 4
    assert hist[("retrace_accepted_length_sum", None)] == 6


def test_request_counts_from_a_real_run(tiny_pair):
    """drafted/verified/accepted of a real dflash run: accepted <= verified <= drafted."""
    from retrace.runtime.api import Runtime
    from retrace.runtime.sampling import SamplingParams

    pair = tiny_pair()
    rt = Runtime.from_dirs(pair.target_dir, pair.drafter_dir, backend="torch", max_batch=2, verify_policy="fixed")
    res = rt.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_new_tokens=24), mode="dflash")
    for r in res:
        c = request_counts(r.stats)
        assert 0 <= c["accepted"] <= c["verified"] <= c["drafted"]
        assert c["drafted"] > 0 and c["tokens"] == len(r.token_ids)


def test_latency_histograms():
    """Time to first token and time per output token, per request, as Prometheus histograms in seconds; a
    request without them (no token, or one token for the second) is left out of that histogram."""
    m = ServingMetrics()
    for ttft, tpot in ((0.02, 0.03), (0.7, 0.04), (0.7, None), (None, None)):
        m.observe("retrace", {**_stats([0], [0], 0), "ttft_s": ttft, "tpot_s": tpot}, "length")
    snap = m.snapshot()["retrace"]
    assert sum(snap["ttft_s"]["counts"]) == 3 and abs(snap["ttft_s"]["sum"] - 1.42) < 1e-9
    assert sum(snap["tpot_s"]["counts"]) == 2
    fams = {f.name: f for f in text_string_to_metric_families(m.prometheus_text().decode())}
    got = {s.labels.get("le"): s.value for s in fams["retrace_time_to_first_token_seconds"].samples
           if s.name.endswith("_bucket")}
    assert (got["0.01"], got["0.025"], got["0.5"], got["1.0"], got["+Inf"]) == (0, 1, 1, 3, 3)


def test_a_real_request_reports_its_latencies(tiny_pair):
    from retrace.runtime.api import Runtime
    from retrace.runtime.sampling import SamplingParams

    pair = tiny_pair()
    rt = Runtime.from_dirs(pair.target_dir, pair.drafter_dir, backend="torch", max_batch=2)
    one = rt.generate([[5, 6, 7], [9, 10]], SamplingParams(max_new_tokens=1), "dflash")[0]
    many = rt.generate([[5, 6, 7]], SamplingParams(max_new_tokens=12, ignore_eos=True), "dflash")[0]
    assert one.stats["ttft_s"] > 0 and one.stats["tpot_s"] is None
    assert many.stats["ttft_s"] > 0 and 0 < many.stats["tpot_s"] < many.stats["wall_s"]
