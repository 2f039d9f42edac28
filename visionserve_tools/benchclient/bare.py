"""The bare-model reference: the same model and batch sizes, called in-process, no server.

Loaded through :mod:`visionserve.backends` from the same model repository as the server, so
every served figure can be set against the bare one measured in the same run. Two figures per
batch size:

* ``pipeline``: the same work per frame as the server does -- JPEG decode, resize, normalise,
  model, softmax + verdict -- sequentially in one thread (:func:`visionserve.imaging.prepare_batch`
  and the model's task, :meth:`visionserve.tasks.Task.postprocess`: the server's own functions);
* ``model``: the backend's ``run`` alone on a ready tensor (the ceiling of the model itself).

Also the single-frame answer for every image of the set, which served answers must equal.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if a.size else float("nan")


def measure(models: Path, model: str, frames: list, batch_sizes: list[int], seconds: float,
            min_iters: int = 5) -> dict:
    """Bare figures for ``batch_sizes`` plus single-frame answers for ``frames``."""
    from visionserve import imaging, tasks
    from visionserve.backends import base as backends
    from visionserve.backends.checks import Subject
    from visionserve.repository import scan

    entries = scan(models)
    if model not in entries:
        from visionserve.errors import NotFound

        raise NotFound(f"model {model!r} is not in {models}; have {sorted(entries)}")
    entry = entries[model]
    version = entry.default_version
    config = entry.config
    spec = config.input
    backend = backends.create(config.runtime.backend)
    backend.load(entry.versions[version], config, "cpu")
    task = tasks.create(config)
    backend.select_outputs(task.bind(Subject(entry.versions[version]), backend.outputs))
    backend.warmup(tuple(sorted(set(batch_sizes))))
    enc = [imaging.encoded_frame(f.data) for f in frames]

    answers = []
    tensor: np.ndarray | None
    for i, fr in enumerate(enc):
        tensor, _, _ = imaging.prepare_batch([fr], spec, 1)
        verdict, result = task.postprocess(backend.run(tensor), slice(0, 1))[0]
        label, _, score = task.summary(result)
        answers.append({"frame": i, "verdict": verdict, "label": label, "score": score})

    out: dict = {"model": model, "version": version, "backend": backend.describe(),
                 "intra_op_threads": config.runtime.intra_op_threads, "batch_sizes": {}}
    for bs in batch_sizes:
        pipe: list[int] = []
        only: list[int] = []
        tensor = None
        end = time.perf_counter() + seconds
        c0 = time.process_time()
        i = 0
        while time.perf_counter() < end or len(pipe) < min_iters:
            batch = [enc[(i + k) % len(enc)] for k in range(bs)]
            i += bs
            t0 = time.perf_counter_ns()
            tensor, good, _ = imaging.prepare_batch(batch, spec, bs)
            task.postprocess(backend.run(tensor), slice(0, len(good)))
            pipe.append(time.perf_counter_ns() - t0)
        # process CPU (all threads, onnxruntime's too) per frame: steadier than wall time on a
        # shared machine, where the CPU this process gets drifts with the neighbours' load
        cpu_ms = (time.process_time() - c0) * 1000 / (len(pipe) * bs)
        end = time.perf_counter() + seconds / 2
        while time.perf_counter() < end or len(only) < min_iters:
            t1 = time.perf_counter_ns()
            backend.run(tensor)
            only.append(time.perf_counter_ns() - t1)
        p, m = np.asarray(pipe) / 1e6, np.asarray(only) / 1e6
        out["batch_sizes"][str(bs)] = {
            "iterations": len(pipe),
            "pipeline_ms": {"min": float(p.min()), "p50": _pct(p, 50), "p99": _pct(p, 99),
                            "mean": float(p.mean())},
            "model_ms": {"min": float(m.min()), "p50": _pct(m, 50), "p99": _pct(m, 99),
                         "mean": float(m.mean())},
            "pipeline_fps": bs * 1000.0 / float(p.mean()),
            "model_fps": bs * 1000.0 / float(m.mean()),
            "pipeline_cpu_ms_per_frame": round(cpu_ms, 4),
        }
        log.info("bare bs=%d: pipeline p50 %.2f ms, model p50 %.2f ms", bs, _pct(p, 50),
                 _pct(m, 50))
    backend.close()
    out["answers"] = answers
    return out


def best_of(first: dict, second: dict) -> dict:
    """Per batch size, the round with the higher pipeline throughput; both rounds kept."""
    out = dict(first)
    out["batch_sizes"] = {}
    for bs, a in first["batch_sizes"].items():
        b = second["batch_sizes"].get(bs, a)
        best = dict(a if a["pipeline_fps"] >= b["pipeline_fps"] else b)
        # the least-disturbed single call of either round: the floor the server is held to
        best["pipeline_ms"] = dict(best["pipeline_ms"],
                                   min=min(a["pipeline_ms"]["min"], b["pipeline_ms"]["min"]))
        out["batch_sizes"][bs] = dict(best,
                                      rounds={"before_load": _brief(a), "after_load": _brief(b)})
    out["rule"] = "measured before and after the load; the faster round is the reference"
    return out


def _brief(r: dict) -> dict:
    return {"pipeline_min_ms": round(r["pipeline_ms"]["min"], 4),
            "pipeline_p50_ms": round(r["pipeline_ms"]["p50"], 4),
            "pipeline_fps": round(r["pipeline_fps"], 2),
            "pipeline_cpu_ms_per_frame": r["pipeline_cpu_ms_per_frame"],
            "model_p50_ms": round(r["model_ms"]["p50"], 4), "model_fps": round(r["model_fps"], 2)}
