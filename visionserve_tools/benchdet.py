"""GPU benchmark of a YOLO-class detector (issue 17): bare model and served, in one run.

``python -m visionserve_tools.benchdet --out FILE.json [--quick]`` on a CUDA machine:

- the model: the project's own anchor-free detector (``visionserve_tools/training/detector.py``)
  at YOLOv8n's scale: 640x640 input, 80 classes, widths 32..512, 8400 anchors, a raw head
  ``[N, 84, 8400]`` served as ``format = "yolo"`` (torch backend, fp16, CUDA graphs). Its
  weights are random: speed does not depend on them, and the post-processing is measured at a
  typical score threshold and at 0.001 (an evaluation's: every anchor a candidate);
- frames: 1080p JPEGs of the synthetic surfaces with defects (letterboxed to 640);
- bare: CUDA graph replay of batches of 1 and 32 (images/s), no decode, no post-processing;
- post-processing per frame, on the device (torch + torchvision ``batched_nms``) against the host
  (numpy + OpenCV NMS), for a batch of 32 real outputs;
- served: one closed-loop client (p50/p99, front end in the engine's process), then saturation
  (96 closed-loop clients, ``--frontends 8``: one process cannot read 1080p bodies fast
  enough), as a ratio to the bare model's bs-32 rate measured above;
- the annotated JPEG (``Accept: image/jpeg``): decode, draw, encode of a 1080p frame, per frame.

``--as-shipped [--runs 3] [--compare SPEC]``: instead, the server with no tuning flag under one
client and 96 and 288 clients at 640x480 and 1080p, against the bare model of the same run, every
non-200 answer by status and reason (``visionserve_tools.benchshipped``; on the CPU:
``--device cpu --quick``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from . import benchshipped
from .benchgpu import cuda_time_ms, log, model_bench_start, served_runs, settings_spec, wall_ms

LABELS = [f"class{i}" for i in range(80)]
SIZE = 640
WIDTHS = (32, 64, 128, 256)  # strides 2 to 16; the stride-32 stage: TOP
TOP = 512
NECK = 128

TOML = """\
name = "yolo640"
task = "detection"
[input]
tensor_name = "images"
width = {size}
height = {size}
resize = "letterbox"
interpolation = "linear"
mean = [0.0, 0.0, 0.0]
std = [1.0, 1.0, 1.0]
[output]
format = "yolo"
labels = {labels}
score_threshold = {threshold}
iou_threshold = 0.45
max_detections = 100
[batching]
max_batch_size = 32
preferred_batch_sizes = [1, 2, 4, 8, 16, 32]
max_queue_delay_ms = 2.0
max_queue_size = 512
takt_ms = 200.0
dispatch_when_idle = true
[runtime]
backend = "torch"
precision = "fp16"
"""


def export_model(root: Path, threshold: float = 0.25) -> Path:
    """The detector as ``root/yolo640`` (model.toml + 1/model.pt2); returns ``root``."""
    import torch

    from .training.detector import Detector

    torch.manual_seed(0)
    net = Detector(len(LABELS), SIZE, SIZE, widths=WIDTHS, top=TOP, neck=NECK).eval()
    folder = root / "yolo640"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "model.toml").write_text(TOML.format(size=SIZE, labels=json.dumps(LABELS),
                                                   threshold=threshold))
    x = torch.randn(2, 3, SIZE, SIZE)
    ep = torch.export.export(net, (x,), dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1, max=1024)},))
    torch.export.save(ep, str(folder / "1" / "model.pt2"))
    params = sum(p.numel() for p in net.parameters())
    log(f"exported the 640x640 detector ({params / 1e6:.2f} M parameters)")
    return root


def make_jpegs(n: int = 16, size: tuple[int, int] = (1920, 1080)) -> list[bytes]:
    from . import synthetic

    labels = [x for x in synthetic.LABELS if x != "ok"]
    return [synthetic.encode(synthetic.generate(labels[i % len(labels)], 100 + i, size=size),
                             "jpeg", 90) for i in range(n)]


def bare(root: Path, jpegs: list[bytes], quick: bool) -> dict:
    import numpy as np
    import torch

    from visionserve import tasks
    from visionserve.backends.checks import Subject
    from visionserve.backends.torch import TorchBackend
    from visionserve.config import ModelConfig, load_model_config
    from visionserve.tasks.detection import DetectionConfig

    path = root / "yolo640" / "1" / "model.pt2"
    cfg = load_model_config(root / "yolo640" / "model.toml")
    b = TorchBackend()
    b.load(path, cfg, "cuda:0")
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    task = tasks.create(cfg)
    b.select_outputs(task.bind(Subject(path), b.outputs), on_device=True)
    t0 = time.time()
    b.warmup(cfg.batching.preferred_batch_sizes)
    res["capture_s"] = round(time.time() - t0, 2)
    iters = 30 if quick else 100
    graph = {}
    for bs in (1, 32):
        ms = cuda_time_ms(b._graphs[bs][0].replay, iters, b.stream)
        graph[bs] = {"graph_replay_ms": round(ms, 3), "img_per_s": round(bs / ms * 1000)}
    res["bare_torch_fp16_cuda_graph"] = graph
    # post-processing of a batch of 32, on the device and on the host, at two thresholds
    with torch.cuda.stream(b.stream):
        x = torch.rand((32, 3, SIZE, SIZE), device="cuda", dtype=b.input_dtype)
    sizes = [(1920, 1080)] * 32
    post = {}
    assert isinstance(cfg, DetectionConfig)
    for thr in (0.25, 0.001):
        tcfg = ModelConfig.model_validate(
            cfg.model_dump() | {"output": cfg.output.model_dump() | {"score_threshold": thr}})
        t = tasks.create(tcfg)
        t.bind(Subject(path), b.outputs)
        outs = b.run(x)  # device tensors (on_device)

        def on_device(t=t, outs=outs) -> None:
            with torch.cuda.stream(b.stream):
                t.postprocess(outs, slice(0, 32), sizes)

        host = {k: v.float().cpu().numpy() for k, v in outs.items()}
        dev = wall_ms(on_device, 20 if quick else 50)
        cpu = wall_ms(lambda t=t, host=host: t.postprocess(host, slice(0, 32), sizes), 5)
        found = sum(len(r.detections) for _, r in t.postprocess(host, slice(0, 32), sizes))
        cand = int((np.asarray(host[next(iter(host))])[:, 4:].max(1) >= thr).sum())
        post[str(thr)] = {"device_ms_per_frame": round(dev["p50_ms"] / 32, 4),
                          "host_ms_per_frame": round(cpu["p50_ms"] / 32, 4),
                          "candidates_per_frame": round(cand / 32, 1),
                          "detections_per_frame": round(found / 32, 1)}
    res["postprocess_batch32"] = post
    b.close()
    torch.cuda.empty_cache()
    return res


def annotate_cost(root: Path, jpegs: list[bytes]) -> dict:
    """Decode + draw + encode of one 1080p frame with 20 detections, ms (host CPU)."""
    import numpy as np

    from visionserve import imaging, tasks
    from visionserve.backends.checks import Subject, TensorSpec
    from visionserve.config import load_model_config
    from visionserve.execution.results import FrameResult
    from visionserve.http.inspect import annotated

    cfg = load_model_config(root / "yolo640" / "model.toml")
    t = tasks.create(cfg)
    t.bind(Subject(root / "yolo640" / "1" / "model.pt2"), [TensorSpec("out", None, None)])
    rng = np.random.default_rng(0)
    head = np.zeros((1, 84, 8400), np.float32)
    head[0, 0:2] = rng.uniform(40, 600, (2, 8400))
    head[0, 2:4] = rng.uniform(10, 60, (2, 8400))
    head[0, 4 + rng.integers(0, 80, 20), rng.integers(0, 8400, 20)] = 0.9
    (verdict, det), = t.postprocess({"out": head}, slice(0, 1), [(1920, 1080)])
    frame = imaging.encoded_frame(jpegs[0])
    r = FrameResult(verdict, det, 1, 0.0, 0.0, 0.0, True)
    w = wall_ms(lambda: annotated(t, frame, r), 20)
    return {"detections": len(det.detections), **w}


def _arguments(ap) -> None:
    benchshipped.add_arguments(ap)
    ap.add_argument("--compare", action="append", type=settings_spec, default=None,
                    metavar="SPEC",
                    help="with --as-shipped: after the server as shipped, once per SPEC, a "
                         "server setting as its environment variable (CODE=DIR: the server's "
                         "code from DIR; as benchgpu's --compare); repeat for each")


def main(argv: list[str] | None = None) -> int:
    started = model_bench_start("benchdet", __doc__, argv, frontends=8, add=_arguments)
    if started is None:
        return 2
    args, res, save = started

    if args.as_shipped:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "repo"
            if args.models is None:
                export_model(root)
            res["as_shipped"] = {}
            benchshipped.run(args, root, "yolo640",
                             {"640x480": make_jpegs(16, (640, 480)), "1080p": make_jpegs()},
                             args.compare or [], args.out.parent, args.client_processes,
                             res["as_shipped"], save)
        log(f"wrote {args.out}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        root = export_model(Path(tmp) / "repo")
        jpegs = make_jpegs()
        res["frames"] = {"count": len(jpegs), "size": "1920x1080",
                         "mean_jpeg_bytes": sum(map(len, jpegs)) // len(jpegs)}
        res["bare"] = bare(root, jpegs, args.quick)
        save()
        res["annotate_1080p"] = annotate_cost(root, jpegs)
        save()
        rate = res["bare"]["bare_torch_fp16_cuda_graph"][32]["img_per_s"]
        res.update(served_runs(root, "yolo640", jpegs, args.out.parent, args.quick, rate,
                               args.frontends, args.client_processes, "--gpu-memory-budget",
                               "16GiB", saturate_in_process=False))
        save()
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
