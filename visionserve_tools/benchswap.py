"""Model swaps under load on the GPU (issue 21): p99 before, during and after each swap, and no
device memory added outside the swap windows.

    python -m visionserve_tools.benchswap --out swap.json [--swaps 3] [--quick]

1. Exports the ResNet-50 bench model of :mod:`.benchgpu` (torch fp16, CUDA graphs) with
   ``[version_policy] latest = 1`` and starts ``visionserve serve --model-control-mode explicit
   --gpu-memory-budget 8GiB``.
2. Measures saturation (closed loop), then drives an open-loop paced load at ``--load-fraction``
   (default half) of it (:class:`.benchguard.PacedLoad`: latency from each request's scheduled
   send time; any answer but 200 is an error).
3. After ``--steady-s`` of steady load, swaps ``--swaps`` times: copies the serving version's
   folder as the next version and calls ``POST /v2/repository/models/rn50/load`` (the new
   version loads and warms up beside the old, traffic switches, the old one is released), then
   ``--steady-s`` of steady load again, and so on.
4. Reads ``visionserve_gpu_allocator_new_segments`` (cudaMalloc calls of the torch allocator
   since the last mark; the server marks after start-up and after each swap settles) before each
   swap and at the end: each reading is the memory added outside a swap window.

The JSON: saturation, the rate, per window (``before``, ``swap k``: from the load call to one
second after it returned, ``between k``/``after``) count, errors, p50/p99 from the schedule and
the server's own time, each swap's load-call time and answer, the new-segment readings, and
``conditions``. Needs CUDA (exits 0 with ``skipped`` in the JSON where it is absent).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from .benchgpu import Server, export_models, load, make_jpegs
from .benchguard import PacedLoad, phase_stats

MODEL = "rn50"
SEGMENTS = "visionserve_gpu_allocator_new_segments"


def log(msg: str) -> None:
    print(f"[benchswap {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def post(url: str, body: bytes = b"{}", timeout: float = 600) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def timeline(records: list[tuple], a: float, b: float, step_s: float = 0.1) -> list[dict]:
    """A swap window in ``step_s`` slices: from the load call (s), frames scheduled, the slowest
    answer from the schedule, and the slowest server time, batcher queue and compute (from dispatch
    to result) of the server's answers (ms): where in the load serving waited."""
    slices: dict[int, list[tuple]] = {}
    for r in records:
        if a <= r[0] < b:
            slices.setdefault(int((r[0] - a) / step_s), []).append(r)
    out = []
    for i, rows in sorted(slices.items()):
        out.append({"t_s": round(i * step_s, 2), "n": len(rows),
                    "max_ms": round(max(r[1] for r in rows), 1),
                    "server_max_ms": round(max(r[4] for r in rows), 1),
                    "queue_max_ms": round(max(r[7] for r in rows), 1),
                    "compute_max_ms": round(max(r[8] for r in rows), 1)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m visionserve_tools.benchswap",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--swaps", type=int, default=3)
    ap.add_argument("--steady-s", type=float, default=6.0)
    ap.add_argument("--load-fraction", type=float, default=0.5)
    ap.add_argument("--client-processes", type=int, default=4)
    ap.add_argument("--gpu-memory-budget", default="8GiB")
    ap.add_argument("--quick", action="store_true", help="short phases (a smoke run)")
    args = ap.parse_args(argv)
    import torch

    res: dict = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=2))

    if not torch.cuda.is_available():
        res["skipped"] = "no CUDA device"
        save()
        log("no CUDA device: skipped")
        return 0
    res["gpu"] = torch.cuda.get_device_name(0)
    steady = 2.0 if args.quick else args.steady_s
    work = Path(tempfile.mkdtemp(prefix="benchswap-"))
    repo = export_models(work, (MODEL,))[MODEL]
    folder = repo / MODEL
    toml = folder / "model.toml"
    toml.write_text(toml.read_text() + "\n[version_policy]\nlatest = 1\n")
    jpegs = make_jpegs()
    server = Server(repo, args.out.with_suffix(".server.log"), "--gpu-memory-budget",
                    args.gpu_memory_budget,
                    "--model-control-mode", "explicit")
    try:
        res["server_start_s"] = server.start_s
        sat = load(server, MODEL, jpegs, args.client_processes, 8, 2.0 if args.quick else 5.0)
        res["saturation"] = sat
        rate = round(sat["throughput_per_s"] * args.load_fraction, 1)
        res["rate_per_s"] = rate
        log(f"saturation {sat['throughput_per_s']}/s; paced load at {rate}/s")
        total = steady * (args.swaps + 1) + 120 * args.swaps
        paced = PacedLoad(server.port, MODEL, jpegs, rate, args.client_processes, 16, None, total)
        windows: list[tuple[str, float, float]] = []
        swaps, segments = [], []
        try:
            start = paced.t0
            time.sleep(steady + max(0.0, start - time.monotonic()))
            mark = start
            version = 1
            for k in range(1, args.swaps + 1):
                segments.append({"before swap": k,
                                 "new_segments": server.metrics().get(SEGMENTS)})
                shutil.copytree(folder / str(version), folder / str(version + 1))
                t_a = time.monotonic()
                windows.append(("before" if k == 1 else f"between {k - 1}", mark, t_a))
                status, answer = post(f"{server.url}/v2/repository/models/{MODEL}/load")
                t_b = time.monotonic()
                swaps.append({"swap": k, "status": status, "answer": answer,
                              "load_call_s": round(t_b - t_a, 3),
                              "wall_start": round(time.time() - (time.monotonic() - t_a), 3)})
                log(f"swap {k}: {status} in {t_b - t_a:.2f} s: {answer}")
                version += 1
                mark = t_b + 1.0
                windows.append((f"swap {k}", t_a, mark))
                time.sleep(max(0.0, mark - time.monotonic()) + steady)
            end = time.monotonic()
            windows.append(("after", mark, end))
            segments.append({"at the end": True, "new_segments": server.metrics().get(SEGMENTS)})
            res["gpu_metrics_at_end"] = server.metrics(("visionserve_gpu_",))
        finally:
            records = paced.stop()
        res["swaps"] = swaps
        res["segments"] = segments
        res["windows"] = {name: phase_stats(records, a, b) for name, a, b in windows}
        res["swap_timelines"] = {name: timeline(records, a, b) for name, a, b in windows
                                 if name.startswith("swap")}
        steady_p99 = [w.get("p99_ms") for n, w in res["windows"].items()
                      if not n.startswith("swap") and w.get("p99_ms") is not None]
        swap_p99 = [w.get("p99_ms") for n, w in res["windows"].items()
                    if n.startswith("swap") and w.get("p99_ms") is not None]
        errors = sum(w["errors"] for w in res["windows"].values())
        res["conditions"] = {
            "every swap answered 200": all(s["status"] == 200 for s in swaps),
            "zero errors": errors == 0,
            "no new segments outside the swaps": all(s["new_segments"] == 0 for s in segments),
            "p99 during swaps within 2x of steady": bool(swap_p99 and steady_p99) and
            max(swap_p99) <= 2 * max(steady_p99),
        }
        res["pass"] = all(res["conditions"].values())
        save()
        for name, w in res["windows"].items():
            log(f"{name}: {w['count']} frames, errors {w['errors']}, p50 {w.get('p50_ms')} p99 "
                f"{w.get('p99_ms')} ms (server p99 {w.get('server_p99_ms')} ms)")
        log(f"segments {segments}; conditions {res['conditions']}")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
