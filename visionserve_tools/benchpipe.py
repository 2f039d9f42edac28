"""The served GPU path's own ceiling: the runner's two threads without the serving process.

    python -m visionserve_tools.benchpipe --out pipe.json [--seconds 4] [--processes 2 3]

Served, the H200 reaches 0.40-0.46x the bare model at 640x480 (docs/benchmarks.md). The profile
puts the rest in the serving process's interpreter: its event loop handles every frame, and the
runner's prep and compute threads wait for the interpreter behind it (docs/gpu.md, "what is
left"). Designs that take the batch out of that interpreter (the whole batch in a worker process,
or several serving processes) can reach at most what the pipeline itself reaches with nothing
else in its process. This measures that, in one run:

* **A process** (one of its own each, ``--child``) loads the model as the server does
  (``TorchBackend``: fp16, CUDA graphs) and makes the preprocessor as the server does
  (``TorchPreprocessor`` on the backend's stream, the one call), then runs the runner's two
  threads on batches of 32 identical frames and nothing else: a prep thread preparing batches and
  a compute thread running them (``backend.run``: copy into the graph, replay, copy out, wait),
  one prepared batch waiting between them, as the batcher allows an instance. No event loop,
  front end, socket or task.
* **Cases**, each at 640x480 and at 1080p JPEGs:
  ``one stream``  as served: preparation and model queued on the backend's one stream;
  ``two streams`` the preparation on a stream of its own, ordered to the model by an event, so
  that the device may resize batch k+1 while it runs batch k;
  ``N processes`` N such processes at once, each its own CUDA context (what several serving
  processes, or N whole-batch workers, would be), one stream each.
  Each case gives its frames per second (the sum over its processes), a ratio to the bare model
  of the same run, and per process the prep and compute threads' time per batch and their waits
  for each other: a compute thread that waits for the prep thread says preparation is the limit.
* **Alone**: the preparation of one batch with the stream synchronised after it, and the bare
  model: the CUDA graph's replay at batch 32 timed with CUDA events (benchgpu's figure).

On a machine without a GPU (``--device cpu``: a unit test) the prep thread decodes with OpenCV
(``imaging.prepare_batch``, the CPU path) and the cases with streams are left out.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from visionserve_tools.benchgpu import wall_ms

SIZES = {"640x480": (480, 640), "1080p": (1080, 1920)}


def log(msg: str) -> None:  # CLI progress output
    print(f"[benchpipe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pipeline(prepare: Callable[[], Any], run: Callable[[Any], Any], batch: int, seconds: float,
             warm_s: float = 1.0) -> dict:
    """The runner's prep and compute threads on ``prepare()`` / ``run(prepared)`` for
    ``warm_s`` then ``seconds``; what the second window did."""
    handoff: queue.Queue = queue.Queue(maxsize=1)  # one batch prepared while one computes
    stop = threading.Event()
    preps: list[tuple[float, float, float]] = []  # (start, prepared, handed over)
    runs: list[tuple[float, float, float]] = []  # (asked, got, ran)
    failure: list[BaseException] = []

    def prep_thread() -> None:
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                x = prepare()
                t1 = time.perf_counter()
                handoff.put(x)
                preps.append((t0, t1, time.perf_counter()))
        except BaseException as exc:  # noqa: BLE001 - reported with the results
            failure.append(exc)
        finally:
            handoff.put(None)

    def compute_thread() -> None:
        try:
            while True:
                t0 = time.perf_counter()
                x = handoff.get()
                if x is None:
                    return
                t1 = time.perf_counter()
                run(x)
                runs.append((t0, t1, time.perf_counter()))
                del x
        except BaseException as exc:  # noqa: BLE001 - reported with the results
            failure.append(exc)
            stop.set()
            while handoff.get() is not None:  # let the prep thread finish
                pass

    threads = [threading.Thread(target=prep_thread, name="prep", daemon=True),
               threading.Thread(target=compute_thread, name="compute", daemon=True)]
    for t in threads:
        t.start()
    time.sleep(warm_s)
    a = time.perf_counter()
    time.sleep(seconds)
    b = time.perf_counter()
    stop.set()
    for t in threads:
        t.join(timeout=60)
    if failure:
        raise RuntimeError(f"the pipeline failed: {failure[0]!r}") from failure[0]
    ran = [r for r in runs if a <= r[2] < b]
    prepared = [p for p in preps if a <= p[1] < b]

    def ms(values: list[float]) -> float | None:
        return round(statistics.fmean(values) * 1000, 3) if values else None

    return {"window_s": round(b - a, 3), "batches": len(ran),
            "frames_per_s": round(len(ran) * batch / (b - a), 1),
            "prep_ms_per_batch": ms([p[1] - p[0] for p in prepared]),
            "prep_waits_for_compute_ms": ms([p[2] - p[1] for p in prepared]),
            "compute_ms_per_batch": ms([r[2] - r[1] for r in ran]),
            "compute_waits_for_prep_ms": ms([r[1] - r[0] for r in ran])}


# --- one process -------------------------------------------------------------------------------

class Pipe:
    """One process's model, preprocessors and frames (``--child``)."""

    def __init__(self, model_dir: Path, device: str, batch: int) -> None:
        import torch

        from visionserve import imaging
        from visionserve.backends.torch import TorchBackend
        from visionserve.config import load_model_config
        from visionserve_tools.benchgpu import make_jpegs

        self.torch = torch
        self.device = device
        self.cuda = device.startswith("cuda")
        self.batch = batch
        self.cfg = cfg = load_model_config(model_dir / "model.toml")
        version = max((p for p in model_dir.iterdir() if p.name.isdigit()),
                      key=lambda p: int(p.name))
        self.backend = b = TorchBackend()
        b.load(version / "model.pt2", cfg, device)
        preferred = tuple(cfg.batching.preferred_batch_sizes)
        b.warmup(preferred)
        self.frames = {}
        for label, (h, w) in SIZES.items():
            jpegs = make_jpegs(16, h, w) if self.cuda else make_jpegs(4, h // 10, w // 10)
            self.frames[label] = [imaging.encoded_frame(j, max_pixels=h * w)
                                  for j in (jpegs * batch)[:batch]]
        self.preps: dict[str, Any] = {}
        if self.cuda:
            from visionserve.gpu.memory import high_priority_stream
            from visionserve.gpu.preprocess import TorchPreprocessor

            for streams, stream in (("one", b.stream), ("two", high_priority_stream(device))):
                p = TorchPreprocessor.for_config(cfg, device=device, dtype=b.input_dtype,
                                                 stream=stream, channels_last=b.channels_last)
                p.warmup(preferred)
                self.preps[streams] = p

    def bare(self) -> dict:
        import numpy as np

        b, n = self.backend, self.batch
        if not self.cuda:
            x = np.zeros((n, self.cfg.input.channels, self.cfg.input.height,
                          self.cfg.input.width), np.float32)
            ms = wall_ms(lambda: b.run(x), 20)["p50_ms"]
            return {"run_ms": ms, "frames_per_s": round(n / ms * 1000, 1)}
        from visionserve_tools.benchgpu import cuda_time_ms

        ms = cuda_time_ms(b._graphs[n][0].replay, 200, b.stream)
        return {"graph_replay_ms": round(ms, 3), "frames_per_s": round(n / ms * 1000, 1)}

    def alone(self, size: str) -> dict:
        """One batch's preparation with the stream synchronised after it, by itself."""
        frames, n = self.frames[size], self.batch
        if not self.cuda:
            from visionserve import imaging

            return {"prep_ms": wall_ms(lambda: imaging.prepare_batch(frames, self.cfg.input, n),
                                       5)["p50_ms"]}
        p = self.preps["one"]
        return {"prep_ms": wall_ms(lambda: (p.prepare(frames, n), p.stream.synchronize()),
                                   30)["p50_ms"]}

    def case(self, size: str, streams: str, seconds: float) -> dict:
        frames, n, b = self.frames[size], self.batch, self.backend
        if not self.cuda:
            from visionserve import imaging

            spec = self.cfg.input
            return pipeline(lambda: imaging.prepare_batch(frames, spec, n)[0], b.run, n, seconds)
        torch = self.torch
        p = self.preps[streams]
        if streams == "one":  # as served: both on the backend's stream
            return pipeline(lambda: p.prepare(frames, n)[0], b.run, n, seconds)

        def prepare() -> tuple[Any, Any]:
            tensor = p.prepare(frames, n)[0]
            done = torch.cuda.Event()
            done.record(p.stream)
            return tensor, done

        def run(item: tuple[Any, Any]) -> Any:
            tensor, done = item
            b.stream.wait_event(done)
            # run() waits for the copy of the outputs, so the device is past every read of
            # ``tensor`` before the compute thread drops it and its block goes back to the
            # preparation stream's pool
            return b.run(tensor)

        return pipeline(prepare, run, n, seconds)


def child(model_dir: Path, device: str, batch: int) -> int:
    """Load, say ready, then answer each case line on stdin with a result line."""
    pipe = Pipe(model_dir, device, batch)
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            if ask["what"] == "bare":
                out = pipe.bare()
            elif ask["what"] == "alone":
                out = pipe.alone(ask["size"])
            else:
                out = pipe.case(ask["size"], ask["streams"], ask["seconds"])
        except Exception as exc:  # noqa: BLE001 - said to the parent, which records it
            out = {"error": repr(exc)}
        print(json.dumps(out), flush=True)
    return 0


# --- the run -----------------------------------------------------------------------------------

class Children:
    """``n`` child processes, warmed up."""

    def __init__(self, n: int, model_dir: Path, device: str, batch: int) -> None:
        cmd = [sys.executable, "-m", "visionserve_tools.benchpipe", "--child", str(model_dir),
               "--device", device, "--batch", str(batch)]
        self.procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, bufsize=1) for _ in range(n)]
        try:
            for p in self.procs:
                line = self._line(p)
                if "ready" not in line:
                    raise RuntimeError(f"a pipeline process did not start: {line}")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _line(p: subprocess.Popen) -> dict:
        assert p.stdout is not None
        line = p.stdout.readline()  # the children answer or exit; the caller's timeout bounds it
        if not line:
            raise RuntimeError(f"a pipeline process exited ({p.wait()})")
        return json.loads(line)

    def ask(self, what: dict, n: int = 1) -> list[dict]:
        """``what`` to the first ``n`` children at once; their answers."""
        for p in self.procs[:n]:
            assert p.stdin is not None
            p.stdin.write(json.dumps(what) + "\n")
            p.stdin.flush()
        return [self._line(p) for p in self.procs[:n]]

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def measure(model_dir: Path, device: str, processes: tuple[int, ...], seconds: float,
            batch: int = 32, save: Callable[[dict], None] = lambda r: None) -> dict:
    """The cases of the module's doc; ``processes``: the sizes of the cases with several."""
    res: dict = {"device": device, "batch": batch, "seconds": seconds,
                 "processes": list(processes)}
    kids = Children(max(1, *processes), model_dir, device, batch)
    try:
        res["bare"] = kids.ask({"what": "bare"})[0]
        rate = res["bare"].get("frames_per_s")
        for size in SIZES:
            res[f"alone_{size}"] = kids.ask({"what": "alone", "size": size})[0]
        cases = [("one stream", "one", 1)]
        if device.startswith("cuda"):
            cases.append(("two streams", "two", 1))
        cases += [(f"{n} processes", "one", n) for n in processes if n > 1]
        for name, streams, n in cases:
            for size in SIZES:
                each = kids.ask({"what": "case", "size": size, "streams": streams,
                                 "seconds": seconds}, n)
                total = sum(e.get("frames_per_s", 0) for e in each)
                out = {"frames_per_s": round(total, 1),
                       "ratio_to_bare": round(total / rate, 3) if rate else None,
                       "per_process": each}
                res[f"{name}, {size}"] = out
                log(f"{name}, {size}: {total:.0f} frames/s"
                    + (f" = {total / rate:.3f}x the bare model" if rate else ""))
                save(res)
    finally:
        kids.close()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchpipe.json"))
    ap.add_argument("--seconds", type=float, default=4.0, help="measured per case (after 1 s)")
    ap.add_argument("--processes", type=int, nargs="+", default=[2],
                    help="processes of each case with several at once [2]")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="a model's folder (model.toml, version folders) [the benchmark's "
                         "ResNet-50, fp16, exported as benchgpu does]")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        return child(args.child, args.device, args.batch)
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def save(part: dict) -> None:
        results["pipeline"] = part
        args.out.write_text(json.dumps(results, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="benchpipe-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from visionserve_tools.benchgpu import export_models

            model_dir = export_models(Path(tmp), ("rn50",))["rn50"] / "rn50"
        save(measure(model_dir, args.device, tuple(args.processes), args.seconds, args.batch, save))
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save(results["pipeline"])
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
