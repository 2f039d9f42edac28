"""The System page's figures, read from the server's own Prometheus series
(:meth:`DataPlane.metrics_text`): the same numbers ``/metrics`` gives a scraper, from the process
that holds them, in either front-end mode."""

from __future__ import annotations

from dataclasses import dataclass, field

#: series -> the figure of :class:`Figures.gpu` it gives
GPU_SERIES = {
    "visionserve_gpu_memory_budget_bytes": "budget",
    "visionserve_gpu_memory_reserved_bytes": "reserved",
    "visionserve_gpu_memory_used_bytes": "used",
    "visionserve_gpu_device_memory_used_bytes": "card_used",
    "visionserve_gpu_device_memory_total_bytes": "card_total",
}


@dataclass
class Figures:
    gpu: dict[str, float] = field(default_factory=dict)  # empty: no GPU
    frontends_alive: int | None = None
    batch_workers: int = 0
    plc_clients: dict[str, int] = field(default_factory=dict)  # protocol -> clients
    plc_results: dict[tuple[str, str], int] = field(default_factory=dict)  # (station, result)
    plc_stalled: bool = False
    plc_last_ack: dict[str, float] = field(default_factory=dict)  # station -> Unix time


def read(text: str) -> Figures:
    """The figures in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    out = Figures()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name in GPU_SERIES:
                out.gpu[GPU_SERIES[name]] = value
            elif name == "visionserve_frontends_alive":
                out.frontends_alive = int(value)
            elif name == "visionserve_batch_workers_alive":
                out.batch_workers = int(value)
            elif name == "visionserve_plc_clients":
                out.plc_clients[labels.get("protocol", "")] = int(value)
            elif name == "visionserve_plc_results_total":
                out.plc_results[(labels.get("station", ""), labels.get("result", ""))] = \
                    int(value)
            elif name == "visionserve_plc_last_ack_timestamp_seconds":
                out.plc_last_ack[labels.get("station", "")] = value
            elif name == "visionserve_plc_engine_stalled":
                out.plc_stalled = value > 0
    if not out.gpu.get("card_total"):
        out.gpu = {}  # the series exist on every machine; a GPU-less one never sets them
    return out


def size(n: float) -> str:
    """Bytes as people read them: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
