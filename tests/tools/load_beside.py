"""Served latency while another model's new version loads beside it (issue 21, CPU).

One server (``--model-control-mode explicit``) serves the tiny test model under a paced load at
half its saturation rate (:class:`tests.tools.paced.PacedLoad`) and a torch.export ResNet-50
(batch size 1, fp32 on the CPU). While the load runs, the ResNet-50's next version is loaded
``--loads`` times (a copy of its folder and ``POST /v2/repository/models/rn50/load``). The tiny
model's p99 inside the load windows is set against its p99 outside them, with the program read in
the serving process (``--isolated-loads false``) or in a child process (``true``, the default)::

    python -m tests.tools.load_beside --isolated true --out a.json
    python -m tests.tools.load_beside --isolated false --out b.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import cv2
import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from conftest import make_tiny_model, start_server
from tools.paced import PacedLoad

FRAME = cv2.imencode(".png", np.full((32, 32, 3), 100, np.uint8))[1].tobytes()


def make_rn50(folder: Path) -> None:
    """torchvision's ResNet-50 (random weights) as ``folder/1/model.pt2``, batch size 1."""
    import torch
    import torchvision

    net = torchvision.models.resnet50(weights=None, num_classes=5).eval()
    (folder / "1").mkdir(parents=True)
    ep = torch.export.export(net, (torch.zeros(1, 3, 224, 224),))
    torch.export.save(ep, str(folder / "1" / "model.pt2"))
    (folder / "model.toml").write_text(
        '[input]\nwidth = 224\nheight = 224\ntensor_name = "input"\n'
        '[output]\nlabels = ["ok", "b", "c", "d", "e"]\ntensor_name = "logits"\n'
        '[batching]\nmax_batch_size = 1\npreferred_batch_sizes = [1]\ntakt_ms = 5000\n'
        '[runtime]\nbackend = "torch"\n[version_policy]\nlatest = 1\n')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isolated", choices=["true", "false"], default="true")
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--gap-s", type=float, default=3.0, help="steady load between two loads")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="load-beside-"))
    try:
        repo = work / "repo"
        make_tiny_model(repo / "tiny")
        make_rn50(repo / "rn50")
        server = start_server(repo, work, "--model-control-mode", "explicit",
                              "--isolated-loads" if args.isolated == "true"
                              else "--no-isolated-loads", grpc=False)
        try:
            result = asyncio.run(scenario(server.url, repo / "rn50", args))
        finally:
            server.stop()
        result["child_reads"] = server.log().count("in a child process")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


async def scenario(url: str, folder: Path, args) -> dict:
    load = PacedLoad(url, "/v1/models/tiny/inspect", FRAME, "image/png")
    await load.measure_half_saturation()
    windows: list[tuple[float, float]] = []
    duration = 4.0 + args.loads * 20.0

    async def loads() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.sleep(4.0)
            for k in range(args.loads):
                shutil.copytree(folder / str(k + 1), folder / str(k + 2))
                t0 = time.monotonic()
                r = await client.post(f"{url}/v2/repository/models/rn50/load")
                windows.append((t0, time.monotonic()))
                assert r.status_code == 200, r.text
                await asyncio.sleep(args.gap_s)
        stop.set()

    stop = asyncio.Event()
    task = asyncio.create_task(loads())
    sender = asyncio.create_task(load.open_loop(duration))
    await stop.wait()
    sender.cancel()
    await asyncio.gather(task, sender, return_exceptions=True)
    load.close()

    def inside(t: float) -> bool:
        return any(a <= t <= b for a, b in windows)

    lat_in = [a.latency_ms for a in load.answers if inside(a.sent)]
    lat_out = [a.latency_ms for a in load.answers if not inside(a.sent)]
    return {"isolated_loads": args.isolated == "true", "rate": round(load.rate, 1),
            "frames": len(load.answers),
            "non_200": sum(a.status != 200 for a in load.answers),
            "load_call_s": [round(b - a, 2) for a, b in windows],
            "p50_outside_ms": round(float(np.percentile(lat_out, 50)), 2),
            "p99_outside_ms": round(float(np.percentile(lat_out, 99)), 2),
            "p50_during_ms": round(float(np.percentile(lat_in, 50)), 2),
            "p99_during_ms": round(float(np.percentile(lat_in, 99)), 2),
            "max_during_ms": round(max(lat_in), 1)}


if __name__ == "__main__":
    sys.exit(main())
