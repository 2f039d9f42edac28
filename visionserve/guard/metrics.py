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
                       "Failed accesses of the supervisor to the job database (retried with "
                       "backoff).")

# -- sharing the GPU (cooperative yielding and the process-level policies) -----------------------
JOBS_BY_MECHANISM = Gauge("visionserve_guard_jobs_by_mechanism",
                          "Running jobs by how they share the GPU: mps (CUDA MPS clients on a "
                          "capped share of the SMs), yield (their hook yields while a batch "
                          "runs) or process (pause/resume only).", ["mechanism"])
MPS_ACTIVE = Gauge("visionserve_guard_mps_active",
                   "1 while the server and its jobs are clients of a CUDA MPS daemon "
                   "(--guard-mps); 0 otherwise, the reason in the log.")
YIELDS = Counter("visionserve_guard_yields_total",
                 "Times a job's hook waited for a running batch (cooperative yielding).")
YIELD_FORCED = Counter("visionserve_guard_yield_forced_total",
                       "Yields cut short (max wait, or the job's minimum share of time).")
YIELD_WAIT = Counter("visionserve_guard_yield_wait_seconds_total",
                     "Time jobs spent waiting in their hook for the server's batches.")
YIELD_THROTTLE = Counter("visionserve_guard_yield_throttle_seconds_total",
                         "Time jobs slept in their hook to hold the duty cycle (rate limiting).")
PAUSED = Counter("visionserve_guard_paused_seconds_total",
                 "Time jobs spent stopped (SIGSTOP) by the process-level policies.")
JOB_TIME_SHARE = Gauge("visionserve_guard_job_time_share",
                       "Share of the last seconds the running job(s) could run: not waiting, "
                       "throttled or paused (1: not held back).")
JOB_GPU_UTIL = Gauge("visionserve_guard_job_gpu_utilization",
                     "SM utilisation of the jobs' processes, percent, from NVML's per-process "
                     "samples (absent where the driver does not give them).")
INFERENCE_WAIT = Counter("visionserve_guard_inference_wait_seconds_total",
                         "Estimated time the server's batches waited on jobs: their compute time "
                         "over its level without a job (from the stage timers; an estimate).")
DUTY = Gauge("visionserve_guard_duty", "Duty cycle the latency budget allows cooperative jobs "
             "(1: no rate limit).")
SCHED_FIXED = Counter("visionserve_guard_sched_fixed_total",
                      "Job threads found outside SCHED_IDLE and put back (should stay 0).")
