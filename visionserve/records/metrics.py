"""Prometheus series of the traceability records and image capture (in ``/metrics`` of the
serving process, which every front-end process shows)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

WRITTEN = Counter("visionserve_records_written", "Records written to the record store")
DROPPED = Counter("visionserve_records_dropped",
                  "Records lost, by reason: queue_full (the writer fell behind, or the store "
                  "could not be written for a while: inference never waits), error (a record "
                  "that could not be made or stored: see the log)", ["reason"])
QUEUE_DEPTH = Gauge("visionserve_records_queue_depth", "Answered frames waiting for the writer")
STORE_FAULT = Gauge("visionserve_records_store_fault",
                    "1 while the record store cannot be written (disk full, read-only, deleted, "
                    "I/O error, database down): records wait in the queue, then are dropped")
STORE_ERRORS = Counter("visionserve_records_store_errors",
                       "Failed writes to the record store (retried with backoff)")
STORE_BYTES = Gauge("visionserve_records_store_bytes",
                    "Size of the record store (measured at each retention pass)")
DELETED = Counter("visionserve_records_deleted", "Records deleted by retention (age or size)")
CAPTURED = Counter("visionserve_captures", "Images captured for retraining, by policy",
                   ["policy"])
CAPTURE_DROPPED = Counter("visionserve_captures_dropped",
                          "Images the capture policy picked but that were not kept, by reason: "
                          "queue_full (the capture writer fell behind), error (the target "
                          "refused: see the log)", ["reason"])
CAPTURE_DELETED = Counter("visionserve_captures_deleted",
                          "Captured images deleted, oldest first, to stay under the quota (or "
                          "because the disk was full)")
CAPTURE_BYTES = Gauge("visionserve_capture_bytes", "Bytes in the capture folder")
