"""Small detection and segmentation models whose answers a test can predict, exported with plain
torch to ONNX (dynamic batch axis), each with its ``model.toml``: one of every output format of
issue 17.

Every model sees colour, and nothing else. A pixel's *coverage* of class c (red, green, blue: the
model's RGB channels) is ``relu(x_c - max(other channels))``: 1 on a pure colour, 0 on grey, white
or black (and on the letterbox's grey padding). The candidates are a fixed set of square windows
(anchors) over the input at a few sizes and strides; a window's class score is its mean coverage,
times a per-anchor factor in [0.9, 1] and a per-class factor, so no two scores tie (ties would let
two correct NMS implementations keep different boxes). A window's box moves towards the coloured
part of the window and shrinks with the coloured share (and moves by up to a pixel with the
brightness), so boxes too depend on the frame, are off the integer grid, and overlap their
neighbours by IoUs spread around the NMS threshold. Frames with coloured rectangles drawn at
known places therefore give detections of the rectangles' colours where they are drawn, with
overlapping windows that NMS must suppress; a frame answered with another frame's outputs, or a
box mapped back to the frame wrongly, does not pass for the right one.

Segmentation: YOLO-seg prototypes are the coverage maps at a quarter of the input's resolution
(plus a constant and a brightness map), and a detection's mask coefficients pick its class's
map, so a mask is the rectangle's shape within the box; semantic logits are the coverage maps at
half resolution against a constant background logit.

    python -m tests.tools.detmodels /tmp/repo      # write every model here, to serve by hand
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np

LABELS = ("red", "green", "blue")
#: window sizes and strides (input pixels) of the candidates of the NMS formats: overlapping
#: windows at stride 4 (IoU 0.6 with their neighbour: NMS at 0.45 suppresses it)
NMS_SCALES = ((8, 8), (16, 4), (32, 8))
#: the candidates of the formats that come out of the model final (end2end, boxes): no two
#: overlap by IoU 0.45, so a server that ran NMS on them again would change nothing
FINAL_SCALES = ((8, 8), (16, 8))
#: the anchors of the ``degenerate`` variant whose boxes are broken: zero width, negative
#: height, NaN centre (the first three 8x8 windows of the top row)
DEGENERATE = {0: "zero width", 1: "negative height", 2: "NaN centre"}
#: the ``padding`` variant (a 96x64 input) moves the boxes of its 8x8 windows at x = 32..40 by
#: this many pixels to the left: for a frame letterboxed into x = 32..64 (one of aspect 1:2)
#: they lie wholly in the padding, as a real model's can, and are clipped to no width
ESCAPE_X, ESCAPE_SHIFT = 32, -16.0
MASK_COEFFS = 32

BATCHING = """\
[batching]
max_batch_size = 8
preferred_batch_sizes = [1, 2, 4, 8]
max_queue_delay_ms = 2
takt_ms = 20000
"""


def anchors(width: int, height: int, scales: Sequence[tuple[int, int]]) -> np.ndarray:
    """``[A, 4]`` x1, y1, x2, y2 of every window, in the order the model flattens its pooled
    maps: scale by scale, then row by row."""
    out = []
    for size, stride in scales:
        for y in range(0, height - size + 1, stride):
            for x in range(0, width - size + 1, stride):
                out.append((x, y, x + size, y + size))
    return np.asarray(out, dtype=np.float32)


def anchor_factors(n: int) -> np.ndarray:
    """Per-anchor score factors in [0.9, 1), all different (golden-ratio steps)."""
    return (0.9 + 0.1 * ((np.arange(n) * 0.6180339887498949) % 1.0)).astype(np.float32)


#: per-class score factors: a window half red, half green is not a tie
CLASS_FACTORS = (1.0, 0.987, 0.974)


def _torch():
    import torch

    return torch


def coverage(x):
    """``[B, 3, H, W]`` RGB in [0, 1] -> ``[B, 3, H, W]``: how purely each pixel is each colour."""
    torch = _torch()
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    return torch.relu(torch.cat([r - torch.maximum(g, b), g - torch.maximum(r, b),
                                 b - torch.maximum(r, g)], dim=1))


def _module(width: int, height: int, scales: Sequence[tuple[int, int]], degenerate: bool = False,
            escape: bool = False):
    """The candidate generator shared by every format: ``forward(x) -> (cxcywh [B, 4, A],
    scores [B, 3, A])``."""
    torch = _torch()
    F = torch.nn.functional
    base = anchors(width, height, scales)
    n = len(base)

    class Candidates(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            cx, cy = (base[:, 0] + base[:, 2]) / 2, (base[:, 1] + base[:, 3]) / 2
            size = base[:, 2] - base[:, 0]
            self.register_buffer("base", torch.from_numpy(np.stack([cx, cy, size, size])))
            w = anchor_factors(n)[None, :] * np.asarray(CLASS_FACTORS, np.float32)[:, None]
            self.register_buffer("factors", torch.from_numpy(w.astype(np.float32)))
            fix = np.ones((4, n), np.float32)
            shift = np.zeros((4, n), np.float32)
            if degenerate:
                fix[2, 0] = 0.0  # zero width
                fix[3, 1] = -1.0  # negative height
                shift[0, 2] = math.nan  # NaN centre
            if escape:  # the first scale's windows at x = ESCAPE_X: boxes into the padding
                size, stride = scales[0]
                per_row = (width - size) // stride + 1
                shift[0, ESCAPE_X // stride::per_row][:(height - size) // stride + 1] = \
                    ESCAPE_SHIFT
            self.register_buffer("fix", torch.from_numpy(fix))
            self.register_buffer("shift", torch.from_numpy(shift))
            ys, xs = np.mgrid[0:height, 0:width].astype(np.float32) + 0.5
            self.register_buffer("xs", torch.from_numpy(xs)[None, None])
            self.register_buffer("ys", torch.from_numpy(ys)[None, None])

        def pooled(self, m):
            return torch.cat([F.avg_pool2d(m, s, t).flatten(2) for s, t in scales], dim=2)

        def forward(self, x):
            m = coverage(x)
            cov = self.pooled(m)  # [B, 3, A]
            # the box moves towards the coloured part of its window and shrinks with its share
            # (a crude regression), so neighbouring boxes overlap by all sorts of IoU
            t = m.sum(dim=1, keepdim=True)
            share = self.pooled(t)  # [B, 1, A]
            tx = self.pooled(t * self.xs) - self.base[0:1] * share
            ty = self.pooled(t * self.ys) - self.base[1:2] * share
            bright = self.pooled(x.mean(dim=1, keepdim=True)) - 0.5  # [B, 1, A], in [-0.5, 0.5]
            grow = 0.6 + 0.4 * share + 0.1 * bright
            d = torch.cat([tx / (share + 0.05) + 2 * bright, ty / (share + 0.05) - 2 * bright,
                           self.base[2:3] * grow, self.base[3:4] * grow], dim=1)
            centre = self.base[:2].unsqueeze(0) + d[:, :2]
            boxes = torch.cat([centre, d[:, 2:]], dim=1) * self.fix + self.shift
            return boxes, cov * self.factors

    return Candidates()


def _xyxy(cxcywh):
    """``[B, 4, A]`` centre, size -> ``[B, A, 4]`` corners."""
    torch = _torch()
    cx, cy, w, h = cxcywh.unbind(1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], dim=2)


def _top(scores, k: int):
    """Best class and score of each anchor, then the ``k`` best anchors: (score, class, index)."""
    torch = _torch()
    best, cls = scores.max(dim=1)  # [B, A]
    top, idx = torch.topk(best, k, dim=1)
    return top, torch.gather(cls, 1, idx), idx


def _gather_rows(xyxy, idx):
    return _torch().gather(xyxy, 1, idx.unsqueeze(2).expand(-1, -1, 4))


def _on_candidates(cand, head, name: str):
    """A module giving ``head(boxes, scores, x)`` of the candidate windows ``cand`` finds."""
    torch = _torch()

    class Head(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cand = cand

        def forward(self, x):
            boxes, scores = self.cand(x)
            return head(boxes, scores, x)

    Head.__name__ = Head.__qualname__ = name
    return Head()


def yolo_module(width: int, height: int, transposed: bool = False, degenerate: bool = False,
                escape: bool = False):
    """``[B, 4+nc, A]`` (``transposed``: ``[B, A, 4+nc]``): cx, cy, w, h, class scores."""
    torch = _torch()
    cand = _module(width, height, NMS_SCALES, degenerate, escape)

    def head(boxes, scores, x):
        out = torch.cat([boxes, scores], dim=1)
        return out.transpose(1, 2) if transposed else out

    return _on_candidates(cand, head, "Yolo")


def objectness_module(width: int, height: int):
    """``[B, A, 5+nc]``: cx, cy, w, h, objectness (the window's coloured share), then each class's
    part of it, so that objectness x class = the class's score."""
    torch = _torch()
    cand = _module(width, height, NMS_SCALES)

    def head(boxes, scores, x):
        obj = scores.sum(dim=1, keepdim=True).clamp(max=1.0)
        cls = scores / (obj + 1e-6)
        return torch.cat([boxes, obj, cls], dim=1).transpose(1, 2)

    return _on_candidates(cand, head, "Objectness")


def end2end_module(width: int, height: int, k: int = 12, floor: float = 0.2):
    """``[B, K, 6]`` x1, y1, x2, y2, score, class of the K best windows (NMS-free candidates:
    :data:`FINAL_SCALES`); rows under ``floor`` are all zero, as exporters pad."""
    torch = _torch()
    cand = _module(width, height, FINAL_SCALES)

    def head(boxes, scores, x):
        top, cls, idx = _top(scores, k)
        rows = torch.cat([_gather_rows(_xyxy(boxes), idx), top.unsqueeze(2),
                          cls.unsqueeze(2).to(top.dtype)], dim=2)
        return rows * (top >= floor).unsqueeze(2).to(top.dtype)

    return _on_candidates(cand, head, "End2End")


def end2end_flat_module(width: int, height: int, k: int = 12, floor: float = 0.2):
    """YOLOv7's onnxruntime end-to-end export: ``[M, 7]`` rows of batch index, x1, y1, x2, y2,
    class, score for the whole batch (the K best windows of each frame scoring ``floor`` or
    more; M varies with the frames), so a server must route rows to frames by their index."""
    torch = _torch()
    cand = _module(width, height, FINAL_SCALES)

    def head(boxes, scores, x):
        top, cls, idx = _top(scores, k)
        frame = torch.arange(x.shape[0], dtype=top.dtype).unsqueeze(1) * torch.ones_like(top)
        rows = torch.cat([frame.unsqueeze(2), _gather_rows(_xyxy(boxes), idx),
                          cls.unsqueeze(2).to(top.dtype), top.unsqueeze(2)], dim=2)
        rows = rows.reshape(-1, 7)
        return rows[rows[:, 6] >= floor]

    return _on_candidates(cand, head, "End2EndFlat")


def boxes_module(width: int, height: int, k: int = 10, count_floor: float = 0.92):
    """Named outputs ``boxes [B, K, 4]`` (x1, y1, x2, y2), ``scores [B, K]``, ``classes [B, K]``
    int64 and ``num [B]`` int32: the K best windows (NMS-free candidates), of which the first
    ``num`` (those scoring ``count_floor`` or more) are valid. Rows past ``num`` are *not* zero:
    they hold the next windows, some scoring over the served threshold, so a server that read
    past the count would answer them."""
    torch = _torch()
    cand = _module(width, height, FINAL_SCALES)

    def head(boxes, scores, x):
        top, cls, idx = _top(scores, k)
        num = (top >= count_floor).sum(dim=1).to(torch.int32)
        return _gather_rows(_xyxy(boxes), idx), top, cls, num

    return _on_candidates(cand, head, "Boxes")


def yolo_seg_module(width: int, height: int):
    """``output0 [B, 4+nc+32, A]`` (cx, cy, w, h, class scores, mask coefficients) and
    ``output1 [B, 32, H/4, W/4]`` prototypes. Prototypes 0-2 are the red, green and blue
    coverage at a quarter resolution, 3 is ones, 4 the brightness, the rest brightness times
    fixed patterns; a detection's coefficients are 12 x its class shares on 0-2, -6 on the ones
    and small fixed values on the rest: its mask is where its colour covers more than half."""
    torch = _torch()
    F = torch.nn.functional
    cand = _module(width, height, NMS_SCALES)
    ph, pw = height // 4, width // 4
    rng = np.random.default_rng(17)
    patterns = rng.uniform(-1, 1, (MASK_COEFFS - 5, ph, pw)).astype(np.float32)
    small = rng.uniform(-0.05, 0.05, (MASK_COEFFS - 5, 1)).astype(np.float32)

    class YoloSeg(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cand = cand
            self.register_buffer("patterns", torch.from_numpy(patterns))
            self.register_buffer("small", torch.from_numpy(small))

        def forward(self, x):
            boxes, scores = self.cand(x)
            cov = F.avg_pool2d(coverage(x), 4)  # [B, 3, h, w]
            bright = F.avg_pool2d(x.mean(dim=1, keepdim=True), 4)
            protos = torch.cat([cov, bright * 0 + 1, bright,
                                bright * self.patterns.unsqueeze(0)], dim=1)
            share = scores / (scores.sum(dim=1, keepdim=True) + 1e-6)  # [B, 3, A]
            one = share[:, :1] * 0 + 1  # [B, 1, A] (ones_like would lose the static shape)
            coeffs = torch.cat([12 * share, -6.0 * one, 0.02 * one,
                                self.small.unsqueeze(0) * one], dim=1)
            return torch.cat([boxes, scores, coeffs], dim=1), protos

    return YoloSeg()


def semantic_module(width: int, height: int):
    """``[B, 1+nc, H/2, W/2]`` logits: background 0, class c ``10 x coverage - 5 + 0.1 c`` at half
    resolution (a pixel is its colour's where the colour covers about half or more)."""
    torch = _torch()
    F = torch.nn.functional

    class Semantic(torch.nn.Module):
        def forward(self, x):
            cov = F.avg_pool2d(coverage(x), 2)
            bias = torch.tensor([-5.0, -4.9, -4.8]).reshape(1, 3, 1, 1)
            return torch.cat([torch.zeros_like(cov[:, :1]), 10 * cov + bias], dim=1)

    return Semantic()


def export(module, folder: Path, width: int, height: int, outputs: Sequence[str],
           toml: str) -> Path:
    """``folder/1/model.onnx`` (input ``images`` NCHW float32, dynamic batch) and
    ``folder/model.toml``. Returns ``folder``."""
    torch = _torch()
    (folder / "1").mkdir(parents=True, exist_ok=True)
    axes = {"images": {0: "batch"}, **{o: {0: "batch"} for o in outputs}}
    if tuple(outputs) == ("output",):  # YOLOv7's [M, 7]: rows, not frames
        axes["output"] = {0: "rows"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.rand(2, 3, height, width),),
                          str(folder / "1" / "model.onnx"), input_names=["images"],
                          output_names=list(outputs), dynamic_axes=axes, opset_version=17,
                          dynamo=False)
    (folder / "model.toml").write_text(toml)
    return folder


def toml(task: str, width: int, height: int, resize: str, output: str,
         description: str = "") -> str:
    return (f'task = "{task}"\ndescription = "{description}"\n'
            f'[input]\nwidth = {width}\nheight = {height}\nresize = "{resize}"\n'
            f"pad_value = 114\n[output]\n{output}\n{BATCHING}")


def _labels(labels: Sequence[str] = LABELS) -> str:
    return "labels = [" + ", ".join(f'"{x}"' for x in labels) + "]"


NMS = ("score_threshold = 0.3", "iou_threshold = 0.45")

#: name -> (builder, input width, height, resize, [output] lines other than the labels)
DETECTORS: dict[str, tuple[str, int, int, str, tuple[str, ...]]] = {
    "det-yolo": ("yolo", 96, 64, "letterbox", ('format = "yolo"', *NMS, "max_detections = 40")),
    "det-yolo-t": ("yolo-t", 64, 64, "stretch", ('format = "yolo"', *NMS)),
    "det-objectness": ("objectness", 64, 96, "center_crop",
                       ('format = "yolo-objectness"', *NMS, "class_agnostic_nms = true",
                        "max_detections = 300")),
    "det-end2end": ("end2end", 96, 64, "letterbox",
                    ('format = "end2end"', "score_threshold = 0.3", "max_detections = 8")),
    "det-end2end-v7": ("end2end-v7", 64, 64, "center_crop",
                       ('format = "end2end"', "score_threshold = 0.3")),
    "det-boxes": ("boxes", 64, 64, "stretch",
                  ('format = "boxes"', 'boxes_tensor = "boxes"', 'scores_tensor = "scores"',
                   'classes_tensor = "classes"', 'count_tensor = "num"',
                   "score_threshold = 0.3")),
    "det-degenerate": ("degenerate", 96, 64, "letterbox", ('format = "yolo"', *NMS)),
    "det-padding": ("padding", 96, 64, "letterbox", ('format = "yolo"', *NMS)),
}

SEGMENTERS: dict[str, tuple[str, int, int, str, tuple[str, ...]]] = {
    "seg-yolo": ("yolo-seg", 96, 64, "letterbox",
                 ('format = "yolo-seg"', *NMS, "max_detections = 40")),
    "seg-semantic": ("semantic", 96, 64, "letterbox", ('format = "semantic"',)),
    "seg-semantic-crop": ("semantic", 64, 64, "center_crop", ('format = "semantic"',)),
}

#: builder name -> (module factory (width, height), output names)
BUILDERS = {
    "yolo": (lambda w, h: yolo_module(w, h), ("output0",)),
    "yolo-t": (lambda w, h: yolo_module(w, h, transposed=True), ("output0",)),
    "degenerate": (lambda w, h: yolo_module(w, h, degenerate=True), ("output0",)),
    "padding": (lambda w, h: yolo_module(w, h, escape=True), ("output0",)),
    "objectness": (objectness_module, ("output0",)),
    "end2end": (end2end_module, ("output0",)),
    "end2end-v7": (end2end_flat_module, ("output",)),
    "boxes": (boxes_module, ("boxes", "scores", "classes", "num")),
    "yolo-seg": (yolo_seg_module, ("output0", "output1")),
    "semantic": (semantic_module, ("logits",)),
}

SEMANTIC_LABELS = ("background", *LABELS)


def make(name: str, folder: Path, output: str | None = None,
         labels: Sequence[str] | None = None, task: str | None = None) -> Path:
    """Write model ``name`` (of :data:`DETECTORS` or :data:`SEGMENTERS`) to ``folder``;
    ``output`` (its [output] lines but the labels), ``labels`` and ``task`` replace the model's
    own, to make a model.toml that does not fit its model."""
    entry = DETECTORS.get(name) or SEGMENTERS[name]
    builder, width, height, resize, lines = entry
    task = task or ("detection" if name in DETECTORS else "segmentation")
    if labels is None:
        labels = SEMANTIC_LABELS if builder == "semantic" else LABELS
    if output is None:
        output = "\n".join(lines)
        if builder == "semantic" and labels[0] == "background":
            output += '\nbackground = "background"'
    factory, outputs = BUILDERS[builder]
    text = toml(task, width, height, resize, f"{output}\n{_labels(labels)}",
                description=f"test model: {builder} format, colour windows")
    return export(factory(width, height), folder, width, height, outputs, text)


def make_repo(root: Path, names: Sequence[str]) -> Path:
    for name in names:
        make(name, root / name)
    return root


# --- frames -----------------------------------------------------------------------------------

#: BGR of each label's pure colour
BGR = {"red": (0, 0, 255), "green": (0, 255, 0), "blue": (255, 0, 0)}


def scene(width: int, height: int, rects: Sequence[tuple[str, float, float, float, float]],
          background: int = 114) -> np.ndarray:
    """A grey BGR frame with filled rectangles ``(label, x1, y1, x2, y2)`` (fractions of the
    frame's width and height), drawn in order."""
    img = np.full((height, width, 3), background, np.uint8)
    for label, x1, y1, x2, y2 in rects:
        img[round(y1 * height):round(y2 * height), round(x1 * width):round(x2 * width)] = BGR[label]
    return img


THREE = [("red", 0.10, 0.15, 0.40, 0.50), ("green", 0.50, 0.55, 0.70, 0.90),
         ("blue", 0.72, 0.10, 0.95, 0.40)]
#: red and green side by side, blue drawn over red's corner: windows of different classes
#: overlap, so class-aware and class-agnostic NMS keep different boxes
TOUCHING = [("red", 0.10, 0.20, 0.50, 0.60), ("green", 0.50, 0.20, 0.90, 0.60),
            ("blue", 0.35, 0.50, 0.60, 0.85)]

#: name -> (width, height, rectangles, encoding)
FRAMES = {
    "landscape": (640, 480, THREE, ".png"),
    "portrait": (360, 480, THREE, ".png"),
    "banner": (1000, 300, THREE, ".jpg"),  # JPEG: the reference decodes the same bytes
    "touching": (500, 500, TOUCHING, ".png"),
    "small": (48, 40, [("green", 0.15, 0.2, 0.85, 0.8)], ".png"),  # smaller than every input
    "empty": (320, 240, [], ".png"),
}
MEDIA = {".png": "image/png", ".jpg": "image/jpeg"}


def encoded(name: str) -> bytes:
    """Frame ``name`` of :data:`FRAMES` as a client sends it."""
    w, h, rects, ext = FRAMES[name]
    ok, buf = _cv2().imencode(ext, scene(w, h, rects))
    assert ok
    return buf.tobytes()


def decoded(name: str) -> np.ndarray:
    """The frame as the server sees it (the same decoder, on the same bytes)."""
    cv2 = _cv2()
    return cv2.imdecode(np.frombuffer(encoded(name), np.uint8), cv2.IMREAD_COLOR)


def _cv2():
    import cv2

    return cv2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path)
    p.add_argument("--models", nargs="*", default=[*DETECTORS, *SEGMENTERS])
    args = p.parse_args()
    make_repo(args.root, args.models)
    print(f"wrote {', '.join(args.models)} to {args.root}")


if __name__ == "__main__":
    main()


def encoded_frames() -> list[bytes]:
    """Every frame of :data:`FRAMES`, encoded, in order."""
    return [encoded(f) for f in FRAMES]


def expectations(repo: Path, models: Sequence[str]):
    """``get(model, frame)`` -> the reference's objects for a frame of :data:`FRAMES`, computed
    once each (``get.refs``: the :class:`detref.Reference` of each model)."""
    from tests.tools import detref

    refs = {m: detref.Reference(repo / m) for m in models}
    cache: dict[tuple[str, str], list[detref.Det]] = {}

    def get(model: str, frame: str) -> list[detref.Det]:
        if (model, frame) not in cache:
            cache[model, frame] = refs[model](decoded(frame))
        return cache[model, frame]

    get.refs = refs  # type: ignore[attr-defined]
    return get
