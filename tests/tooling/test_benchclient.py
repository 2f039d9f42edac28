"""The load generator's bookkeeping for the overload benchmark: refusals with and without
Retry-After, and the goodput / refusal figures of one run (no server, no timing)."""

from __future__ import annotations

import numpy as np

from visionserve_tools.benchclient import report, wire
from visionserve_tools.benchclient.generator import Result


def test_a_503_without_retry_after_is_told_apart():
    assert wire.parse_inspect(503, b'{"error": "x"}', {"retry-after": "1"}).outcome == wire.REJECTED
    assert wire.parse_inspect(503, b'{"error": "x"}', {}).outcome == wire.REJECTED_BARE
    assert wire.parse_inspect(503, b'{"error": "x"}').outcome == wire.REJECTED  # headers unknown
    assert wire.parse_oip(429, {"content-type": "text/plain"}, b"busy").outcome == wire.REJECTED_BARE
    assert wire.parse_inspect(504, b'{"verdict": "LATE"}', {}).outcome == wire.LATE
    assert wire.OUTCOMES[wire.REJECTED_BARE] == "rejected_no_retry_after"


def result(rows: list[tuple[float, int, float]]) -> Result:
    """rows: (scheduled s, outcome, latency ms or -1)."""
    n = len(rows)
    return Result(sched_ns=np.array([int(t * 1e9) for t, _, _ in rows], dtype=np.int64),
                  lag_ns=np.zeros(n, dtype=np.int64),
                  latency_ns=np.array([int(ms * 1e6) if ms >= 0 else -1 for _, _, ms in rows], dtype=np.int64),
                  outcome=np.array([o for _, o, _ in rows], dtype=np.int8), verdict=np.zeros(n, dtype=np.int8),
                  batch=np.zeros(n, dtype=np.int32), frame=np.zeros(n, dtype=np.int32),
                  score=np.zeros(n), labels=[""] * n, cpu_s=0.0, details={})


def test_overload_summary_counts_goodput_refusals_and_late():
    res = result([
        (0.1, wire.OK, 50.0),                 # warm-up: not counted
        (1.0, wire.OK, 50.0), (1.1, wire.OK, 199.0),   # in time
        (1.2, wire.OK, 250.0),                # answered, but after the deadline at the client
        (1.3, wire.LATE_ANSWER, 210.0), (1.4, wire.LATE, 200.0),
        (1.5, wire.REJECTED, 1.0), (1.6, wire.REJECTED, 3.0), (1.7, wire.REJECTED_BARE, 2.0),
        (1.8, wire.TIMEOUT, -1),
    ])
    o = report.overload_summary(res, warmup_s=0.5, window_s=2.0, deadline_ms=200.0)
    assert o["sent"] == 9 and o["offered_fps"] == 4.5
    assert o["in_time"] == 2 and o["goodput_fps"] == 1.0
    assert o["late"] == 3
    assert (o["refused_with_retry_after"], o["refused_without_retry_after"]) == (2, 1)
    assert o["other"] == 1
    assert o["refused_share"] == round(3 / 9, 4)
    assert o["refusal_latency_ms"]["max"] == 3.0


def test_error_reasons_group_by_status_and_message_without_its_numbers():
    """The benchmarks break non-200 answers down by ``error_reason``: one reason per cause,
    whatever the figures in its message; names with digits in them stay whole."""
    a = wire.error_reason(503, b'{"error": "queue of model rn50 is full (1024 frames, 3.5 ms)"}')
    b = wire.error_reason(503, b'{"error": "queue of model rn50 is full (512 frames, 12 ms)"}')
    assert a == b == "503 queue of model rn50 is full (N frames, N ms)"
    assert wire.error_reason(502, b"<html>Bad Gateway</html>") == "502 <html>Bad Gateway</html>"
    assert wire.error_reason(500, b"") == "500"
