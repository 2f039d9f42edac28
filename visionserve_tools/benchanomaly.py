"""GPU benchmark of the shipped anomaly model (issue 18): bare model, served, and fit time.

``python -m visionserve_tools.benchanomaly --out FILE.json [--quick]`` on a CUDA machine, from
the repository root (it reads ``models/surface-anomaly`` and the classifier's weights):

- the model: ``models/surface-anomaly`` (PatchCore-style, 160x160, a 4096-row memory bank),
  served by the torch backend in fp16 with CUDA graphs (the distances stay fp32 in the graph);
- bare: CUDA graph replay of batches of 1 and 32 (images/s), no decode, no post-processing;
- post-processing on the host per frame (normalisation, regions, frame pixels) for a batch of
  32 real outputs of 640x480 frames;
- served: one closed-loop client (p50/p99), then saturation (many clients), in the engine's
  process and with ``--frontends N``, as a ratio to the bare model's bs-32 rate above;
- fit: ``visionserve anomaly fit`` on 200 generated good 640x480 images (features, coreset and
  calibration on the GPU, the export on the CPU), its seconds and memory bank.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .benchgpu import cuda_time_ms, log, model_bench_start, served_runs, wall_ms

MODEL = "surface-anomaly"


def make_repo(src: Path, root: Path) -> Path:
    """A copy of the shipped model served by torch in fp16 (model.toml's [runtime] edited)."""
    from visionserve.verdicts import edit_section

    dst = root / MODEL
    shutil.copytree(src, dst)
    toml = dst / "model.toml"
    text = edit_section(toml.read_text(), "runtime", {"backend": "torch", "precision": "fp16"})
    toml.write_text(edit_section(text, "batching", {"max_queue_size": 1024}))
    return root


def make_jpegs(n: int = 16, size: tuple[int, int] = (640, 480)) -> list[bytes]:
    from . import synthetic

    labels = synthetic.LABELS
    return [synthetic.encode(synthetic.generate(labels[i % len(labels)], 300 + i, size=size),
                             "jpeg", 90) for i in range(n)]


def bare(root: Path, quick: bool) -> dict:
    import torch

    from visionserve import tasks
    from visionserve.backends.checks import Subject
    from visionserve.backends.torch import TorchBackend
    from visionserve.config import load_model_config

    cfg = load_model_config(root / MODEL / "model.toml")
    path = root / MODEL / "1" / "model.pt2"
    b = TorchBackend()
    b.load(path, cfg, "cuda:0")
    task = tasks.create(cfg)
    b.select_outputs(task.bind(Subject(path), b.outputs), on_device=False)
    res: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    t0 = time.time()
    b.warmup(cfg.batching.preferred_batch_sizes)
    res["capture_s"] = round(time.time() - t0, 2)
    iters = 30 if quick else 100
    graph = {}
    for bs in (1, 32):
        ms = cuda_time_ms(b._graphs[bs][0].replay, iters, b.stream)
        graph[bs] = {"graph_replay_ms": round(ms, 3), "img_per_s": round(bs / ms * 1000)}
    res["bare_torch_fp16_cuda_graph"] = graph
    with torch.cuda.stream(b.stream):
        x = torch.rand((32, 3, cfg.input.height, cfg.input.width), device="cuda",
                       dtype=b.input_dtype)
    outs = b.run(x)
    host = {k: (v.float().cpu().numpy() if hasattr(v, "cpu") else v) for k, v in outs.items()}
    sizes = [(640, 480)] * 32
    post = wall_ms(lambda: task.postprocess(host, slice(0, 32), sizes), 10 if quick else 30)
    res["postprocess_host_ms_per_frame_bs32"] = round(post["p50_ms"] / 32, 4)
    b.close()
    torch.cuda.empty_cache()
    return res


def fit_time(tmp: Path, n: int, device: str) -> dict:
    import cv2

    from . import synthetic
    from .training import patchcore

    good = tmp / "good"
    good.mkdir()
    t0 = time.time()
    for i in range(n):
        img = synthetic.generate("ok", synthetic._item_seed(18, i), (640, 480))
        cv2.imwrite(str(good / f"ok_{i:04d}.png"), img)
    gen_s = time.time() - t0
    t0 = time.time()
    result = patchcore.fit(patchcore.FitOptions(good=good, name="fit-bench",
                                                models_dir=tmp / "models", device=device,
                                                command="benchanomaly"),
                           patchcore.Progress(enabled=False))
    r = result.report
    return {"images": n, "device": device, "generate_s": round(gen_s, 1),
            "fit_s": round(time.time() - t0, 1), "memory_bank_rows": r["memory_bank_rows"],
            "memory_bank_bytes": r["memory_bank_bytes"], "patches": r["patches"],
            "export_s": r["seconds"]["export"]}


def main(argv: list[str] | None = None) -> int:
    def options(ap: argparse.ArgumentParser) -> None:
        ap.add_argument("--model-dir", type=Path, default=Path("models") / MODEL)
        ap.add_argument("--fit-images", type=int, default=200, help="0: no fit timing")

    started = model_bench_start("benchanomaly", __doc__, argv, frontends=4, add=options)
    if started is None:
        return 2
    args, res, save = started

    with tempfile.TemporaryDirectory() as tmp:
        root = make_repo(args.model_dir, Path(tmp) / "repo")
        jpegs = make_jpegs()
        res["frames"] = {"count": len(jpegs), "size": "640x480",
                         "mean_jpeg_bytes": sum(map(len, jpegs)) // len(jpegs)}
        res["bare"] = bare(root, args.quick)
        save()
        rate = res["bare"]["bare_torch_fp16_cuda_graph"][32]["img_per_s"]
        res["served"] = served_runs(root, MODEL, jpegs, args.out.parent, args.quick, rate,
                                    args.frontends, args.client_processes,
                                    "--gpu-memory-budget", "16GiB")
        save()
        if args.fit_images:
            res["fit"] = fit_time(Path(tmp), args.fit_images, "cuda")
            save()
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
