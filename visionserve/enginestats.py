"""The engine's statistics: each served version's counters in the shape of the statistics
extension (``Served.stats``) and its Prometheus series, kept as batches run and requests are
answered; the requests answered with an error, counted once wherever that was decided; and the
queue gauges read when scraped. Everything here runs on the engine's event loop."""

from __future__ import annotations

import time
from collections.abc import Container, Mapping

from . import metrics
from .dataplane import Duration
from .errors import VisionServeError
from .execution.results import BatchRecord, FrameResult
from .served import Served


def record_batch(served: Served, rec: BatchRecord) -> None:
    """A batch of ``served`` has run (its runners' ``on_batch``)."""
    st = served.stats
    st.execution_count += 1
    for q in rec.queue_s:
        st.queue.add(q)
        served.series.queue_seconds.observe(q)
    st.compute_input.add(rec.prep_s, rec.size)
    st.compute_infer.add(rec.infer_s, rec.size)
    st.compute_output.add(rec.post_s, rec.size)
    bi, bf, bo = st.batch.setdefault(rec.size, (Duration(), Duration(), Duration()))
    bi.add(rec.prep_s)
    bf.add(rec.infer_s)
    bo.add(rec.post_s)
    # deadline passed during decode or compute (metrics: where the request is answered)
    if rec.late:
        st.fail.add(0.0, rec.late)
    m = served.series
    m.batch_size.observe(rec.size)
    m.compute_seconds.observe(rec.prep_s + rec.infer_s + rec.post_s)


def record_drop(served: Served, reason: str) -> None:
    """The batcher of ``served`` dropped a frame (its ``on_drop``)."""
    if reason == "late":  # metrics: where its request is answered (count_error)
        served.stats.fail.add(0.0)


def finish(served: Served, results: list[FrameResult], arrival: float) -> list[FrameResult]:
    """Statistics and metrics of an answered request (each result is in time: a frame whose
    answer was ready after its deadline fails with DeadlineExceeded, see ``count_error``)."""
    now = time.monotonic()
    served.stats.success.add(now - arrival, len(results))
    served.stats.inference_count += len(results)
    served.stats.last_inference_ms = int(time.time() * 1000)
    m = served.series
    m.success.inc()
    for r in results:
        m.frames(r.verdict).inc()
        m.request_seconds.observe(r.total_ms / 1000)
    return list(results)


def count_error(models: Container[str], model: str, exc: VisionServeError | str,
                frames: int = 0) -> None:
    """Count a request answered with an error (``exc``, or its kind), once, wherever that was
    decided: by the engine (``frames``: the request's frames, which it was given), or by a front
    end that refused it before the engine saw it (``frames`` 0), also in a front-end process (the
    hub forwards it). A LATE answer's frames are deadline misses, whichever part of the server
    found the deadline passed. A ``model`` not in ``models`` (the repository's) is counted as
    the unknown model, so that no client can add series."""
    kind = exc if isinstance(exc, str) else exc.kind
    if not isinstance(exc, str):
        exc.counted = True
    if model not in models:
        model = metrics.UNKNOWN_MODEL
    metrics.REQUESTS.labels(model, kind).inc()
    if frames > 0:
        metrics.FRAMES.labels(model, metrics.FRAME_OUTCOMES.get(kind, "error")).inc(frames)
        if kind == "deadline":
            metrics.DEADLINE_MISSES.labels(model).inc(frames)


def waiting(served: Mapping[tuple[str, int], Served], name: str, what: str) -> int:
    """Frames queued (``what`` "queue_depth") or batches running ("inflight") in every served
    version of model ``name``: the gauges' value, read when scraped."""
    return sum(getattr(s.batcher, what) for (n, _), s in list(served.items()) if n == name)


def metrics_text() -> bytes:
    """The Prometheus exposition of every series of this process."""
    from prometheus_client import generate_latest

    return generate_latest()
