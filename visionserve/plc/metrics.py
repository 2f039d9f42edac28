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
