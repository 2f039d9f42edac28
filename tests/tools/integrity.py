"""Frame integrity: does every answer belong to its own frame?

A served model whose scores identify its input (the mean of each colour channel) and frames that
are each unique (a solid colour of their own, mixed sizes and formats), sent concurrently. Some
requests carry deadlines so short that they expire while their batch is decoded, and some clients
hang up mid-request. Every 200 answer's scores must be its own frame's colour.

Used by the frame-integrity tests (tests/integration, tests/gpu) and, for longer runs against a
server started by hand, as a command::

    python -m tests.tools.integrity --url http://127.0.0.1:8000 --seconds 30 --out integrity.json
    python -m tests.tools.integrity --make-repo /tmp/repo --backend torch   # the model to serve
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MODEL = "means"
LABELS = ("r", "g", "b")
STEP = 16  # colour levels between two frames' colours, per channel: 16**3 = 4096 unique colours
TOLERANCE = 6 / 255  # JPEG (CPU or nvJPEG) moves a solid colour by at most ~3 levels
SIZES = ((480, 640), (240, 320), (131, 97), (64, 64), (600, 800), (1080, 1920))
FORMATS = ("jpeg", "png", "raw")

TOML = """\
description = "frame-integrity model: its scores are the mean of each input channel"
[input]
width = 32
height = 32
tensor_name = "input"
[output]
labels = ["r", "g", "b"]
tensor_name = "scores"
activation = "none"
[verdict]
ok_labels = ["r"]
[batching]
max_batch_size = 16
preferred_batch_sizes = [1, 2, 4, 8, 16]
max_queue_delay_ms = 2
max_queue_size = 256
takt_ms = 2000
[runtime]
backend = "{backend}"
precision = "{precision}"
"""


def make_repo(root: Path, backend: str = "onnxruntime", precision: str = "fp16") -> Path:
    """A model repository holding the ``means`` model (ONNX and torch.export files)."""
    import torch

    class Means(torch.nn.Module):
        def forward(self, x):
            return x.mean(dim=(2, 3))

    folder = root / MODEL / "1"
    folder.mkdir(parents=True, exist_ok=True)
    x = torch.zeros(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Means().eval(), (x,), str(folder / "model.onnx"), input_names=["input"],
                          output_names=["scores"], dynamic_axes={"input": {0: "b"}, "scores": {0: "b"}},
                          opset_version=17, dynamo=False)
        ep = torch.export.export(Means().eval(), (x,),
                                 dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=256)},))
        torch.export.save(ep, str(folder / "model.pt2"))
    (root / MODEL / "model.toml").write_text(TOML.format(backend=backend, precision=precision))
    return root


def colour(i: int) -> tuple[int, int, int]:
    """The RGB colour of frame ``i`` of the pool (all 4096 colours differ)."""
    n = 256 // STEP
    k = i % n**3
    return (k % n * STEP + STEP // 2, k // n % n * STEP + STEP // 2, k // n**2 * STEP + STEP // 2)


def encode(i: int, size: tuple[int, int], fmt: str) -> tuple[bytes, dict[str, str]]:
    import cv2

    h, w = size
    rgb = np.empty((h, w, 3), dtype=np.uint8)
    rgb[:] = colour(i)
    if fmt == "raw":
        return rgb.tobytes(), {"Content-Type": "application/octet-stream", "X-Image-Shape": f"{h}x{w}x3"}
    bgr = np.ascontiguousarray(rgb[:, :, ::-1])
    if fmt == "jpeg":
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 95])
        media = "image/jpeg"
    else:
        ok, buf = cv2.imencode(".png", bgr, [cv2.IMWRITE_PNG_COMPRESSION, 1])
        media = "image/png"
    assert ok
    return buf.tobytes(), {"Content-Type": media}


def frame_pool(n: int, sizes: tuple[tuple[int, int], ...]) -> list[tuple[bytes, dict[str, str]]]:
    """``n`` frames, each its own colour (so any two in flight differ): mostly JPEG (the GPU
    path's batch decode), some PNG and raw; raw only up to VGA so the pool stays small."""
    out = []
    for i in range(n):
        size = sizes[i % len(sizes)]
        fmt = "jpeg" if i % 10 < 7 else ("png" if i % 10 < 9 else "raw")
        if fmt == "raw" and size[0] * size[1] > 480 * 640:
            fmt = "png"
        out.append(encode(i, size, fmt))
    return out


def belongs(scores: dict, i: int) -> bool:
    want = np.asarray(colour(i), dtype=np.float64) / 255
    got = np.asarray([scores[k] for k in LABELS], dtype=np.float64)
    return bool(np.all(np.abs(got - want) <= TOLERANCE))


@dataclass
class Report:
    sent: int = 0
    answered_200: int = 0
    wrong: int = 0
    statuses: Counter = field(default_factory=Counter)
    short_deadline: int = 0
    hung_up: int = 0
    examples: list = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"sent": self.sent, "answered_200": self.answered_200, "wrong": self.wrong,
                "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
                "short_deadline": self.short_deadline, "hung_up": self.hung_up,
                "seconds": round(self.seconds, 1), "wrong_examples": self.examples[:10]}


async def _senders(url: str, pool: list, first: int, stride: int, seconds: float, clients: int,
                   short_share: float, short_ms: tuple[float, float], hangup_share: float,
                   model: str, seed: int) -> Report:
    import httpx

    report = Report()
    rng = random.Random(seed)
    counter = iter(range(first, 1 << 62, stride))
    end = time.monotonic() + seconds
    endpoint = f"{url}/v1/models/{model}/inspect"
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)

    async def sender(client: httpx.AsyncClient) -> None:
        while time.monotonic() < end:
            i = next(counter)
            k = i % len(pool)
            body, media = pool[k]
            headers = {**media, "X-Part-Id": str(i)}
            if rng.random() < short_share:
                headers["X-Deadline-Ms"] = f"{rng.uniform(*short_ms):.1f}"
                report.short_deadline += 1
            timeout = rng.uniform(0.001, 0.010) if rng.random() < hangup_share else 30.0
            report.sent += 1
            try:
                r = await client.post(endpoint, content=body, headers=headers, timeout=timeout)
            except httpx.TimeoutException:
                report.hung_up += 1
                continue
            except httpx.TransportError as exc:
                report.statuses[type(exc).__name__] += 1
                continue
            report.statuses[r.status_code] += 1
            if r.status_code != 200:
                continue
            answer = r.json()
            report.answered_200 += 1
            if answer.get("part_id") != str(i) or not belongs(answer["scores"], k):
                report.wrong += 1
                if len(report.examples) < 10:
                    report.examples.append({"frame": k, "colour": colour(k), "answer": answer})

    t0 = time.monotonic()
    async with httpx.AsyncClient(limits=limits) as client:
        await asyncio.gather(*(sender(client) for _ in range(clients)))
    report.seconds = time.monotonic() - t0
    return report


def _process_main(args: tuple) -> dict:
    url, n, sizes, first, stride, kw = args
    report = asyncio.run(_senders(url, frame_pool(n, sizes), first, stride, **kw))
    d = report.as_dict()
    d["statuses"] = dict(report.statuses)
    return d


async def run_load(url: str, *, seconds: float = 30.0, clients: int = 48, processes: int = 1,
                   short_share: float = 0.3, short_ms: tuple[float, float] = (1.0, 8.0),
                   hangup_share: float = 0.05, sizes: tuple[tuple[int, int], ...] = SIZES,
                   model: str = MODEL, pool_size: int = 1024, seed: int = 0) -> Report:
    """Drive ``clients`` concurrent senders (spread over ``processes`` processes, so the load
    generator is not the bottleneck on a large machine) for ``seconds``; every 200 answer is
    checked against its own frame's colour."""
    kw = {"seconds": seconds, "short_share": short_share, "short_ms": tuple(short_ms),
          "hangup_share": hangup_share, "model": model}
    if processes <= 1:
        return await _senders(url, frame_pool(pool_size, sizes), 0, 1, clients=clients, seed=seed, **kw)
    import concurrent.futures
    import multiprocessing

    per = max(1, clients // processes)
    jobs = [(url, pool_size, sizes, k, processes, {**kw, "clients": per, "seed": seed + k})
            for k in range(processes)]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(processes, mp_context=ctx) as ex:
        parts = await asyncio.gather(*(asyncio.wrap_future(ex.submit(_process_main, j)) for j in jobs))
    total = Report()
    for d in parts:
        total.sent += d["sent"]
        total.answered_200 += d["answered_200"]
        total.wrong += d["wrong"]
        total.short_deadline += d["short_deadline"]
        total.hung_up += d["hung_up"]
        total.statuses.update(d["statuses"])
        total.examples += d["wrong_examples"]
        total.seconds = max(total.seconds, d["seconds"])
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=48)
    p.add_argument("--processes", type=int, default=1, help="load-generator processes")
    p.add_argument("--short-ms", type=float, nargs=2, default=(1.0, 8.0))
    p.add_argument("--out", type=Path)
    p.add_argument("--make-repo", type=Path, help="write the model repository here and exit")
    p.add_argument("--backend", default="onnxruntime", choices=("onnxruntime", "torch"))
    args = p.parse_args(argv)
    if args.make_repo:
        make_repo(args.make_repo, args.backend)
        return 0
    report = asyncio.run(run_load(args.url, seconds=args.seconds, clients=args.clients,
                                  processes=args.processes, short_ms=tuple(args.short_ms)))
    text = json.dumps(report.as_dict(), indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 1 if report.wrong else 0


if __name__ == "__main__":
    sys.exit(main())
