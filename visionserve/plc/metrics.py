"""Prometheus series of the PLC servers (in ``/metrics`` once a PLC server is configured)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RESULTS = Counter("visionserve_plc_results", "Results published to the PLC servers, by station and "
                  "result (OK, NG, no_decision)", ["station", "result"])
BUS_DROPPED = Counter("visionserve_plc_bus_dropped", "Results dropped because the PLC servers "
                      "fell behind the bus (its queue was full); the PLC sees a sequence gap")
UNROUTED = Counter("visionserve_plc_unrouted", "Answered frames whose camera id no station takes "
                   "(--plc-stations)")
BUS_DELAY = Histogram("visionserve_plc_bus_delay_seconds", "From a frame's final answer in the "
                      "engine to its result in the PLC server's data, by protocol", ["protocol"],
                      buckets=(0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
                               0.5))
OVERFLOWS = Counter("visionserve_plc_buffer_overflows", "Modbus results dropped because the "
                    "station's buffer was full of unacknowledged results (raises Fault)",
                    ["station"])
STALLED = Gauge("visionserve_plc_engine_stalled", "1 while the watchdog finds the engine making no "
                "progress (the heartbeat stops)")
CLIENTS = Gauge("visionserve_plc_clients", "Connected PLC clients", ["protocol"])
LAST_ACK = Gauge("visionserve_plc_last_ack_timestamp_seconds", "Unix time a PLC last "
                 "acknowledged a station's result (Modbus Result Ack handshake)", ["station"])

#: the series the PLC server processes update; their updates reach this process's /metrics
RELAYED = ("RESULTS", "BUS_DROPPED", "UNROUTED", "BUS_DELAY", "OVERFLOWS", "STALLED", "CLIENTS",
           "LAST_ACK")
_METHODS = frozenset(("inc", "set", "observe"))


class Recorder:
    """Stands in for one of the series above in a PLC server process: each update is handed to
    ``sink(series, label values, method, value)``, and :func:`apply` repeats it in the serving
    process, whose ``/metrics`` is the one scraped."""

    def __init__(self, name: str, sink, labels: tuple = ()) -> None:
        self._name, self._sink, self._labels = name, sink, labels

    def labels(self, *values) -> Recorder:
        return Recorder(self._name, self._sink, tuple(str(v) for v in values))

    def inc(self, amount: float = 1) -> None:
        self._sink(self._name, self._labels, "inc", amount)

    def set(self, value: float) -> None:
        self._sink(self._name, self._labels, "set", value)

    def observe(self, value: float) -> None:
        self._sink(self._name, self._labels, "observe", value)


def record_into(sink) -> None:
    """In a PLC server process: every relayed series records into ``sink`` from now on."""
    for name in RELAYED:
        globals()[name] = Recorder(name, sink)


def apply(ops) -> None:
    """In the serving process: the updates a PLC server process recorded."""
    for name, labels, method, value in ops:
        if name not in RELAYED or method not in _METHODS:
            continue
        series = globals()[name]
        getattr(series.labels(*labels) if labels else series, method)(value)
