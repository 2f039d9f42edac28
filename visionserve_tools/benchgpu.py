"""GPU benchmark in one run: bare model vs served, on a ResNet-50-class classifier.

    python -m visionserve_tools.benchgpu --out results.json [--log-dir DIR] [--quick]
    python -m visionserve_tools.benchgpu --as-shipped --runs 3 --out shipped.json

1. Exports torchvision ``resnet50(weights=None, num_classes=5)`` (random weights) to ``.pt2`` and
   ``.onnx`` in a temporary model repository (224x224, fp16 for torch).
2. Bare: CUDA-graph replay time at bs 1/8/32 (CUDA events, like DESIGN §6), the backend's whole
   ``run`` (copy in, replay, copy out), eager bs 1; preprocessing of 32 640x480 JPEGs on the GPU
   (nvJPEG + device resize) vs OpenCV on the CPU; onnxruntime CUDA EP with IOBinding if present.
3. Served (``visionserve serve --device cuda``, inspect API, 640x480 JPEGs): one client's
   p50/p99; saturation with several client processes; the same with ``--max-batch-size 1``;
   onnxruntime if it has CUDA; allocator segments before/after the load (``/metrics``); where the
   time goes (the server's statistics: queue, preprocessing, model, postprocessing); with
   ``--threads-s S``, what each thread of the serving process does through S s of saturation
   (``visionserve_tools.threadstates``: py-spy, which must be installed, e.g. carried as a wheel).
4. ``--compare SPEC`` (repeatable) runs, instead of 3, the front-end scenario once per SPEC, each
   on a server of its own started with SPEC's settings as environment variables (``""``: as
   shipped; ``VISIONSERVE_SWITCH_INTERVAL_MS=0.05``; several joined by commas;
   ``VISIONSERVE_FRONTENDS=0`` for the front end in the serving process): one client,
   saturation at 640x480 and at 1080p, each as a ratio to the bare model of the same run. An A/B
   of server settings on one machine in one run.
5. ``--as-shipped`` runs, instead of 2-4, the server with no tuning flag (once per ``--compare``
   SPEC) under one client and 96 and 288 clients at 640x480 and 1080p, against the bare model of
   the same run, ``--runs N`` times with each figure's median (``visionserve_tools.benchshipped``;
   on the CPU: ``--device cpu --quick``).

Results go to ``--out`` as JSON; server logs to ``--log-dir``. Needs only the server's own
dependencies (stdlib HTTP clients, no extra packages).
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

LABELS = ["ok", "scratch", "spot", "crack", "contamination"]
#: a server's front ends and batch workers when a scenario does not name them: none (the server
#: as shipped chooses them on a GPU); its flags (--frontends N) win over these
IN_PROCESS = {"VISIONSERVE_FRONTENDS": "0", "VISIONSERVE_GPU_BATCH_PROCESSES": "0"}

TOML = """\
description = "benchmark: ResNet-50, random weights"
[input]
width = 224
height = 224
tensor_name = "input"
mean = [0.485, 0.456, 0.406]
std = [0.229, 0.224, 0.225]
[output]
labels = {labels}
tensor_name = "logits"
[batching]
max_batch_size = 32
preferred_batch_sizes = [1, 2, 4, 8, 16, 32]
max_queue_delay_ms = 2.0
max_queue_size = 1024
takt_ms = 5000
dispatch_when_idle = true
[runtime]
backend = "{backend}"
precision = "{precision}"
instances = {instances}
"""


def log(msg: str) -> None:  # CLI progress output
    print(f"[benchgpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- model -----------------------------------------------------------------------------------

def export_models(root: Path, names: tuple[str, ...] = ("rn50", "rn50-ort")) -> dict[str, Path]:
    """The bench model as ``rn50`` (torch fp16, ``.pt2``) and/or ``rn50-ort`` (onnxruntime fp32)."""
    import warnings

    import torch
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet50(weights=None, num_classes=len(LABELS)).eval()
    x = torch.randn(2, 3, 224, 224)
    repos = {}
    for name, backend, precision in (("rn50", "torch", "fp16"),
                                     ("rn50-ort", "onnxruntime", "fp32")):
        if name not in names:
            continue
        folder = root / name / name
        (folder / "1").mkdir(parents=True)
        (folder / "model.toml").write_text(TOML.format(labels=json.dumps(LABELS), backend=backend,
                                                        precision=precision, instances=1))
        repos[name] = root / name
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if "rn50" in repos:
            ep = torch.export.export(
                net, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=1024)},))
            torch.export.save(ep, str(root / "rn50" / "rn50" / "1" / "model.pt2"))
        if "rn50-ort" in repos:
            torch.onnx.export(net, (x,), str(root / "rn50-ort" / "rn50-ort" / "1" / "model.onnx"),
                              input_names=["input"], output_names=["logits"],
                              dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                              opset_version=17, dynamo=False)
    if "rn50" in repos:  # the same model with two runner instances (two decode/compute pipelines)
        import shutil

        two = root / "rn50-i2" / "rn50"
        shutil.copytree(root / "rn50" / "rn50", two)
        (two / "model.toml").write_text(TOML.format(labels=json.dumps(LABELS), backend="torch",
                                                    precision="fp16", instances=2))
        repos["rn50-i2"] = root / "rn50-i2"
    log(f"exported ResNet-50 ({', '.join(repos)}) in {time.time() - t0:.1f} s")
    return repos


def make_jpegs(n: int = 16, h: int = 480, w: int = 640) -> list[bytes]:
    import cv2
    import numpy as np

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    out = []
    for i in range(n):
        base = 100 + 60 * np.sin(x / (25 + i)) * np.cos(y / (33 + 2 * i))
        img = np.clip(
            np.dstack([base, base * 0.9 + 20, 230 - base]) + rng.normal(0, 3, (h, w, 3)), 0, 255)
        _, buf = cv2.imencode(".jpg", img.astype(np.uint8), [cv2.IMWRITE_JPEG_QUALITY, 90])
        out.append(buf.tobytes())
    return out


# --- bare ------------------------------------------------------------------------------------

def cuda_time_ms(fn, iters: int, stream) -> float:
    import torch

    with torch.cuda.stream(stream):
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(iters):
            fn()
        end.record(stream)
        end.synchronize()
    return start.elapsed_time(end) / iters


def wall_ms(fn, iters: int, warmup: int = 5) -> dict:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return {"p50_ms": round(times[len(times) // 2], 3),
            "mean_ms": round(statistics.fmean(times), 3)}


def _graph_replay(model_dir: str, how: str, iters: int) -> dict:
    """In a child process: the model's CUDA graph replay time at bs 1/8/32 with cuDNN's
    ``heuristic`` kernels, ``autotuned`` ones (``--gpu-cudnn-autotune``: benchmark mode for the
    warm-up), or ``autotuned_through_capture`` (benchmark mode kept on while the graphs are
    captured too)."""
    import torch

    from visionserve.backends.torch import TorchBackend
    from visionserve.config import load_model_config

    cfg = load_model_config(Path(model_dir) / "model.toml")
    b = TorchBackend()
    b.cudnn_autotune = how != "heuristic"
    torch.backends.cudnn.benchmark = how == "autotuned_through_capture"
    b.load(Path(model_dir) / "1" / "model.pt2", cfg, "cuda:0")
    t0 = time.time()
    b.warmup(cfg.batching.preferred_batch_sizes)
    out: dict = {"warmup_s": round(time.time() - t0, 2)}
    for bs in (1, 8, 32):
        out[bs] = round(cuda_time_ms(b._graphs[bs][0].replay, iters, b.stream), 3)
    b.close()
    return out


def bare(repos: dict[str, Path], jpegs: list[bytes], quick: bool) -> dict:
    import numpy as np
    import torch

    from visionserve import imaging
    from visionserve.backends.torch import TorchBackend
    from visionserve.config import load_model_config
    from visionserve.gpu.preprocess import TorchPreprocessor

    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    cfg = load_model_config(repos["rn50"] / "rn50" / "model.toml")
    b = TorchBackend()  # as the server loads it
    res["cudnn_autotune"] = b.cudnn_autotune
    b.load(repos["rn50"] / "rn50" / "1" / "model.pt2", cfg, "cuda:0")
    t0 = time.time()
    b.warmup(cfg.batching.preferred_batch_sizes)
    res["capture_s"] = round(time.time() - t0, 2)
    iters = 50 if quick else 200
    graph = {}
    for bs in (1, 8, 32):
        g = b._graphs[bs][0]
        ms = cuda_time_ms(g.replay, iters, b.stream)
        x = np.zeros((bs, 3, 224, 224), np.float32)
        with torch.cuda.stream(b.stream):
            xd = torch.zeros((bs, 3, 224, 224), dtype=torch.float16, device="cuda")
        graph[bs] = {"graph_replay_ms": round(ms, 3), "img_per_s": round(bs / ms * 1000),
                     "run_device_input": wall_ms(lambda xd=xd: b.run(xd), iters // 2),
                     "run_host_fp32_input": wall_ms(lambda x=x: b.run(x), iters // 4)}
    res["torch_fp16_cuda_graph"] = graph
    # cuDNN's kernel choice, each way in a process of its own (torch's plan cache is the
    # process's: a second load of the same shapes would reuse the first one's plans)
    ctx = mp.get_context("spawn")
    res["cudnn_kernels_graph_replay_ms"] = {}
    for how in ("heuristic", "autotuned", "autotuned_through_capture"):
        try:
            with ctx.Pool(1) as pool:
                res["cudnn_kernels_graph_replay_ms"][how] = pool.apply(
                    _graph_replay, (str(repos["rn50"] / "rn50"), how, iters))
        except Exception as exc:  # noqa: BLE001 -- recorded; the rest of the bench goes on
            res["cudnn_kernels_graph_replay_ms"][how] = repr(exc)[:300]
    with torch.cuda.stream(b.stream), torch.inference_mode():
        x1 = torch.zeros((1, 3, 224, 224), dtype=torch.float16, device="cuda"
                         ).contiguous(memory_format=torch.channels_last)
        res["torch_fp16_eager_bs1_ms"] = round(
            cuda_time_ms(lambda: b._module(x1), iters // 2, b.stream), 3)
    # preprocessing: 32 JPEG 640x480 -> 224x224 fp16 tensor
    frames = [imaging.encoded_frame(j) for j in (jpegs * 4)[:32]]
    prep = TorchPreprocessor.for_config(cfg, device="cuda:0", dtype=b.input_dtype, stream=b.stream,
                                        channels_last=True)
    prep.warmup((1, 8, 32))

    def gpu_prep():
        prep.prepare(frames, 32)
        b.stream.synchronize()

    res["prep_32_jpeg_640x480"] = {
        "gpu_nvjpeg_ms": wall_ms(gpu_prep, 20),
        "cpu_opencv_ms": wall_ms(lambda: imaging.prepare_batch(frames, cfg.input, 32), 3)}
    res["prep_1_jpeg_640x480"] = {
        "gpu_nvjpeg_ms": wall_ms(lambda: (prep.prepare(frames[:1], 1), b.stream.synchronize()), 50),
        "cpu_opencv_ms": wall_ms(lambda: imaging.prepare_batch(frames[:1], cfg.input, 1), 20)}
    b.close()
    torch.cuda.empty_cache()  # the servers started next need the memory
    try:
        import onnxruntime as ort

        if "CUDAExecutionProvider" in ort.get_available_providers():
            from visionserve.backends.onnx import OnnxBackend

            ocfg = load_model_config(repos["rn50-ort"] / "rn50-ort" / "model.toml")
            o = OnnxBackend()
            o.load(repos["rn50-ort"] / "rn50-ort" / "1" / "model.onnx", ocfg, "cuda:0")
            o.warmup((1, 32))
            out = {}
            for bs in (1, 8, 32):
                with torch.cuda.stream(o.stream):
                    xd = torch.zeros((bs, 3, 224, 224), dtype=torch.float32, device="cuda")
                w = wall_ms(lambda xd=xd: o.run(xd), iters // 2)
                out[bs] = {**w, "img_per_s": round(bs / w["p50_ms"] * 1000)}
            res["onnxruntime_fp32_iobinding"] = out
            o.close()
            torch.cuda.empty_cache()
        else:
            res["onnxruntime_fp32_iobinding"] = \
                f"skipped: providers {ort.get_available_providers()}"
    except ImportError as exc:
        res["onnxruntime_fp32_iobinding"] = f"skipped: {exc}"
    return res


# --- served ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


class Server:
    def __init__(self, models: Path, log_path: Path, *extra: str, device: str = "cuda",
                 env: dict[str, str] | None = None, log_level: str | None = "warning",
                 as_shipped: bool = False, module: str = "visionserve") -> None:
        """``log_level`` None: the server's own default; ``as_shipped``: the front ends and
        batch workers the server chooses itself, else none unless ``extra`` or ``env`` names
        them (each scenario says what it measures); ``module``: what ``python -m`` runs with
        ``serve`` (a tool that adds to the server first); ``startup_log``: what the server
        wrote until it was ready."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [sys.executable, "-m", module, "serve", "--models", str(models),
                "--device", device, "--host", "127.0.0.1", "--http-port", str(self.port),
                "--grpc-port", "-1", *(("--log-level", log_level) if log_level else ()), *extra]
        self._log = open(log_path, "ab")  # noqa: SIM115 -- the server's log; closed in stop()
        self._log.seek(0, os.SEEK_END)
        log_start = self._log.tell()
        settings = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        self._log.write(f"\n=== {settings + ' ' if settings else ''}{' '.join(args)}\n".encode())
        self._log.flush()
        fixed = {} if as_shipped else IN_PROCESS
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **fixed,
                                          **(env or {})})
        t0 = time.time()
        while time.time() - t0 < 240:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"server exited {self.proc.returncode}; see {log_path}")
            if get(self.url + "/v2/health/ready", 1)[0] == 200:
                self.start_s = round(time.time() - t0, 1)
                with open(log_path, "rb") as f:
                    f.seek(log_start)
                    self.startup_log = f.read(16384).decode("utf-8", "replace").splitlines()[1:]
                return
            time.sleep(0.25)
        self.stop()  # the caller never gets this object: do not leave the process behind
        raise RuntimeError(f"server not ready after 240 s; see {log_path}")

    def metrics(self, prefixes: tuple[str, ...] = ("visionserve_gpu_", "visionserve_batch_size_")
                ) -> dict[str, float]:
        _, body = get(self.url + "/metrics")
        out = {}
        for line in body.decode().splitlines():
            if line.startswith(prefixes):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stats(self, model: str) -> dict:
        return json.loads(get(f"{self.url}/v2/models/{model}/stats")[1] or b"{}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def _request(model: str, jpeg: bytes, protocol: str) -> tuple[str, bytes, dict[str, str]]:
    """``(path, body, headers)`` of one frame's request: the inspect API, or OIP v2 HTTP with the
    frame as a binary BYTES tensor (Triton's protocol, for peers that speak only that)."""
    if protocol == "oip":
        from visionserve_tools.benchclient.wire import oip_body

        header, blob = oip_body(jpeg, None)
        return (f"/v2/models/{model}/infer", header + blob,
                {"Content-Type": "application/octet-stream",
                 "Inference-Header-Content-Length": str(len(header))})
    return f"/v1/models/{model}/inspect", jpeg, {"Content-Type": "image/jpeg"}


def _client(args) -> dict:
    """One client process: ``threads`` closed-loop senders for ``duration`` seconds. Per 200
    answer its latency (and, from the inspect API, the server's ``timing``); every other answer
    counted by status and reason (:func:`~.benchclient.wire.error_reason`)."""
    import threading
    from collections import Counter

    from visionserve_tools.benchclient.wire import error_reason

    port, model, jpegs, duration, threads, protocol = args
    requests = [_request(model, j, protocol) for j in jpegs]
    lat: list[float] = []
    timing: list[tuple[float | None, ...]] = []  # the server's queue, compute, total ms
    failed: Counter[str] = Counter()
    batch_sizes: list[int] = []
    lock = threading.Lock()
    end = time.perf_counter() + duration

    def worker(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        i = k
        mine, sizes, times, errs = [], [], [], Counter[str]()
        while time.perf_counter() < end:
            path, body, headers = requests[i % len(requests)]
            i += 1
            t0 = time.perf_counter()
            try:
                conn.request("POST", path, body=body, headers=headers)
                r = conn.getresponse()
                data = r.read()
            except (OSError, http.client.HTTPException) as exc:
                errs[f"no answer: {type(exc).__name__}"] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                continue
            if r.status != 200:
                errs[error_reason(r.status, data)] += 1
                continue
            mine.append((time.perf_counter() - t0) * 1000)
            if protocol == "inspect":
                answer = json.loads(data)
                sizes.append(answer["batch_size"])
                t = answer.get("timing") or {}
                times.append((t.get("queue_ms"), t.get("compute_ms"), t.get("total_ms")))
        with lock:
            lat.extend(mine)
            batch_sizes.extend(sizes)
            timing.extend(times)
            failed.update(errs)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"lat": lat, "failed": failed, "batch_sizes": batch_sizes, "timing": timing}


def non_200(failed: dict[str, int]) -> dict:
    """Every answer that was not a 200, by status and by reason (``STATUS message``, or ``no
    answer: ERROR`` where the connection failed)."""
    by_status: dict[str, int] = {}
    for reason, n in failed.items():
        status = reason.split(" ", 1)[0] if reason[:1].isdigit() else "no answer"
        by_status[status] = by_status.get(status, 0) + n
    return {"by_status": dict(sorted(by_status.items())),
            "by_reason": dict(sorted(failed.items(), key=lambda kv: -kv[1]))}


def _p50(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def load(server, model: str, jpegs: list[bytes], processes: int, threads: int,
         duration: float, protocol: str = "inspect") -> dict:
    """Closed loop: ``processes`` x ``threads`` senders for ``duration`` s against ``server``
    (anything with a ``port`` on 127.0.0.1). ``errors``: answers other than 200, broken down in
    ``non_200``; ``timing_p50_ms`` (inspect API): the client's latency and the ``timing`` the
    server put in its answers, with what lies between them."""
    from collections import Counter

    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    with ctx.Pool(processes) as pool:
        parts = pool.map(_client, [(server.port, model, jpegs, duration, threads, protocol)]
                         * processes)
    wall = time.perf_counter() - t0
    failed: Counter[str] = Counter()
    for p in parts:
        failed.update(p["failed"])
    errors = {"errors": sum(failed.values()), "non_200": non_200(failed)}
    lat = sorted(x for p in parts for x in p["lat"])
    sizes = [x for p in parts for x in p["batch_sizes"]]
    if not lat:
        return {"clients": processes * threads, **errors, "answers": 0}

    def q(f: float) -> float:
        return round(lat[min(len(lat) - 1, int(f * len(lat)))], 3)

    out = {"clients": processes * threads, "answers": len(lat), **errors,
           "throughput_per_s": round(len(lat) / duration, 1), "wall_s": round(wall, 1),
           "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99), "max_ms": round(lat[-1], 3),
           "mean_batch_size": round(statistics.fmean(sizes), 2) if sizes else None}
    pairs = [(c, t) for p in parts for c, t in zip(p["lat"], p["timing"])
             if None not in t]
    if pairs:
        out["timing_p50_ms"] = {
            "client": _p50([c for c, _ in pairs]),
            "server_total": _p50([t[2] for _, t in pairs]),
            "queue": _p50([t[0] for _, t in pairs]),
            "compute": _p50([t[1] for _, t in pairs]),
            "verdict_to_answer": _p50([t[2] - t[0] - t[1] for _, t in pairs]),
            "outside_server": _p50([c - t[2] for c, t in pairs])}
    return out


def saturation(server, model: str, jpegs: list[bytes], processes: int, threads: int,
               duration: float, rate: float | None) -> dict:
    """``load``, with its throughput as a ratio to ``rate`` (the bare model's images/s at bs 32;
    None: no ratio)."""
    sat = load(server, model, jpegs, processes, threads, duration)
    if rate:
        sat["ratio_to_bare_bs32"] = round(sat.get("throughput_per_s", 0) / rate, 3)
    return sat


def model_bench_start(prog: str, doc: str | None, argv: list[str] | None, frontends: int,
                      add: Callable[[argparse.ArgumentParser], None] = lambda ap: None):
    """The command line and the record every model's GPU benchmark shares (benchdet,
    benchanomaly): ``(args, res, save)``, or None (said on stderr) where CUDA is absent."""
    ap = argparse.ArgumentParser(prog=f"python -m visionserve_tools.{prog}",
                                 description=(doc or "").splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--frontends", type=int, default=frontends)
    ap.add_argument("--client-processes", type=int, default=8)
    add(ap)
    args = ap.parse_args(argv)
    if cuda_missing(prog, args):
        return None
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv)}

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=2))

    return args, res, save


def cuda_missing(prog: str, args: argparse.Namespace) -> bool:
    """True, said in one line on stderr, where ``args`` ask for CUDA and the machine has none
    (everything but ``--as-shipped --device cpu`` does)."""
    if getattr(args, "as_shipped", False) and args.device != "cuda":
        return False
    import torch

    if torch.cuda.is_available():
        return False
    hint = "; on the CPU: --as-shipped --device cpu --quick" if hasattr(args, "device") else ""
    print(f"{prog}: needs a CUDA device{hint}", file=sys.stderr)
    return True


def served_runs(root: Path, model: str, jpegs: list[bytes], log_dir: Path, quick: bool,
                rate: float, frontends: int, procs: int, *extra: str,
                saturate_in_process: bool = True) -> dict:
    """One client (p50/p99) in the engine's process, then saturation with and without
    ``--frontends``, each as a ratio to ``rate`` (the bare model's images/s at bs 32); without
    ``saturate_in_process``, saturation only with ``--frontends`` (large frames: one process
    cannot read their bodies fast enough)."""
    dur = 5.0 if quick else 12.0
    out: dict = {}
    for fe in sorted({0, frontends}):
        s = Server(root, log_dir / f"{model}-server-fe{fe}.log", *extra,
                   *(("--frontends", str(fe)) if fe else ()))
        try:
            part: dict = {"start_s": s.start_s}
            if fe == 0:
                part["single_client"] = load(s, model, jpegs, 1, 1, 3.0 if quick else 8.0)
            if fe or saturate_in_process or not frontends:
                part["saturation"] = saturation(s, model, jpegs, procs, 12, dur, rate)
            out[f"frontends_{fe}"] = part
        finally:
            s.stop()
    return out


def sampled_load(server: Server, model: str, jpegs: list[bytes], processes: int, threads: int,
                 duration: float, raw: Path) -> dict:
    """``load``, with the serving process's threads sampled all through it
    (:mod:`visionserve_tools.threadstates`: what runs Python, what waits for the interpreter, for
    the GPU, for work). The sampling begins before the clients start (about a second of the
    window) and slows the server (by 9% on the CPU machine at the default 5 samples a second), so
    its throughput is not the saturation figure."""
    from visionserve_tools import threadstates

    rec = threadstates.start(server.proc.pid, 3600, raw)
    if isinstance(rec, str):  # no py-spy, or it could not attach: no load either (device time)
        log(f"threads of the serving process not sampled: {rec}")
        return {"threads": {"error": rec}}
    out = load(server, model, jpegs, processes, threads, duration)
    out["threads"] = threadstates.finish(rec, raw, stop=True)
    log("threads of the serving process at saturation:\n" + threadstates.table(out["threads"]))
    return out


def breakdown(before: dict, after: dict) -> dict:
    """Per-frame mean times from the OIP statistics deltas (queue, preprocessing, model, post)."""
    def part(name: str) -> float | None:
        try:
            a = after["model_stats"][0]["inference_stats"][name]
            b = before["model_stats"][0]["inference_stats"][name]
            n = a["count"] - b["count"]
            return round((a["ns"] - b["ns"]) / n / 1e6, 3) if n else None
        except (KeyError, IndexError, TypeError):
            return None
    return {"per_frame_mean_ms": {k: part(k) for k in ("queue", "compute_input", "compute_infer",
                                                       "compute_output", "success")},
            "note": "compute_* are per batch / frames in it: preprocessing (decode+resize+H2D), "
                    "model, postprocessing"}


def served(repos: dict[str, Path], jpegs: list[bytes], log_dir: Path, quick: bool, bare_res: dict,
           res: dict, save=lambda: None, frontends: int = 0, client_procs: int = 0,
           jpegs_1080: list[bytes] | None = None, threads_s: float = 0.0) -> dict:
    """Fills ``res`` phase by phase, calling ``save`` after each (a time limit loses little).
    ``threads_s``: also sample the serving process's threads through a saturating load of that
    many seconds with the front ends (:func:`sampled_load`), at 640x480 and 1080p.

    One server per scenario: the in-process front end (``--frontends 0``), then ``frontends``
    front-end processes (batching on, then ``--max-batch-size 1``, then onnxruntime). The
    allocator is read before and after all the load on the front-ends server (over 60 s).
    """
    dur = 5.0 if quick else 10.0
    long = 8.0 if quick else 25.0
    cpus = os.cpu_count() or 8
    procs = client_procs or min(8, max(2, cpus // 2))
    threads = 12
    fe = ("--frontends", str(frontends)) if frontends else ()
    res["setup"] = {"frontends": frontends, "client_processes": procs,
                    "threads_per_client_process": threads, "cpus": cpus}

    def single(server: Server, model: str) -> dict:
        return load(server, model, jpegs, 1, 1, 3.0 if quick else 6.0)

    # torch, batching on, the front end in the engine process (the previous design, for comparison)
    s = Server(repos["rn50"], log_dir / "server.log", "--gpu-memory-budget", "8GiB")
    try:
        res["torch_start_s"] = s.start_s
        st0 = s.stats("rn50")
        res["torch_single_client"] = single(s, "rn50")
        res["torch_single_client_breakdown"] = breakdown(st0, s.stats("rn50"))
        st0 = s.stats("rn50")
        res["torch_saturation"] = load(s, "rn50", jpegs, procs, threads, dur)
        res["torch_breakdown_at_saturation"] = breakdown(st0, s.stats("rn50"))
        save()
    finally:
        s.stop()
    if frontends:
        # torch, batching on, several front-end processes feeding the one engine
        s = Server(repos["rn50"], log_dir / "server.log", "--gpu-memory-budget", "8GiB", *fe)
        try:
            t_load0 = time.time()
            m0 = s.metrics()
            res["fe_single_client"] = single(s, "rn50")
            st0 = s.stats("rn50")
            res["fe_saturation"] = load(s, "rn50", jpegs, procs, threads, long)
            st1 = s.stats("rn50")
            res["fe_breakdown_at_saturation"] = breakdown(st0, st1)
            save()
            res["fe_saturation_2x_clients"] = load(s, "rn50", jpegs, procs, 2 * threads, dur)
            save()
            if threads_s:
                res["fe_threads_at_saturation"] = sampled_load(
                    s, "rn50", jpegs, procs, threads, threads_s, log_dir / "threads-640x480.raw")
                save()
            if jpegs_1080:
                st0 = s.stats("rn50")
                res["fe_saturation_1080p"] = load(s, "rn50", jpegs_1080, procs, threads, long)
                res["fe_breakdown_1080p"] = breakdown(st0, s.stats("rn50"))
                save()
                if threads_s and "error" not in res["fe_threads_at_saturation"]["threads"]:
                    res["fe_threads_at_saturation_1080p"] = sampled_load(
                        s, "rn50", jpegs_1080, procs, threads, threads_s,
                        log_dir / "threads-1080p.raw")
                    save()
            m1 = s.metrics()
            res["allocator"] = allocator(m0, m1, time.time() - t_load0)
            res["gpu_after_load"] = {k: v for k, v in m1.items()
                                     if "temperature" in k or "power" in k
                                     or ("throttle" in k and v)}
        finally:
            s.stop()
    if frontends and "rn50-i2" in repos:
        # two runner instances: two decode + compute pipelines on their own streams
        s = Server(repos["rn50-i2"], log_dir / "server.log", "--gpu-memory-budget", "8GiB", *fe)
        try:
            st0 = s.stats("rn50")
            res["fe_i2_saturation"] = load(s, "rn50", jpegs, procs, threads, dur)
            res["fe_i2_breakdown_at_saturation"] = breakdown(st0, s.stats("rn50"))
            if jpegs_1080:
                res["fe_i2_saturation_1080p"] = load(s, "rn50", jpegs_1080, procs, threads, dur)
            save()
        finally:
            s.stop()
    # torch, batching off
    s = Server(repos["rn50"], log_dir / "server.log", "--max-batch-size", "1", *fe)
    try:
        res["torch_single_client_bs1"] = single(s, "rn50")
        res["torch_saturation_bs1"] = load(s, "rn50", jpegs, procs, threads, dur)
        save()
    finally:
        s.stop()
    # onnxruntime
    if isinstance(bare_res.get("onnxruntime_fp32_iobinding"), dict):
        s = Server(repos["rn50-ort"], log_dir / "server.log", "--gpu-memory-budget", "8GiB", *fe)
        try:
            res["ort_single_client"] = single(s, "rn50-ort")
            res["ort_saturation"] = load(s, "rn50-ort", jpegs, procs, threads, dur)
            save()
        finally:
            s.stop()
    # ratios to the bare model (same run)
    g = bare_res.get("torch_fp16_cuda_graph", {})
    best = max((res[k] for k in ("fe_i2_saturation", "fe_saturation", "torch_saturation")
                if k in res),
               key=lambda r: r.get("throughput_per_s", 0))
    try:
        res["ratios"] = {
            "saturation_vs_bare_bs32_graph": round(
                best["throughput_per_s"] / g[32]["img_per_s"], 3),
            "in_process_saturation_vs_bare_bs32_graph": round(
                res["torch_saturation"]["throughput_per_s"] / g[32]["img_per_s"], 3),
            "single_p50_vs_bare_bs1_run_ms": round(res["torch_single_client"]["p50_ms"]
                                                   / g[1]["run_device_input"]["p50_ms"], 2),
            "batching_gain": round(best["throughput_per_s"]
                                   / max(1e-9, res["torch_saturation_bs1"]["throughput_per_s"]), 2),
        }
        hd = [res[k]["throughput_per_s"] for k in ("fe_saturation_1080p", "fe_i2_saturation_1080p")
              if k in res]
        if hd:
            res["ratios"]["saturation_1080p_vs_bare_bs32_graph"] = round(
                max(hd) / g[32]["img_per_s"], 3)
    except (KeyError, TypeError):
        pass
    return res


def settings_spec(spec: str) -> dict[str, str]:
    """``--compare``'s SPEC: ``""`` (as shipped) or ``NAME=VALUE[,NAME=VALUE...]``, each NAME a
    server setting's environment variable (``VISIONSERVE_...``), or ``CODE=DIR``: the server's
    code from DIR, a folder holding the ``visionserve`` package of another commit (``git archive
    COMMIT visionserve | tar -x -C DIR``), for an A/B of code on one machine."""
    env: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not (name.startswith("VISIONSERVE_") or name == "CODE"):
            raise argparse.ArgumentTypeError(
                f"{part!r}: a setting is VISIONSERVE_NAME=VALUE (e.g. "
                "VISIONSERVE_SWITCH_INTERVAL_MS=0.05) or CODE=DIR")
        if name == "CODE" and not (Path(value) / "visionserve" / "__init__.py").is_file():
            raise argparse.ArgumentTypeError(f"{part!r}: {value} holds no visionserve package")
        env[name] = value
    return env


def server_env(spec: dict[str, str]) -> dict[str, str]:
    """A SPEC's environment for the server: ``CODE=DIR`` puts DIR first on its path, and keeps
    ``python -m`` from putting the working directory before it (PYTHONSAFEPATH)."""
    env = {k: v for k, v in spec.items() if k != "CODE"}
    if "CODE" in spec:
        env["PYTHONSAFEPATH"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, (str(Path(spec["CODE"]).resolve()), os.environ.get("PYTHONPATH"))))
    return env


def compare(specs: list[dict[str, str]], repos: dict[str, Path], jpegs: list[bytes],
            jpegs_1080: list[bytes], log_dir: Path, quick: bool, bare_res: dict, res: dict,
            save=lambda: None, frontends: int = 8, client_procs: int = 0,
            threads_s: float = 0.0, *, threads: tuple[int, ...] = (12,), model: str = "rn50",
            device: str = "cuda", extra: tuple[str, ...] = ("--gpu-memory-budget", "8GiB"),
            seconds: float | None = None) -> dict:
    """The front-end scenario of :func:`served` once per server setting in ``specs``, in order,
    each on a server of its own: one client, saturation at 640x480 and at 1080p (and, with
    ``threads_s``, the threads sampled at 640x480), each saturation as a ratio to the bare model's
    batch-32 throughput of this run. ``threads``: senders per client process, one saturation
    per count at each size (the first as ``saturation_SIZE``, the others as
    ``saturation_SIZE@CLIENTS``): a deeper pipeline may need more closed-loop clients to fill
    its batches. ``res`` gets one entry per spec, saved after each. (``model``, ``device``,
    ``extra`` server arguments and ``seconds`` per load: for a test.)"""
    long = seconds or (8.0 if quick else 20.0)
    short = seconds or (3.0 if quick else 6.0)
    procs = client_procs or min(8, max(2, (os.cpu_count() or 8) // 2))
    rate = bare_res.get("torch_fp16_cuda_graph", {}).get(32, {}).get("img_per_s")
    res["setup"] = {"frontends": frontends, "client_processes": procs,
                    "threads_per_client_process": list(threads), "bare_bs32_img_per_s": rate}
    for i, env in enumerate(specs):
        name = ",".join(f"{k}={v}" for k, v in env.items()) or "as shipped"
        key = f"{i}: {name}"
        part: dict = {"settings": env}
        res[key] = part
        log(f"compare {key}")
        try:
            # VISIONSERVE_FRONTENDS in a spec is the number of front ends (0: in-process)
            fe = () if "VISIONSERVE_FRONTENDS" in env else ("--frontends", str(frontends))
            s = Server(repos[model], log_dir / f"compare-{i}.log", *extra, *fe, device=device,
                       env=server_env(env))
        except RuntimeError as exc:  # a setting the server refuses: said, and the next one runs
            part["error"] = str(exc)
            save()
            continue
        try:
            part["start_s"] = s.start_s
            st0 = s.stats(model)
            part["single_client"] = load(s, model, jpegs, 1, 1, short)
            part["single_client"]["breakdown"] = breakdown(st0, s.stats(model))
            for label, frames in (("640x480", jpegs), ("1080p", jpegs_1080)):
                for k, n in enumerate(threads):
                    st0 = s.stats(model)
                    sat = saturation(s, model, frames, procs, n, long, rate)
                    sat["breakdown"] = breakdown(st0, s.stats(model))
                    part[f"saturation_{label}" + (f"@{procs * n}" if k else "")] = sat
                    save()
            if threads_s:
                part["threads_640x480"] = sampled_load(s, model, jpegs, procs, threads[0],
                                                       threads_s,
                                                       log_dir / f"threads-compare-{i}.raw")
            log(f"compare {key}: " + json.dumps({
                k: {m: v.get(m) for m in ("throughput_per_s", "ratio_to_bare_bs32", "p50_ms",
                                           "p99_ms", "mean_batch_size")}
                for k, v in part.items() if isinstance(v, dict) and "answers" in v}))
        finally:
            s.stop()
            save()
    return res


def allocator(before: dict, after: dict, seconds: float) -> dict:
    return {
        "load_window_s": round(seconds, 1),
        "new_segments_after_ready_before_load":
            before.get("visionserve_gpu_allocator_new_segments"),
        "new_segments_after_load": after.get("visionserve_gpu_allocator_new_segments"),
        "reserved_bytes_before": before.get("visionserve_gpu_memory_reserved_bytes"),
        "reserved_bytes_after": after.get("visionserve_gpu_memory_reserved_bytes"),
        "process_used_bytes_after": after.get("visionserve_gpu_memory_used_bytes"),
        "budget_bytes": after.get("visionserve_gpu_memory_budget_bytes"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m visionserve_tools.benchgpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchgpu.json"),
                    help="the results, JSON (default: benchgpu.json)")
    ap.add_argument("--log-dir", type=Path, default=None,
                    help="the servers' logs (default: --out's folder)")
    ap.add_argument("--quick", action="store_true", help="shorter phases")
    ap.add_argument("--skip-served", action="store_true", help="the bare model only")
    ap.add_argument("--frontends", type=int, default=None,
                    help="front-end processes for the multi-process scenarios (default: cores/2, "
                         "at most 8)")
    ap.add_argument("--client-procs", type=int, default=0,
                    help="load generator processes (default: cores/2)")
    ap.add_argument("--threads-s", type=float, default=0.0,
                    help="also sample the serving process's threads (py-spy, "
                         "visionserve_tools.threadstates) through a saturating load of this many "
                         "seconds with the front ends, at 640x480 and at 1080p [off]")
    ap.add_argument("--compare", action="append", type=settings_spec, default=None,
                    metavar="SPEC",
                    help="instead of the served scenarios: the front-end scenario (with "
                         "--as-shipped: that mode, after the server as shipped) once per SPEC, a "
                         "server setting as its environment variable (\"\": as shipped; "
                         "VISIONSERVE_SWITCH_INTERVAL_MS=0.05; several joined by commas; "
                         "CODE=DIR: the server's code from DIR, a folder holding another "
                         "commit's visionserve package); repeat for each")
    ap.add_argument("--compare-threads", type=int, nargs="+", default=[12], metavar="N",
                    help="with --compare: senders per client process, a saturation load for "
                         "each count (default: 12; e.g. 12 24)")
    from visionserve_tools import benchshipped

    benchshipped.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.as_shipped and cuda_missing("benchgpu", args):
        return 2
    log_dir = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def save() -> None:
        args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")

    if args.as_shipped:
        results["as_shipped"] = {}
        with tempfile.TemporaryDirectory(prefix="benchgpu-") as tmp:
            repos = {} if args.models else export_models(Path(tmp), ("rn50",))
            benchshipped.run(args, repos.get("rn50", Path(tmp)), "rn50",
                             {"640x480": make_jpegs(), "1080p": make_jpegs(16, 1080, 1920)},
                             args.compare or [], log_dir, args.client_procs,
                             results["as_shipped"], save)
        results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        save()
        return 0
    with tempfile.TemporaryDirectory(prefix="benchgpu-") as tmp:
        repos = export_models(Path(tmp))
        jpegs = make_jpegs()
        results["jpeg_bytes_mean"] = int(statistics.fmean(len(j) for j in jpegs))
        try:
            results["bare"] = bare(repos, jpegs, args.quick)
        except Exception as exc:  # noqa: BLE001 -- keep going: the served figures are still worth having
            results["bare"] = {"error": repr(exc)}
        save()
        log(f"bare: {json.dumps(results['bare'])[:600]}")
        fe = args.frontends if args.frontends is not None \
            else min(8, max(2, (os.cpu_count() or 4) // 2))
        if args.compare:
            results["compare"] = {}
            try:
                compare(args.compare, repos, jpegs, make_jpegs(16, 1080, 1920), log_dir,
                        args.quick, results["bare"], results["compare"], save, frontends=fe,
                        client_procs=args.client_procs, threads_s=args.threads_s,
                        threads=tuple(args.compare_threads))
            except Exception as exc:  # noqa: BLE001 -- recorded in the results, which are saved
                results["compare_error"] = repr(exc)
            save()
        elif not args.skip_served:
            try:
                results["served"] = {}
                served(repos, jpegs, log_dir, args.quick, results["bare"], results["served"], save,
                       frontends=fe, client_procs=args.client_procs,
                       jpegs_1080=make_jpegs(16, 1080, 1920), threads_s=args.threads_s)
            except Exception as exc:  # noqa: BLE001 -- recorded in the results, which are saved
                results["served_error"] = repr(exc)
            save()
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    print(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
