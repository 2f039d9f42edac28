"""The team's own compact anchor-free detector: network, label assignment and loss (torch).

Network: the shipped classifier's conv-BN-ReLU network (:func:`.common.build_model`, started
from its weights) to stride 16 and one more stage (a stride-2 conv and a residual block) to
stride 32, a top-down feature pyramid over strides 8, 16 and 32, and per stride a decoupled head
in the YOLO manner: one branch for the class scores, one for the box. Each grid cell's centre is
an anchor point; the box branch gives the distances from it to the box's four sides (softplus,
in strides), the class branch one logit per class. ``forward`` decodes both into the served
``yolo`` format, ``[B, 4 + nc, A]``: centre x, centre y, width, height in model-input pixels, then
the class scores after the sigmoid, so the exported graph needs no code of ours to be read.

Training assigns ground-truth boxes to anchor points by task alignment (TOOD, Feng et al. 2021:
score^alpha * IoU^beta among the points inside a box, the top k per box); the class target is
that alignment, normalised per box to its best IoU, so that a score ranks boxes by their quality
(what mAP rewards); the box loss is GIoU. Written from the papers; no code of other detectors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

STRIDES = (8, 16, 32)
DEFAULT_WIDTHS = (16, 32, 64, 128)         # the classifier's stages: strides 2, 4, 8, 16
DEFAULT_TOP = 128                          # the stride-32 stage
DEFAULT_NECK = 48                          # channels of the pyramid and the heads
PRIOR = 0.01                               # initial class probability (focal-loss style bias)


def _cbr(cin: int, cout: int, k: int = 3, stride: int = 1) -> nn.Sequential:
    # ReLU: SiLU's backward ran ~5x slower on the 2-core CPU this was trained on
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class _Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.body = nn.Sequential(_cbr(c, c), _cbr(c, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def _head(cin: int, cout: int, bias: float) -> nn.Sequential:
    last = nn.Conv2d(cin, cout, 1)
    assert last.bias is not None
    nn.init.constant_(last.bias, bias)
    return nn.Sequential(_cbr(cin, cin), last)


class Detector(nn.Module):
    """``Detector(nc, width, height)``: NCHW float input of that size (each side a multiple of 32)
    -> ``[B, 4 + nc, A]`` (A = the anchor points of strides 8, 16, 32).

    The backbone to stride 16 is the shipped classifier's network
    (:func:`visionserve_tools.training.common.build_model`'s features, ``widths`` per stage), so
    training can start from its weights (:func:`init_backbone`); one more stage (``top``
    channels, a stride-2 conv and a residual block) reaches stride 32."""

    points: torch.Tensor    # [A, 2] anchor points (x, y) in input pixels
    strides: torch.Tensor   # [A] their strides

    def __init__(self, num_classes: int, width: int, height: int,
                 widths: Sequence[int] = DEFAULT_WIDTHS, top: int = DEFAULT_TOP,
                 neck: int = DEFAULT_NECK, in_channels: int = 3) -> None:
        super().__init__()
        from .common import build_model

        if width % STRIDES[-1] or height % STRIDES[-1]:
            raise ValueError(f"input {width}x{height}: each side must be a multiple of "
                             f"{STRIDES[-1]}")
        if len(widths) != 4:
            raise ValueError(f"widths: 4 stages (strides 2, 4, 8, 16), got {list(widths)}")
        self.num_classes = num_classes
        backbone = build_model(1, widths, in_channels)[0]
        assert isinstance(backbone, nn.Sequential)
        self.backbone = backbone
        # build_model: a 3-layer stem, then 6 layers (two conv-BN-ReLU) per stage; strides 8 and
        # 16 are the ends of its third and fourth stages
        self.taps = (3 + 6 * 3, 3 + 6 * 4)
        self.down = nn.Sequential(_cbr(widths[-1], top, stride=2), _Residual(top))
        # the pyramid: 1x1 laterals from strides 8, 16, 32; top-down sums, each smoothed
        self.lateral = nn.ModuleList(_cbr(c, neck, k=1) for c in (widths[2], widths[3], top))
        self.smooth = nn.ModuleList(_cbr(neck, neck) for _ in STRIDES[:-1])
        prior = -math.log((1 - PRIOR) / PRIOR)
        self.cls = nn.ModuleList(_head(neck, num_classes, prior) for _ in STRIDES)
        # softplus(1.5) ~ 1.7 strides to each side at the start
        self.box = nn.ModuleList(_head(neck, 4, 1.5) for _ in STRIDES)
        points, strides = [], []
        for s in STRIDES:
            ys, xs = torch.meshgrid(torch.arange(height // s), torch.arange(width // s),
                                    indexing="ij")
            points.append(torch.stack([xs, ys], -1).reshape(-1, 2).float().add(0.5).mul(s))
            strides.append(torch.full((points[-1].shape[0],), float(s)))
        # constants of the graph, not weights (the input size is fixed by model.toml)
        self.register_buffer("points", torch.cat(points), persistent=False)
        self.register_buffer("strides", torch.cat(strides), persistent=False)

    def raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (class logits ``[B, nc, A]``, side distances ``[B, 4, A]`` in input pixels:
        left, top, right, bottom)."""
        feats = []
        for i, layer in enumerate(self.backbone):
            x = layer(x)
            if i + 1 in self.taps:
                feats.append(x)                   # strides 8, 16
        feats.append(self.down(x))                # stride 32
        p = self.lateral[2](feats[2])
        pyramid = [p]
        for i in (1, 0):
            p = self.smooth[i](self.lateral[i](feats[i])
                               + F.interpolate(p, scale_factor=2.0, mode="nearest"))
            pyramid.insert(0, p)
        logits = torch.cat([h(f).flatten(2) for h, f in zip(self.cls, pyramid)], 2)
        dist = torch.cat([F.softplus(h(f)).flatten(2) for h, f in zip(self.box, pyramid)], 2)
        return logits, dist * self.strides

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, dist = self.raw(x)
        # slices and one concat (not unbind/stack): the ONNX graph then declares [B, 4+nc, A]
        lt, rb = dist[:, :2], dist[:, 2:]
        centre = self.points.t() + (rb - lt) * 0.5
        return torch.cat([centre, lt + rb, torch.sigmoid(logits)], 1)


def distances_to_boxes(points: torch.Tensor, dist: torch.Tensor) -> torch.Tensor:
    """``[A, 2]`` points and ``[B, 4, A]`` side distances -> ``[B, A, 4]`` x1, y1, x2, y2."""
    d = dist.transpose(1, 2)
    return torch.cat([points - d[..., :2], points + d[..., 2:]], -1)


def box_iou_pairs(a: torch.Tensor, b: torch.Tensor, giou: bool = False) -> torch.Tensor:
    """IoU (or GIoU) of boxes paired element by element, ``[..., 4]`` x1y1x2y2 each."""
    iw = (torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
    ih = (torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])).clamp(min=0)
    inter = iw * ih
    area_a = (a[..., 2] - a[..., 0]).clamp(min=0) * (a[..., 3] - a[..., 1]).clamp(min=0)
    area_b = (b[..., 2] - b[..., 0]).clamp(min=0) * (b[..., 3] - b[..., 1]).clamp(min=0)
    union = area_a + area_b - inter + 1e-7
    iou = inter / union
    if not giou:
        return iou
    cw = torch.maximum(a[..., 2], b[..., 2]) - torch.minimum(a[..., 0], b[..., 0])
    ch = torch.maximum(a[..., 3], b[..., 3]) - torch.minimum(a[..., 1], b[..., 1])
    hull = cw * ch + 1e-7
    return iou - (hull - union) / hull


class Targets:
    """A batch's ground truth, padded: ``boxes [B, M, 4]`` x1y1x2y2 in input pixels,
    ``labels [B, M]`` class indices, ``valid [B, M]`` bool (M = most boxes of any image)."""

    def __init__(self, boxes: Sequence[torch.Tensor], labels: Sequence[torch.Tensor]) -> None:
        n, m = len(boxes), max([len(b) for b in boxes] + [1])
        self.boxes = torch.zeros(n, m, 4)
        self.labels = torch.zeros(n, m, dtype=torch.long)
        self.valid = torch.zeros(n, m, dtype=torch.bool)
        for i, (b, c) in enumerate(zip(boxes, labels)):
            self.boxes[i, :len(b)] = b
            self.labels[i, :len(c)] = c
            self.valid[i, :len(b)] = True

    def to(self, device: torch.device | str) -> Targets:
        """The same ground truth on ``device`` (where the model trains)."""
        self.boxes, self.labels, self.valid = (t.to(device) for t in
                                               (self.boxes, self.labels, self.valid))
        return self


@torch.no_grad()
def assign(scores: torch.Tensor, pred: torch.Tensor, points: torch.Tensor, strides: torch.Tensor,
           gt: Targets, topk: int = 10, alpha: float = 0.5, beta: float = 6.0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Task-aligned assignment. ``scores [B, A, nc]`` (probabilities), ``pred [B, A, 4]``.

    A point is a candidate for a box if it lies inside it, or within one of its own strides of
    the box's centre (so a box smaller than the grid still gets points). Among candidates,
    alignment = score(box's class)^alpha * IoU^beta; each box takes its top ``topk``; a point
    claimed by two boxes goes to the one it overlaps most.

    -> (foreground ``[B, A]`` bool, target boxes ``[B, A, 4]``, class targets ``[B, A, nc]``:
    the alignment scaled so that each box's best point gets its best IoU).
    """
    b, a, nc = scores.shape
    m = gt.boxes.shape[1]
    gb = gt.boxes[:, :, None, :]                                    # [B, M, 1, 4]
    px, py = points[:, 0], points[:, 1]                             # [A]
    inside = ((px > gb[..., 0]) & (px < gb[..., 2]) & (py > gb[..., 1]) & (py < gb[..., 3]))
    cx, cy = (gb[..., 0] + gb[..., 2]) / 2, (gb[..., 1] + gb[..., 3]) / 2
    near = ((px - cx).abs() < strides) & ((py - cy).abs() < strides)
    cand = (inside | near) & gt.valid[:, :, None]                   # [B, M, A]
    iou = box_iou_pairs(gb.expand(b, m, a, 4), pred[:, None].expand(b, m, a, 4))
    iou = iou * cand
    cls_score = scores.gather(2, gt.labels[:, None, :].expand(b, a, m)).transpose(1, 2)
    align = cls_score.pow(alpha) * iou.pow(beta) * cand            # [B, M, A]
    k = min(topk, a)
    top = align.topk(k, dim=2).indices
    chosen = torch.zeros_like(cand).scatter_(2, top, True) & cand
    # a point chosen by two boxes: keep the box it overlaps most
    many = chosen.sum(1, keepdim=True) > 1
    best = F.one_hot((iou * chosen).argmax(1), m).transpose(1, 2).bool()
    chosen = torch.where(many, best & chosen, chosen)
    fg = chosen.any(1)                                              # [B, A]
    owner = chosen.float().argmax(1)                                # [B, A]
    idx = owner[..., None]
    boxes = gt.boxes.gather(1, idx.expand(b, a, 4))
    labels = gt.labels.gather(1, owner)
    # normalise per box: its best point's target is the best IoU among its chosen points
    align = align * chosen
    best_align = align.amax(2, keepdim=True)
    best_iou = (iou * chosen).amax(2, keepdim=True)
    norm = (align / (best_align + 1e-9) * best_iou).amax(1)        # [B, A]
    target = F.one_hot(labels, nc).float() * (norm * fg)[..., None]
    return fg, boxes, target


def loss(model: Detector, x: torch.Tensor, gt: Targets, box_weight: float = 2.5
         ) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss of a batch: BCE on the class logits against the aligned targets, plus
    ``box_weight`` x GIoU loss on the foreground points (each weighted by its class target);
    both divided by the sum of the class targets."""
    logits, dist = model.raw(x)
    logits = logits.transpose(1, 2)                                 # [B, A, nc]
    pred = distances_to_boxes(model.points, dist)                   # [B, A, 4]
    fg, boxes, target = assign(logits.detach().sigmoid(), pred.detach(), model.points,
                               model.strides, gt)
    norm = target.sum().clamp(min=1.0)
    cls = F.binary_cross_entropy_with_logits(logits, target, reduction="sum") / norm
    if fg.any():
        weight = target.sum(-1)[fg]
        giou = box_iou_pairs(pred[fg], boxes[fg], giou=True)
        box = ((1.0 - giou) * weight).sum() / norm
    else:
        box = pred.sum() * 0.0
    total = cls + box_weight * box
    return total, {"cls": float(cls.detach()), "box": float(box.detach())}


def init_backbone(model: Detector, classifier: nn.Sequential) -> None:
    """Start ``model``'s backbone from a classifier made by ``common.build_model`` (its first
    module: the features) with the same stage widths."""
    model.backbone.load_state_dict(classifier[0].state_dict())
