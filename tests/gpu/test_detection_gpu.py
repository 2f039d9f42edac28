"""Detection and segmentation post-processing on the GPU (issue 17): the torch backend leaves the
head on the device (CUDA graphs), the task filters and runs ``batched_nms`` there; the answers
must equal the host path's (numpy + OpenCV NMS) on the same outputs, frame by frame, also when
frames left the batch (rows picked out of it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from visionserve import tasks
from visionserve.backends.checks import Subject
from visionserve.backends.torch import TorchBackend
from visionserve.config import ModelConfig
from visionserve.tasks.segmentation import rle_decode

SIZE = 96


class SegHead(torch.nn.Module):
    """The project's detector plus 8 mask coefficients per anchor and 8 prototypes."""

    def __init__(self, nc: int) -> None:
        super().__init__()
        from visionserve_tools.training.detector import Detector

        self.det = Detector(nc, SIZE, SIZE)
        self.coef = torch.nn.Conv2d(3, 8, 8, stride=8)
        self.proto = torch.nn.Conv2d(3, 8, 4, stride=4)

    def forward(self, x):
        head = self.det(x)  # [B, 4+nc, A]
        a = head.shape[2]
        c = torch.nn.functional.adaptive_avg_pool1d(self.coef(x).flatten(2), a) * 4
        return torch.cat([head, c], 1), self.proto(x)


def spread(det) -> None:
    """Random class heads that score anchors across (0, 1) instead of all near the training
    prior (0.01): no near-ties in the ordering, and NMS has overlaps to settle."""
    with torch.no_grad():
        for head in det.cls:
            torch.nn.init.normal_(head[-1].weight, std=0.3)
            torch.nn.init.zeros_(head[-1].bias)


def export(tmp: Path, seg: bool) -> tuple[Path, ModelConfig]:
    torch.manual_seed(0)
    if seg:
        net = SegHead(3).eval()
    else:
        from visionserve_tools.training.detector import Detector

        net = Detector(3, SIZE, SIZE).eval()
    spread(net.det if seg else net)
    x = torch.rand(2, 3, SIZE, SIZE)
    ep = torch.export.export(net, (x,), dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1, max=64)},))
    path = tmp / ("seg" if seg else "det") / "1" / "model.pt2"
    path.parent.mkdir(parents=True)
    torch.export.save(ep, str(path))
    cfg = ModelConfig.model_validate({
        "task": "segmentation" if seg else "detection",
        "input": {"width": SIZE, "height": SIZE, "resize": "letterbox"},
        "output": {"format": "yolo-seg" if seg else "yolo", "labels": ["a", "b", "c"],
                   "score_threshold": 0.3, "iou_threshold": 0.5, "max_detections": 50},
        "batching": {"max_batch_size": 8, "preferred_batch_sizes": [1, 8]},
        "runtime": {"backend": "torch", "precision": "fp32"}})
    return path, cfg


def answers(results):
    out = []
    for verdict, r in results:
        out.append((verdict, [(d.label, d.score, d.box, d.area) for d in r.detections]))
    return out


@pytest.mark.parametrize("seg", [False, True], ids=["yolo", "yolo-seg"])
def test_device_postprocess_equals_the_host_path(tmp_path, seg):
    path, cfg = export(tmp_path, seg)
    backend = TorchBackend()
    backend.load(path, cfg, "cuda:0")
    task = tasks.create(cfg)
    backend.select_outputs(task.bind(Subject(path), backend.outputs), on_device=True)
    backend.warmup((1, 8))
    host_task = tasks.create(cfg)
    host_task.bind(Subject(path), backend.outputs)
    rng = np.random.default_rng(0)
    x = rng.random((8, 3, SIZE, SIZE), dtype=np.float32)
    sizes = [(160 + 16 * i, 120 + 8 * i) for i in range(8)]
    for rows in (slice(0, 8), [6, 1, 3]):
        picked = sizes if isinstance(rows, slice) else [sizes[i] for i in rows]
        with torch.cuda.stream(backend.stream):
            out = backend.run(x)
            assert all(t.is_cuda for t in out.values())
            device = task.postprocess(out, rows, picked)
            host = {k: v.cpu().numpy() for k, v in out.items()}
        expect = host_task.postprocess(host, rows, picked)
        got, want = answers(device), answers(expect)
        assert sum(len(d) for _, d in want) > 10  # NMS had work to do
        assert [(v, [d[0] for d in ds]) for v, ds in got] == \
            [(v, [d[0] for d in ds]) for v, ds in want]
        for (_, g), (_, w) in zip(got, want):
            for dg, dw in zip(g, w):
                assert dg[1] == pytest.approx(dw[1], abs=1e-5)
                assert np.allclose(dg[2], dw[2], atol=1e-3)
        if seg:  # masks assembled on the device equal the host's
            for (_, a), (_, b) in zip(device, expect):
                for da, db in zip(a.detections, b.detections):
                    ma, mb = rle_decode(da.mask), rle_decode(db.mask)
                    assert (ma != mb).sum() <= max(2, 0.01 * mb.sum())
    backend.close()
