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


# --- EXIF orientation and boxes in the padding on the GPU decode path ----------------------------

#: a 480x320 scene with one red part in its top-left quarter (frame pixels 48..168, 32..128)
EXIF_RED = (48, 32, 168, 128)


def colour_detector(root: Path) -> str:
    """The colour-window detector of tests/tools/detmodels.py (its ``padding`` variant: a
    96x64 letterboxed input; some boxes land wholly in the padding of a 1:2 frame), exported for
    the torch backend, so that detections are filtered and suppressed on the device."""
    from tests.tools import detmodels as dm

    folder = root / "colours"
    (folder / "1").mkdir(parents=True)
    net = dm.yolo_module(96, 64, escape=True).eval()
    ep = torch.export.export(net, (torch.rand(2, 3, 64, 96),), dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1, max=64)},))
    torch.export.save(ep, str(folder / "1" / "model.pt2"))
    output = "\n".join(('format = "yolo"', *dm.NMS, dm._labels()))
    folder.joinpath("model.toml").write_text(
        dm.toml("detection", 96, 64, "letterbox", output, "colour windows")
        + '[runtime]\nbackend = "torch"\nprecision = "fp32"\n')
    return "colours"


def serve_frames(root: Path, device: str, bodies: list[bytes]) -> tuple[list, list[float], dict]:
    """Each JPEG answered alone by an engine on ``device``: (results, boxes dropped as
    degenerate while each was answered, the GPU preprocessor's decoder counts; {} on the CPU)."""
    import asyncio

    from visionserve import imaging
    from visionserve.config import ServerSettings
    from visionserve.engine import Engine
    from visionserve.tasks.detection import DEGENERATE

    async def scenario():
        settings = ServerSettings(models=root, device="cuda" if device != "cpu" else "cpu")
        engine = Engine(settings, device=device)
        await engine.start()
        try:
            runner = engine.served[("colours", 1)].runners[0]
            prep = getattr(runner.prepare, "__self__", None)
            before = dict(prep.counts) if prep is not None else {}
            results, dropped = [], []
            for body in bodies:
                n = DEGENERATE.labels("colours")._value.get()
                _, [r] = await engine.infer("colours", None, [imaging.encoded_frame(body)])
                results.append(r)
                dropped.append(DEGENERATE.labels("colours")._value.get() - n)
            counts = {k: v - before[k] for k, v in prep.counts.items()} if prep else {}
            return results, dropped, counts
        finally:
            await engine.close()

    return asyncio.run(scenario())


def test_exif_tagged_jpegs_are_decoded_by_nvjpeg_as_stored_and_padding_boxes_dropped(tmp_path):
    """On the GPU decode path a JPEG tagged EXIF Orientation=6 goes to nvJPEG (not the CPU
    decoder) and is answered on its stored pixels: the untagged file's boxes, in the 480x320 of
    its header, on the red part, as the CPU path answers it. A frame whose best boxes lie in the
    letterbox padding: clipped to the frame they have no width, and the device-side filter drops
    and counts them as the host path does."""
    import cv2

    from tests.tools import detmodels as dm
    from tests.tools import jpegs

    colour_detector(tmp_path)
    scene = dm.scene(480, 320, [("red", 0.1, 0.1, 0.35, 0.4)])
    plain = jpegs.baseline(scene, quality=95)
    tagged = jpegs.with_orientation(plain, 6)
    padding = jpegs.baseline(dm.scene(240, 480, [("red", 0.0, 0.05, 0.5, 0.95)]), quality=95)
    # the tag is real: a decoder that applies it turns the frame
    assert cv2.imdecode(np.frombuffer(tagged, np.uint8), cv2.IMREAD_COLOR).shape[:2] == (480, 320)
    gpu, gpu_dropped, counts = serve_frames(tmp_path, "cuda:0", [plain, tagged, padding])
    assert counts["nvjpeg"] == 3 and counts["cpu_decoded"] == 0, counts
    cpu, cpu_dropped, _ = serve_frames(tmp_path, "cpu", [plain, tagged, padding])

    def boxes(r) -> list[tuple[str, float, tuple]]:
        return [(d.label, d.score, d.box) for d in r.result.detections]

    for path in (gpu, cpu):
        p, t = boxes(path[0]), boxes(path[1])
        assert [x[0] for x in t] == [x[0] for x in p] and t, (p, t)
        assert np.allclose([x[1:2] + x[2] for x in t], [x[1:2] + x[2] for x in p], atol=1e-4)
        x1, y1, x2, y2 = max(path[1].result.detections, key=lambda d: d.score).box
        cx, cy = (x1 + x2) / 2, (y1 + y2) / 2  # on the red part of the stored pixels
        assert EXIF_RED[0] <= cx <= EXIF_RED[2] and EXIF_RED[1] <= cy <= EXIF_RED[3], (x1, y1)
        for d in path[1].result.detections:
            assert 0 <= d.box[0] < d.box[2] <= 480 and 0 <= d.box[1] < d.box[3] <= 320
        for d in path[2].result.detections:  # the padding frame: no box of no size
            assert d.box[2] > d.box[0] and d.box[3] > d.box[1] and d.area > 0, d
    # the GPU's decoder differs from the CPU's by a level or two: the same labels, and the best
    # red boxes in the same place
    assert {d.label for d in gpu[1].result.detections} == \
        {d.label for d in cpu[1].result.detections}
    best = [max(r[1].result.detections, key=lambda d: d.score).box for r in (gpu, cpu)]
    a, b = np.asarray(best[0]), np.asarray(best[1])
    inter = np.prod(np.clip(np.minimum(a[2:], b[2:]) - np.maximum(a[:2], b[:2]), 0, None))
    union = np.prod(a[2:] - a[:2]) + np.prod(b[2:] - b[:2]) - inter
    assert inter / union >= 0.5, best
    assert gpu_dropped[2] == cpu_dropped[2] >= 5, (gpu_dropped, cpu_dropped)
    assert gpu_dropped[:2] == cpu_dropped[:2] == [0, 0]
