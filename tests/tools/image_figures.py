"""Start-to-ready, RSS idle and under load, throughput, and `stop` under load: the image against
the bare pip install, measured the same way (the figures in docs/deployment.md, issue 23).

    python tests/tools/image_figures.py --image visionserve:0.1.0-cpu --bare /tmp/core/bin/python

Both serve the shipped model (models/) on the CPU over loopback: the container through a port
published on 127.0.0.1, the bare server on 127.0.0.1. Load: --clients threads, each sending
640x480 JPEGs to the inspect API back to back for --seconds. RSS: the server's process tree
(psutil, from the host; for the container that is tini and the server). Then SIGTERM (docker stop)
while the load runs; every request must get an answer (200, or 503 once draining).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[2]
MODEL = "defect-classifier"


def frame() -> bytes:
    import cv2
    import numpy as np

    rng = np.random.default_rng(1)
    ok, buf = cv2.imencode(".jpg", rng.integers(0, 255, (480, 640, 3), dtype=np.uint8))
    assert ok
    return buf.tobytes()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    try:
        p = psutil.Process(pid)
        return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])
    except psutil.NoSuchProcess:
        return 0


class Served:
    """One server: ``launch()``, then ``url``, ``pid`` (root of its process tree), ``stop()``."""

    def __init__(self, kind: str, image: str | None, bare: str | None) -> None:
        self.kind, self.image, self.bare = kind, image, bare
        self.port = free_port()
        self.proc = None
        self.cid = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def launch(self) -> None:
        if self.kind == "container":
            self.cid = subprocess.run(
                ["docker", "run", "-d", "--read-only", "--tmpfs", "/tmp", "-p", f"127.0.0.1:{self.port}:8000",
                 "--label", "visionserve.test=figures", self.image],
                capture_output=True, text=True, check=True).stdout.strip()
        else:
            env = {**os.environ, "VISIONSERVE_DEVICE": "cpu", "VISIONSERVE_MODELS": str(REPO / "models"),
                   "VISIONSERVE_HOST": "127.0.0.1", "VISIONSERVE_HTTP_PORT": str(self.port),
                   "VISIONSERVE_GRPC_PORT": str(free_port())}
            self.proc = subprocess.Popen([self.bare, "-m", "visionserve", "serve"], env=env,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")

    @property
    def pid(self) -> int:
        if self.cid:
            return int(subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", self.cid],
                                      capture_output=True, text=True, check=True).stdout)
        return self.proc.pid

    def stop(self) -> tuple[int, float]:
        t0 = time.monotonic()
        if self.cid:
            subprocess.run(["docker", "stop", "-t", "30", self.cid], capture_output=True, check=True)
            code = int(subprocess.run(["docker", "inspect", "-f", "{{.State.ExitCode}}", self.cid],
                                      capture_output=True, text=True, check=True).stdout)
        else:
            self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(60)
        return code, time.monotonic() - t0

    def remove(self) -> None:
        if self.cid:
            subprocess.run(["docker", "rm", "-f", self.cid], capture_output=True, check=False)
        elif self.proc and self.proc.poll() is None:
            self.proc.kill()


def measure(kind: str, args) -> dict:
    s = Served(kind, args.image, args.bare)
    body = frame()
    out: dict = {"kind": kind}
    try:
        t0 = time.monotonic()
        s.launch()
        while True:
            try:
                if httpx.get(s.url + "/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > 120:
                raise SystemExit(f"{kind}: not ready after 120 s")
            time.sleep(0.02)
        out["start_to_ready_s"] = round(time.monotonic() - t0, 2)
        for _ in range(20):                      # a few frames through, then idle
            httpx.post(f"{s.url}/v1/models/{MODEL}/inspect", content=body,
                       headers={"Content-Type": "image/jpeg"}, timeout=30)
        time.sleep(3)
        out["rss_idle_mb"] = round(tree_rss(s.pid) / 2**20)

        lat: list[float] = []
        outcomes: dict[str, int] = {}
        peak = [0]
        stop_load = threading.Event()
        lock = threading.Lock()

        def client() -> None:
            with httpx.Client(timeout=60) as c:
                while not stop_load.is_set():
                    t = time.perf_counter()
                    try:
                        r = c.post(f"{s.url}/v1/models/{MODEL}/inspect", content=body,
                                   headers={"Content-Type": "image/jpeg"})
                        key = str(r.status_code)
                    except httpx.ConnectError:
                        key = "not sent"
                    except httpx.HTTPError:
                        key = "lost"
                    with lock:
                        outcomes[key] = outcomes.get(key, 0) + 1
                        if key == "200":
                            lat.append(time.perf_counter() - t)
                    if key not in ("200",):
                        return

        def sample() -> None:
            while not stop_load.is_set():
                peak[0] = max(peak[0], tree_rss(s.pid))
                time.sleep(0.25)

        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        sampler = threading.Thread(target=sample)
        t_load = time.monotonic()
        for t in [*threads, sampler]:
            t.start()
        time.sleep(args.seconds)
        done = len(lat)
        out["throughput_img_s"] = round(done / (time.monotonic() - t_load), 1)
        out["p50_ms"] = round(statistics.median(lat) * 1000, 1)
        out["p99_ms"] = round(sorted(lat)[int(len(lat) * 0.99)] * 1000, 1)
        out["rss_load_peak_mb"] = round(peak[0] / 2**20)
        code, took = s.stop()                  # under load
        stop_load.set()
        for t in [*threads, sampler]:
            t.join(60)
        out["stop_under_load"] = {"exit_code": code, "seconds": round(took, 2), **outcomes}
    finally:
        s.remove()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", help="the image (docker); omit to skip the container")
    ap.add_argument("--bare", help="python of a venv with the bare pip install; omit to skip")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--runs", type=int, default=1, help="start-to-ready: runs (median reported)")
    args = ap.parse_args()
    for kind in ("container", "bare"):
        if (kind == "container" and not args.image) or (kind == "bare" and not args.bare):
            continue
        results = [measure(kind, args) for _ in range(args.runs)]
        best = results[-1]
        best["start_to_ready_s_runs"] = [r["start_to_ready_s"] for r in results]
        best["start_to_ready_s"] = statistics.median(best["start_to_ready_s_runs"])
        print(json.dumps(best), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
