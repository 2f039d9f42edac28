"""The guard's Prometheus metrics (default registry, so the server's ``/metrics`` shows them
when the guard runs in-process; ``guard run --metrics-port`` exposes them otherwise)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

JOBS_QUEUED = Gauge("visionserve_guard_jobs_queued", "Guard jobs waiting to start.")
JOBS_RUNNING = Gauge("visionserve_guard_jobs_running", "Guard jobs running (not paused).")
JOBS_PAUSED = Gauge("visionserve_guard_jobs_paused", "Guard jobs paused by the watchdog.")
INTERVENTIONS = Counter(
    "visionserve_guard_interventions_total",
    "Watchdog and user actions on jobs, by action (pause, resume, stop, kill) and reason "
    "(over_need, low_headroom, headroom_back, cancel, shutdown, grace_expired).",
    ["action", "reason"])
INFERENCE_FLOOR = Gauge("visionserve_guard_inference_floor_bytes",
                        "GPU memory kept free for the inference server (budget + margin).")
GPU_FREE = Gauge("visionserve_guard_gpu_free_bytes", "Free memory of the guarded GPU.")
HEADROOM = Gauge("visionserve_guard_headroom_bytes",
                 "Free memory above the inference floor (negative: under the floor).")
STORE_FAULT = Gauge("visionserve_guard_store_fault",
                    "1 while the supervisor cannot use the job database (disk full, read-only, I/O "
                    "error): running jobs stay watched, none starts, job records wait for it.")
STORE_ERRORS = Counter("visionserve_guard_store_errors_total",
                       "Failed accesses of the supervisor to the job database (retried with backoff).")
