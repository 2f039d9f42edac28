"""The cameras' Prometheus series (``/metrics``; names as in :mod:`visionserve.metrics`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
            1.0, 2.0, 5.0)

UP = Gauge("visionserve_camera_up", "1 while the camera is connected, 0 while it is down and "
           "being reconnected", ["camera"])
FRAMES = Counter("visionserve_camera_frames", "Frames acquired from the camera and inspected",
                 ["camera"])
FAULTS = Counter(
    "visionserve_camera_faults",
    "Triggers (and free-running grabs) answered with a fault instead of a frame, by reason: "
    "timeout, incomplete, disconnected, not_found, config, error", ["camera", "reason"])
TRIGGER_TO_FRAME = Histogram("visionserve_camera_trigger_to_frame_seconds",
                             "From the trigger to the camera's frame in hand", ["camera"],
                             buckets=_BUCKETS)
FRAME_TO_VERDICT = Histogram("visionserve_camera_frame_to_verdict_seconds",
                             "From the camera's frame in hand to its verdict", ["camera"],
                             buckets=_BUCKETS)


class SourceCounters(Collector):
    """What each source counts itself (``Source.stats``: drops, resends), read when scraped:
    ``visionserve_camera_source_<counter>_total{camera}``."""

    def __init__(self) -> None:
        self.read: Callable[[], dict[str, dict[str, int]]] | None = None

    def collect(self) -> Iterator[CounterMetricFamily]:
        read = self.read
        if read is None:
            return
        families: dict[str, CounterMetricFamily] = {}
        for camera, stats in sorted(read().items()):
            for key, value in sorted(stats.items()):
                if key == "frames":  # the service counts the frames it inspects
                    continue
                family = families.get(key)
                if family is None:
                    family = families[key] = CounterMetricFamily(
                        f"visionserve_camera_source_{key}",
                        f"The camera source's own count of {key} (drops: frames lost or "
                        "incomplete; resends: packets resent)", labels=["camera"])
                family.add_metric([camera], value)
        yield from families.values()


SOURCE_COUNTERS = SourceCounters()
REGISTRY.register(SOURCE_COUNTERS)
