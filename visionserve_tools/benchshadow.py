"""What a candidate in shadow (docs/closed-loop.md, "Shadow") costs the live verdicts, in one run
on this machine:

    python -m visionserve_tools.benchshadow --out shadow.json [--rounds 3] [--window-s 20]

A server with the shipped classifier (its own temporary repository, ``--records``: the loop's
routes come with them) and a
candidate ``c-1`` beside it (a copy of the live version: the shadow's cost does not depend on
its weights); the saturation measured (closed loop), then one open-loop paced load at
``--load-fraction`` (50 %) of it from separate client processes for the whole run (latency from
each request's scheduled send time, :class:`visionserve_tools.benchguard.PacedLoad`), in
alternating windows of ``--window-s``: the shadow off, then on (``POST .../shadow``), ``--rounds``
times; the seconds around each start and stop are left out. Per window and pooled: count, errors
(any answer but 200), p50 / p99; and the ratios **p50 and p99 with the shadow / without**
(pooled, and the median of the off/on pairs' ratios), with
the shadow's own counts (frames judged, dropped for load). The machine may be shared: compare
the ratio, within one run, not the milliseconds across runs.

Exit codes: 0 the run completed (see ``ratios`` and ``errors``), 1 it was aborted (``error`` in
the JSON), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from visionserve_tools.benchgpu import Server, load, make_jpegs
from visionserve_tools.benchguard import PacedLoad, phase_stats, run_recorded

REPO = Path(__file__).resolve().parent.parent
MODEL = "defect-classifier"
SHADOW = f"/v1/models/{MODEL}/candidates/c-1/shadow"
#: after a start or a stop: not counted in either window
SETTLE_S = 2.0


def log(msg: str) -> None:  # CLI progress output
    print(f"[benchshadow] {msg}", file=sys.stderr, flush=True)


def make_candidate(model_folder: Path, cid: str = "c-1",
                   edit=None) -> Path:
    """Candidate ``cid`` of the model in ``model_folder`` as the loop leaves a trained one: a
    copy of version 1's files with job.json and candidate.json; ``edit(folder)`` may change its
    model files (a test's candidate that judges otherwise)."""
    folder = model_folder / "candidates" / cid
    shutil.copytree(model_folder / "1", folder)
    if edit is not None:
        edit(folder)
    job = {"id": cid, "model": model_folder.name, "from_version": 1,
           "job": {"id": 0, "command": ["copy of version 1"]}, "trained_on": [],
           "held_out": [], "recipe": {}, "created_by": "benchshadow",
           "created": "2026-12-07T00:00:00.000Z"}
    (folder / "job.json").write_text(json.dumps(job))
    (folder / "candidate.json").write_text(json.dumps({**job, "finished": job["created"],
                                                       "metrics": {}}))
    for path in [folder, *folder.rglob("*")]:  # the server refuses what others can write
        path.chmod(path.stat().st_mode & 0o755)
    return folder


def call(server: Server, method: str, path: str, body: dict | None = None) -> dict[str, Any]:
    req = urllib.request.Request(server.url + path, method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:  # loopback: the routes are open
        return json.loads(r.read())


def pooled(records: list[tuple], windows: list[tuple[float, float]]) -> dict:
    rows = [r for r in records if any(a <= r[0] < b for a, b in windows)]
    out = phase_stats(rows, min(a for a, _ in windows), max(b for _, b in windows))
    out["window_s"] = round(sum(b - a for a, b in windows), 2)
    out["rate_per_s"] = round(len(rows) / out["window_s"], 1) if out["window_s"] else None
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def run(args: argparse.Namespace, res: dict, save) -> None:
    with tempfile.TemporaryDirectory(prefix="benchshadow-") as tmp:
        repo = Path(tmp) / "models"
        shutil.copytree(REPO / "models" / MODEL, repo / MODEL)
        for path in [repo, *repo.rglob("*")]:
            path.chmod(path.stat().st_mode & 0o755)
        make_candidate(repo / MODEL)
        jpegs = make_jpegs()
        log_path = (args.log_dir or args.out.parent) / "benchshadow-server.log"
        server = paced = None
        try:
            # the loop's routes come with the records
            server = Server(repo, log_path, "--records", "--records-dir", str(Path(tmp) / "data"),
                            device="cpu")
            sat = load(server, MODEL, jpegs, args.processes, 4, args.saturation_s)
            res["saturation"] = sat
            if not sat.get("answers"):
                raise RuntimeError(f"saturation run got no answers: {sat}")
            rate = args.rate or round(args.load_fraction * sat["throughput_per_s"], 1)
            res["rate_per_s"] = rate
            save()
            log(f"saturation {sat['throughput_per_s']}/s; paced load at {rate}/s")
            total = args.rounds * 2 * (args.window_s + 2 * SETTLE_S) + 60
            paced = PacedLoad(server.port, MODEL, jpegs, rate, args.processes, 8,
                              args.deadline_ms, total)
            off: list[tuple[float, float]] = []
            on: list[tuple[float, float]] = []
            t = paced.t0 + SETTLE_S
            for i in range(args.rounds):
                time.sleep(max(0.0, t + args.window_s - time.monotonic()))
                off.append((t, t + args.window_s))
                call(server, "POST", SHADOW, {"minutes": 60})
                t = time.monotonic() + SETTLE_S
                time.sleep(max(0.0, t + args.window_s - time.monotonic()))
                on.append((t, t + args.window_s))
                res["shadow_runs"] = res.get("shadow_runs", []) + [
                    call(server, "DELETE", SHADOW)]
                res["shadow_runs"][-1]["report"] = {
                    k: v for k, v in call(server, "GET", SHADOW).items()
                    if k in ("judged", "handed", "dropped", "agreement", "shadow_ms_mean")}
                t = time.monotonic() + SETTLE_S
                log(f"round {i + 1}/{args.rounds}: {res['shadow_runs'][-1]['report']}")
            records = paced.stop()
            res["windows"] = {"off": [phase_stats(records, a, b) for a, b in off],
                              "on": [phase_stats(records, a, b) for a, b in on]}
            without, with_ = pooled(records, off), pooled(records, on)
            res["without_shadow"], res["with_shadow"] = without, with_
            res["errors"] = without["errors"] + with_["errors"]
            res["ratios"] = {"p50": ratio(with_.get("p50_ms"), without.get("p50_ms")),
                             "p99": ratio(with_.get("p99_ms"), without.get("p99_ms"))}
            # each off/on pair apart: a burst of another process's load on a shared machine
            # lands in one window; the median pair is the figure it moves least
            pairs = [{"p50": ratio(b.get("p50_ms"), a.get("p50_ms")),
                      "p99": ratio(b.get("p99_ms"), a.get("p99_ms"))}
                     for a, b in zip(res["windows"]["off"], res["windows"]["on"])]
            res["pair_ratios"] = pairs
            res["median_pair_ratios"] = {q: median([x[q] for x in pairs]) for q in ("p50", "p99")}
            res["shadow"] = {k: sum(r["report"][k] or 0 for r in res["shadow_runs"])
                             for k in ("judged", "handed", "dropped")}
        finally:
            if paced is not None:
                paced.stop()
            if server is not None:
                server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchshadow.json"))
    ap.add_argument("--log-dir", type=Path, default=None, help="the server's log (default: "
                    "beside --out)")
    ap.add_argument("--rounds", type=int, default=3, help="off/on window pairs")
    ap.add_argument("--window-s", type=float, default=20.0, help="each window's length")
    ap.add_argument("--saturation-s", type=float, default=8.0)
    ap.add_argument("--load-fraction", type=float, default=0.5, help="paced load / saturation")
    ap.add_argument("--rate", type=float, default=None, help="paced load in requests/s "
                    "(default: --load-fraction x saturation)")
    ap.add_argument("--processes", type=int, default=2, help="client processes")
    ap.add_argument("--deadline-ms", type=float, default=1000.0,
                    help="X-Deadline-Ms of the paced requests")
    ap.set_defaults(device="cpu")  # the shipped classifier on this machine's CPU
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.processes < 1:
        ap.error("--rounds and --processes must be >= 1")
    for name in ("window_s", "saturation_s", "deadline_ms"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.rate is not None and args.rate <= 0:
        ap.error("--rate must be > 0")
    if not 0 < args.load_fraction <= 1:
        ap.error(f"--load-fraction must be in (0, 1], got {args.load_fraction}")
    res: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v
                                    for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=2) + "\n")

    if run_recorded(run, lambda res, cuda: None, args, res, save, log=log):
        return 1
    log(f"p50 x{res['ratios']['p50']}, p99 x{res['ratios']['p99']} with the shadow (median "
        f"pair: {res['median_pair_ratios']}); "
        f"errors {res['errors']}; shadow {res['shadow']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
