"""The server as shipped against the bare model of the same run (``benchgpu``/``benchdet``
``--as-shipped``).

Each run measures the bare model first (:func:`bare_reference`: the model's batch-32 and
batch-1 figures, and the single-frame pipeline: the preparation of one frame plus the batch-1
model), then starts the server once per SPEC (``--compare``; by default one, as shipped) with no
tuning flag at all (only ``--models``, ``--device`` and its ports) and loads it: one client (its
p50 and where the time goes, :func:`one_client_breakdown`), then 96 and 288 closed-loop clients
at each frame size. Every served figure is a ratio to that run's bare one; every answer other
than a 200 is counted by status and reason. ``--runs N`` repeats the whole and reports each
figure's median over the runs with the runs' values (:func:`medians`).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .benchgpu import Server, breakdown, cuda_time_ms, load, log, server_env, wall_ms

if TYPE_CHECKING:
    from visionserve.imaging import Frame

CLIENTS = (96, 288)
QUICK_CLIENTS = (4, 12)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The as-shipped mode's options (benchgpu and benchdet)."""
    g = ap.add_argument_group(
        "as shipped", "the server started with no tuning flag, against the bare model of the "
                      "same run")
    g.add_argument("--as-shipped", action="store_true",
                   help="run this mode instead of the tool's scenarios: the server as shipped, "
                        "then once per --compare SPEC (no flag; SPEC is its environment)")
    g.add_argument("--runs", type=int, default=1, metavar="N",
                   help="repeat the bare model and the served loads N times; report each "
                        "figure's median (default: 1)")
    g.add_argument("--clients", type=int, nargs="+", default=None, metavar="N",
                   help="closed-loop clients of each saturation load (default: 96 288; "
                        "--quick: 4 12)")
    g.add_argument("--seconds", type=float, default=None, metavar="S",
                   help="length of each saturation load, half of it for the one client "
                        "(default: 8; --quick: 2)")
    g.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="where the server and the bare model run (default: cuda)")
    g.add_argument("--models", type=Path, default=None, metavar="DIR",
                   help="serve this model repository's --model instead of the tool's own model "
                        "(e.g. a small one for a CPU check)")
    g.add_argument("--model", default=None, metavar="NAME", help="the model of --models")


def run(args: argparse.Namespace, models: Path, model: str, frames: dict[str, list[bytes]],
        specs: list[dict[str, str]], log_dir: Path, client_procs: int, res: dict,
        save=lambda: None) -> dict:
    """:func:`as_shipped` with the command line's settings (``--models``/``--model`` replace
    ``models``/``model``): the server as shipped first, then one per SPEC of ``specs`` (where
    ``""``, as shipped, is not one of them)."""
    if args.models is not None:
        if not args.model:
            raise SystemExit("--models needs --model NAME")
        models, model = args.models, args.model
    clients = tuple(args.clients or (QUICK_CLIENTS if args.quick else CLIENTS))
    seconds = args.seconds or (2.0 if args.quick else 8.0)
    procs = client_procs or min(8, max(2, (os.cpu_count() or 8) // 2))
    specs = specs if {} in specs else [{}, *specs]
    return as_shipped(models, model, frames, specs, runs=max(1, args.runs),
                      clients=clients, procs=procs, seconds=seconds, device=args.device,
                      quick=args.quick, log_dir=log_dir, res=res, save=save)


def as_shipped(models: Path, model: str, frames: dict[str, list[bytes]],
               specs: list[dict[str, str]], *, runs: int, clients: tuple[int, ...], procs: int,
               seconds: float, device: str, quick: bool, log_dir: Path, res: dict,
               save=lambda: None) -> dict:
    """Fills ``res`` (``setup``, ``runs``: one entry per run, ``median``), saved after each
    phase. ``frames``: the JPEGs of each size, by its label; the first size's first frame is the
    single-frame pipeline's and the lone client's."""
    names = [spec_name(i, spec) for i, spec in enumerate(specs)]
    res["setup"] = {"model": model, "device": device, "runs": runs, "sizes": list(frames),
                    "clients": list(clients), "client_processes": procs, "load_s": seconds,
                    "servers": names, "server_flags": "none but --models, --device and ports"}
    res["runs"] = []
    for r in range(runs):
        log(f"as shipped: run {r + 1} of {runs}: the bare model")
        this: dict = {}
        res["runs"].append(this)
        try:
            this["bare"] = bare_reference(models, model, frames, device, quick)
        except Exception as exc:  # noqa: BLE001 -- said; the served figures are still worth having
            this["bare"] = {"error": repr(exc)[:300]}
        save()
        for i, spec in enumerate(specs):
            log(f"as shipped: run {r + 1} of {runs}: {names[i]}")
            this[names[i]] = served(models, model, frames, spec, this["bare"], clients=clients,
                                    procs=procs, seconds=seconds, device=device,
                                    log_path=log_dir / f"shipped-{r}-{i}.log")
            save()
        res["median"] = medians(res["runs"])
        save()
    for line in summary(res["median"]):
        log(line)
    return res


def spec_name(i: int, spec: dict[str, str]) -> str:
    return f"{i}: " + (",".join(f"{k}={v}" for k, v in spec.items()) or "as shipped")


# --- bare --------------------------------------------------------------------------------------

def bare_reference(models: Path, model: str, frames: dict[str, list[bytes]], device: str,
                   quick: bool, inputs: dict[str, Callable[[], Frame]] | None = None) -> dict:
    """The model loaded as the server loads it (its backend, task and preparation), no server:
    ``batch``/``one``: the model at batch min(32, max_batch_size) and 1 (CUDA graph replay timed
    by CUDA events where the backend captured graphs, else the backend's ``run`` on a ready
    input); ``single_frame_pipeline``: per size, the preparation of one frame (decode, resize,
    copy to the device) plus the batch-1 model. ``inputs``: instead of ``frames``' JPEGs, per
    size a function that makes the frame (timed with the preparation: a camera's pixels turned
    into a frame, say)."""
    from visionserve import imaging, tasks
    from visionserve.backends import base as backends
    from visionserve.backends.checks import Subject
    from visionserve.repository import scan

    entry = scan(models)[model]
    path, config = entry.versions[entry.default_version], entry.config
    batch = min(32, config.batching.max_batch_size)
    cuda = device.startswith("cuda")
    backend = backends.create(config.runtime.backend)
    backend.load(path, config, "cuda:0" if cuda else "cpu")
    try:
        task = tasks.create(config)
        backend.select_outputs(task.bind(Subject(path), backend.outputs), on_device=task.on_device)
        backend.warmup(tuple(sorted({1, batch})))
        graphs = getattr(backend, "_graphs", {})

        def model_ms(bs: int) -> float:
            if bs in graphs:
                return cuda_time_ms(graphs[bs][0].replay, 50 if quick else 200, backend.stream)
            x = backend.example_input(bs)
            return wall_ms(lambda: backend.run(x), 3 if quick else 30, 1 if quick else 5)["p50_ms"]

        out: dict = {"device": _device_name(cuda), "backend": backend.describe(),
                     "model_timed_by": "CUDA graph replay, CUDA events" if graphs
                     else "the backend's run on a ready input, p50 wall time"}
        for key, bs in (("batch", batch), ("one", 1)):
            ms = model_ms(bs)
            out[key] = {"batch_size": bs, "ms": round(ms, 3),
                        "img_per_s": rounded(bs / ms * 1000)}
        if backend.takes_device_input:
            from visionserve.gpu.preprocess import TorchPreprocessor

            prep = TorchPreprocessor.for_config(config, device=backend.device,
                                                dtype=backend.input_dtype, stream=backend.stream,
                                                channels_last=backend.channels_last)
            prep.warmup((1,))

            def prepare(frame) -> None:
                prep.prepare([frame], 1)
                backend.stream.synchronize()

            out["prepare_timed_by"] = "the server's GPU preparation (nvJPEG, device resize), p50"
        else:
            def prepare(frame) -> None:
                imaging.prepare_batch([frame], config.input, 1)

            out["prepare_timed_by"] = "the server's CPU preparation (OpenCV), p50"
        out["single_frame_pipeline"] = {}
        makers = inputs if inputs is not None else {
            size: functools.partial(imaging.encoded_frame, jpegs[0])
            for size, jpegs in frames.items()}
        for size, make in makers.items():
            p = wall_ms(lambda make=make: prepare(make()), 20 if quick else 100)["p50_ms"]
            out["single_frame_pipeline"][size] = {
                "prepare_ms": p, "model_ms": out["one"]["ms"],
                "total_ms": round(p + out["one"]["ms"], 3)}
        return out
    finally:
        backend.close()
        if cuda:
            import torch

            torch.cuda.empty_cache()  # the server started next needs the memory


def _device_name(cuda: bool) -> str:
    if not cuda:
        return "cpu"
    import torch

    return torch.cuda.get_device_name(0)


# --- served ------------------------------------------------------------------------------------

def served(models: Path, model: str, frames: dict[str, list[bytes]], spec: dict[str, str],
           bare: dict, *, clients: tuple[int, ...], procs: int, seconds: float, device: str,
           log_path: Path) -> dict:
    """One server with no tuning flag (``spec``: its environment) under one client, then under
    each count of ``clients`` at each frame size."""
    part: dict = {"settings": spec}
    try:
        s = Server(models, log_path, device=device, env=server_env(spec), log_level=None,
                   as_shipped=True)
    except RuntimeError as exc:  # a setting the server refuses: said, and the next one runs
        part["error"] = str(exc)
        return part
    rate = (bare.get("batch") or {}).get("img_per_s")
    first = next(iter(frames))
    try:
        part["start_s"] = s.start_s
        part["startup_log"] = s.startup_log[-40:]  # what the server chose, in its words
        st0 = s.stats(model)
        one = load(s, model, frames[first][:1], 1, 1, max(1.0, seconds / 2))
        one["breakdown_ms"] = one_client_breakdown(one, breakdown(st0, s.stats(model)))
        pipe = (bare.get("single_frame_pipeline") or {}).get(first, {}).get("total_ms")
        if pipe and one.get("p50_ms"):
            one["ratio_to_bare_single_frame_pipeline"] = ratio(one["p50_ms"], pipe)
        part["single_client"] = one
        part["saturation"] = {}
        for size, jpegs in frames.items():
            for n in clients:
                p = min(procs, n)
                st0 = s.stats(model)
                sat = load(s, model, jpegs, p, math.ceil(n / p), seconds)
                if rate:
                    sat["ratio_to_bare_bs32"] = ratio(sat.get("throughput_per_s", 0), rate)
                sat["breakdown"] = breakdown(st0, s.stats(model))
                part["saturation"][f"{size}@{n}"] = sat
    finally:
        s.stop()
    return part


def ratio(a: float, b: float) -> float:
    return rounded(a / b)


def rounded(x: float) -> float:
    """3 decimals, or 4 significant digits below 0.1 (a tiny test model's ratios are far below
    0.001)."""
    return round(x, 3) if abs(x) >= 0.1 else float(f"{x:.4g}")


def one_client_breakdown(single: dict, stats: dict) -> dict:
    """Where a lone client's time goes, ms: p50 of the ``timing`` in the inspect answers
    (:func:`.benchgpu.load`) and the server's per-frame means over the same load (``stats``:
    :func:`.benchgpu.breakdown`)."""
    t = single.get("timing_p50_ms") or {}
    m = stats.get("per_frame_mean_ms") or {}
    steps: tuple[float | None, ...] = (m.get("compute_input"), m.get("compute_infer"),
                                       m.get("compute_output"))
    known = [x for x in steps if x is not None]
    return {
        "client_p50": t.get("client"),
        "http_read_and_queue": t.get("queue"),
        "decode_resize_copy": steps[0],
        "model": steps[1],
        "post_process": steps[2],
        "handoffs_in_compute": round(t["compute"] - sum(known), 3)
        if t.get("compute") is not None and len(known) == len(steps) else None,
        "verdict_to_answer": t.get("verdict_to_answer"),
        "answer_outside_server": t.get("outside_server"),
        "how": {
            "http_read_and_queue": "answer's timing.queue_ms: from the request's head to its "
                                   "batch's start (body read, hand-over to the engine, batcher)",
            "decode_resize_copy, model, post_process": "the server's statistics (/stats "
                                                        "compute_input, compute_infer, "
                                                        "compute_output), mean per frame",
            "handoffs_in_compute": "timing.compute_ms less those three",
            "verdict_to_answer": "timing.total_ms - queue_ms - compute_ms: the verdict's way "
                                 "back to the HTTP handler",
            "answer_outside_server": "client latency - timing.total_ms: sending the head, the "
                                     "answer's JSON, its write and the client's read"},
        "not_available": [
            "the HTTP body read apart from the queue (the server times them together)",
            "decode apart from resize and copy (one figure)"],
    }


# --- over the runs -----------------------------------------------------------------------------

def figures(run: dict) -> dict[str, dict[str, float]]:
    """One run's headline figures: ``{"bare": {...}, server name: {...}}``."""
    bare = run.get("bare") or {}
    out: dict[str, dict[str, float | None]] = {"bare": {
        "batch img_per_s": (bare.get("batch") or {}).get("img_per_s"),
        "one ms": (bare.get("one") or {}).get("ms"),
        **{f"single_frame_pipeline {size} ms": p.get("total_ms")
           for size, p in (bare.get("single_frame_pipeline") or {}).items()}}}
    for name, part in run.items():
        if name == "bare" or "error" in part:
            continue
        one = part.get("single_client") or {}
        f: dict[str, float | None] = {
            "single_client p50_ms": one.get("p50_ms"),
            "single_client ratio_to_bare_single_frame_pipeline":
                one.get("ratio_to_bare_single_frame_pipeline"),
            **{f"single_client {k}_ms": v for k, v in (one.get("breakdown_ms") or {}).items()
               if isinstance(v, (int, float))}}
        for key, sat in (part.get("saturation") or {}).items():
            f[f"{key} ratio_to_bare_bs32"] = sat.get("ratio_to_bare_bs32")
            f[f"{key} throughput_per_s"] = sat.get("throughput_per_s")
            f[f"{key} p50_ms"] = sat.get("p50_ms")
            f[f"{key} non_200"] = sat.get("errors")
        out[name] = f
    return {k: {n: v for n, v in f.items() if v is not None} for k, f in out.items()}


def medians(runs: list[dict]) -> dict:
    """Each figure of :func:`figures`: its median over ``runs`` and the runs' values."""
    per_run = [figures(r) for r in runs]
    out: dict = {}
    for name in dict.fromkeys(k for f in per_run for k in f):
        keys = dict.fromkeys(n for f in per_run for n in f.get(name, {}))
        out[name] = {}
        for n in keys:
            values = [f[name][n] for f in per_run if n in f.get(name, {})]
            out[name][n] = {"median": rounded(statistics.median(values)), "runs": values}
    return out


def summary(median: dict) -> list[str]:
    """The headline figures, a line each: ``server: figure median [run values]``."""
    lines = []
    for name, figs in median.items():
        for n, v in figs.items():
            if "ratio" in n or "img_per_s" in n or "non_200" in n or n.endswith("p50_ms") \
                    or "pipeline" in n:
                lines.append(f"{name}: {n} {v['median']:g} {v['runs']}")
    return lines

