"""The training-queue guard: queue training jobs on the inference GPU and run them without ever
taking the memory the inference server needs (see docs/guard.md).

Modules: ``store`` (SQLite queue), ``admission`` and ``watchdog`` (the rules), ``memory`` (NVML or
simulated memory source), ``launcher`` + ``jobwrap`` (starting a job), ``proc`` (/proc and
signals), ``supervisor`` (the loop), ``metrics``, ``cli``, ``http``.
"""
