"""Prometheus metrics (``/metrics``). Names are the public contract: dashboards and the HPA use
them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: the model label of requests for a model that is not served: the name is the client's string,
#: and a label per string would let any client grow /metrics without bound (a served model's
#: name starts with a letter or digit, so it cannot be this)
UNKNOWN_MODEL = "_unknown"

REQUESTS = Counter(
    "visionserve_requests",
    "Inference requests (inspect, OIP HTTP and gRPC, each stream request), each once, by "
    "its answer: success, invalid_input (400), not_found (404), request_timeout (408), "
    "too_large (413), unsupported_media_type (415), unavailable (503), deadline (504, "
    f"LATE), internal (500); model {UNKNOWN_MODEL} for a model that is not served",
    ["model", "outcome"])
FRAMES = Counter(
    "visionserve_frames",
    "Frames given to the engine, each once, by verdict (OK, NG) or outcome: late (504, "
    "LATE), rejected (503), invalid (400), error (500); a request refused before it "
    "reaches the engine (bad body, unknown model, media type, size) is in "
    "visionserve_requests only", ["model", "outcome"])
#: a failed request's frames, by its error's kind (any other kind: "error")
FRAME_OUTCOMES = {"deadline": "late", "unavailable": "rejected", "invalid_input": "invalid",
                  "too_large": "invalid", "unsupported_media_type": "invalid",
                  "not_found": "invalid", "request_timeout": "invalid"}
REQUEST_SECONDS = Histogram("visionserve_request_duration_seconds",
                            "Arrival to answer, per frame", ["model"], buckets=_LATENCY_BUCKETS)
QUEUE_SECONDS = Histogram("visionserve_queue_duration_seconds",
                          "Arrival to dispatch, per frame", ["model"], buckets=_LATENCY_BUCKETS)
COMPUTE_SECONDS = Histogram("visionserve_compute_duration_seconds",
                            "Decode + model + postprocess, per batch", ["model"],
                            buckets=_LATENCY_BUCKETS)
BATCH_SIZE = Histogram("visionserve_batch_size", "Frames per executed batch", ["model"],
                       buckets=_BATCH_BUCKETS)
QUEUE_DEPTH = Gauge("visionserve_queue_depth", "Frames waiting in the batcher (read when scraped)",
                    ["model"])
INFLIGHT = Gauge("visionserve_inflight_batches", "Batches being decoded or computed", ["model"])
DEADLINE_MISSES = Counter(
    "visionserve_deadline_misses",
    "Frames answered LATE (504): the deadline passed in the queue, during decode "
    "or compute, or at the front end", ["model"])
READY = Gauge("visionserve_model_ready", "1 when the model version is ready", ["model", "version"])
FRONTENDS_ALIVE = Gauge("visionserve_frontends_alive",
                        "Front-end processes running (--frontends; absent without them)")
BATCH_WORKERS_ALIVE = Gauge("visionserve_batch_workers_alive",
                            "Worker processes running that prepare (and with "
                            "--gpu-batch-processes run) batches, all model instances together")


class ModelSeries:
    """One model's labelled series, looked up once: ``labels()`` costs microseconds per call, and
    the engine would call it several times for every frame."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.success = REQUESTS.labels(model, "success")
        self.request_seconds = REQUEST_SECONDS.labels(model)
        self.queue_seconds = QUEUE_SECONDS.labels(model)
        self.compute_seconds = COMPUTE_SECONDS.labels(model)
        self.batch_size = BATCH_SIZE.labels(model)
        self.queue_depth = QUEUE_DEPTH.labels(model)
        self._frames: dict[str, object] = {}

    def frames(self, outcome: str):
        child = self._frames.get(outcome)
        if child is None:
            child = self._frames[outcome] = FRAMES.labels(self.model, outcome)
        return child
