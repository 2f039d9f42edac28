"""Prometheus series of the traceability records and image capture (in ``/metrics`` of the
serving process, which every front-end process shows)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

WRITTEN = Counter("visionserve_records_written", "Records written to the record store")
DROPPED = Counter("visionserve_records_dropped",
                  "Records lost, by reason: queue_full (the writer fell behind, or the store "
                  "could not be written for a while: inference never waits), store_fault (a "
                  "batch the store kept refusing for 2 minutes), shutdown (not stored "
                  "within the drain time), error (a record that could not be made or stored): "
                  "each loss is also logged with its count", ["reason"])
QUEUE_DEPTH = Gauge("visionserve_records_queue_depth", "Answered frames waiting for the writer")
STORE_FAULT = Gauge("visionserve_records_store_fault",
                    "1 while the record store cannot be written (disk full, read-only, deleted, "
                    "I/O error, database down): a batch is retried, then dropped and counted")
STORE_ERRORS = Counter("visionserve_records_store_errors",
                       "Failed writes to the record store (retried with backoff)")
STORE_BYTES = Gauge("visionserve_records_store_bytes",
                    "Size of the record store (measured at each retention pass)")
DELETED = Counter("visionserve_records_deleted", "Records deleted by retention (age or size)")
CAPTURED = Counter("visionserve_captures", "Images captured for retraining, by policy",
                   ["policy"])
CAPTURE_DROPPED = Counter("visionserve_captures_dropped",
                          "Images the capture policy picked but that were not kept, by reason: "
                          "queue_full (the capture writer fell behind), no_room (the rest of "
                          "the disk is the records'), shutdown (not stored within the drain "
                          "time), error (the target refused: see the log); the record then "
                          "names no image", ["reason"])
CAPTURE_DELETED = Counter("visionserve_captures_deleted",
                          "Captured images deleted, oldest first, to stay under the quota, or "
                          "because the disk was full (the records come first)")
CAPTURE_BYTES = Gauge("visionserve_capture_bytes",
                      "Bytes of the server's images in the capture folder (or the S3 spool)")
CAPTURE_SPOOLED = Gauge("visionserve_capture_spooled",
                        "Images waiting in the local spool for the S3 bucket to answer")
