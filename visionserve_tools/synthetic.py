"""Deterministic synthetic industrial-surface images, with and without defects.

The shipped default model (``models/defect-classifier``) is trained on these images, and the
benchmark, the load tests and the test suite use them as camera frames, so that nothing is ever
downloaded. An image is fully determined by ``(label, seed, size, params)``.

What is drawn, in order (so that defects sit *in* the surface and share its lighting):
textured surface (brushed metal, cast, painted, textile) -> defect -> small camera rotation and
shift -> lighting gradient, vignetting, exposure -> lens blur -> sensor noise -> uint8 BGR.

Defect sizes are fractions of the short image side, so a defect looks the same at 640x480 and at
1280x1024 and stays visible after the server shrinks the frame to the model input.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import astuple, dataclass, fields
from typing import Any, cast

import cv2
import numpy as np

LABELS = ("ok", "scratch", "spot", "crack", "contamination")
TEXTURES = ("brushed", "cast", "painted", "textile")
FORMATS = ("jpeg", "png", "bmp")

Range = tuple[float, float]


@dataclass(frozen=True)
class SurfaceParams:
    """Ranges the generator samples from; each ``(lo, hi)`` is drawn uniformly per image.

    The held-out set uses other ranges than training (:data:`HELDOUT_PARAMS`), so that accuracy
    measured on it says something about surfaces the model has not seen.
    """

    textures: tuple[str, ...] = TEXTURES
    brightness: Range = (0.30, 0.80)        # mean surface reflectance, 0..1
    texture_contrast: Range = (0.5, 1.3)    # multiplier on the texture's own amplitude
    grain_scale: Range = (0.6, 1.6)         # multiplier on texture feature size
    saturation: Range = (0.0, 0.6)          # colour saturation of painted/textile surfaces
    gradient: Range = (0.0, 0.30)           # lighting gradient, +-fraction across the frame
    vignette: Range = (0.0, 0.40)           # brightness lost in the corners
    exposure: Range = (0.85, 1.15)          # global gain
    noise_sigma: Range = (1.0, 8.0)         # sensor noise, 8-bit levels
    blur_sigma: Range = (0.0, 1.5)          # lens blur, pixels at 640x480 (scaled with size)
    max_rotation_deg: float = 4.0           # camera/part rotation, +-degrees
    max_shift: float = 0.04                 # part position jitter, fraction of the frame
    # how a scratch looks: groove width (fraction of the short side) and a multiplier on how far
    # its tone lies from the surface's (below 1: fainter); other ranges draw a new look of it
    scratch_width: Range = (0.004, 0.009)
    scratch_contrast: Range = (1.0, 1.0)

    def __post_init__(self) -> None:
        if not self.textures:
            raise ValueError("SurfaceParams.textures must name at least one texture")
        unknown = [t for t in self.textures if t not in TEXTURES]
        if unknown:
            raise ValueError(f"unknown texture(s) {unknown}; choose from {list(TEXTURES)}")
        for name in ("brightness", "texture_contrast", "grain_scale", "saturation", "gradient",
                     "vignette", "exposure", "noise_sigma", "blur_sigma", "scratch_width",
                     "scratch_contrast"):
            lo, hi = getattr(self, name)
            if not (0 <= lo <= hi):
                raise ValueError(f"SurfaceParams.{name} must be a range 0 <= lo <= hi, got "
                                 f"{(lo, hi)}")
        if self.max_rotation_deg < 0 or not (0 <= self.max_shift < 0.5):
            raise ValueError("SurfaceParams.max_rotation_deg must be >= 0 and max_shift in "
                             "[0, 0.5)")


TRAIN_PARAMS = SurfaceParams()

# Shifted ranges: finer and coarser grain, stronger texture, more noise and blur, darker and
# brighter parts, harder lighting. Overlaps training only partly on purpose.
HELDOUT_PARAMS = SurfaceParams(
    brightness=(0.25, 0.85),
    texture_contrast=(0.8, 1.6),
    grain_scale=(0.45, 2.0),
    saturation=(0.1, 0.75),
    gradient=(0.1, 0.35),
    vignette=(0.15, 0.45),
    exposure=(0.8, 1.2),
    noise_sigma=(3.0, 10.0),
    blur_sigma=(0.5, 1.8),
    max_rotation_deg=6.0,
    max_shift=0.05,
)


#: the labels that are defects (every label but "ok"), in :data:`LABELS` order: a detector's classes
DEFECT_LABELS = LABELS[1:]
#: a defect's drawn mask (0..1, how much of the defect is in a pixel) counts from here on
MASK_THRESHOLD = 0.25
#: a scene's number of defects: probabilities of 0, 1, 2, 3
SCENE_COUNTS = (0.1, 0.35, 0.3, 0.25)
SCENE_TRIES = 8           # attempts to place a defect clear of the others before leaving it out
SCENE_GAP = 0.01          # clear space between two defects' masks, fraction of the short side
SCENE_MAX_IOU = 0.2       # largest overlap of two defects' boxes (a thin diagonal one may share)
_SCENE_STREAM = 1000      # random stream of scenes: apart from the labels' 0..4


@dataclass(frozen=True, eq=False)
class Defect:
    """Where the generator drew one defect, in the final image's pixels (after the camera's
    rotation and shift): ``mask`` is HxW bool, the pixels where the drawn defect reaches
    :data:`MASK_THRESHOLD`; ``box`` is ``(x1, y1, x2, y2)`` around them on pixel edges (pixel
    column c spans [c, c+1), so ``x2`` is the last column + 1)."""

    label: str
    box: tuple[float, float, float, float]
    mask: np.ndarray


# --------------------------------------------------------------------------- public API


def generate(label: str, seed: int, size: tuple[int, int] = (640, 480),
             params: SurfaceParams = TRAIN_PARAMS) -> np.ndarray:
    """One ``size = (width, height)`` image of ``label`` as HxWx3 uint8 BGR."""
    return generate_annotated(label, seed, size, params, annotate=False)[0]


def generate_annotated(label: str, seed: int, size: tuple[int, int] = (640, 480),
                       params: SurfaceParams = TRAIN_PARAMS, *, annotate: bool = True
                       ) -> tuple[np.ndarray, tuple[Defect, ...]]:
    """:func:`generate`'s image (the same bytes) and where its defect is: one :class:`Defect`
    for a defect label, none for ``ok`` (or for a defect the camera moved out of the frame)."""
    if label not in LABELS:
        raise ValueError(f"unknown label {label!r}; choose from {list(LABELS)}")
    w, h = _check_size(size)
    salt = _check_seed_params(seed, params)
    # Params are part of the seed so that held-out images are not training images re-scaled.
    rng = np.random.default_rng([int(seed), LABELS.index(label), w, h, salt])
    return _render(rng, label, w, h, params, annotate)


def generate_scene(seed: int, size: tuple[int, int] = (640, 480),
                   params: SurfaceParams = TRAIN_PARAMS,
                   counts: tuple[float, ...] = SCENE_COUNTS
                   ) -> tuple[np.ndarray, tuple[Defect, ...]]:
    """A detection scene: one surface with 0..3 defects of mixed kinds (``counts``: the
    probabilities of 0, 1, 2, ... defects), apart from each other, and where each one is.
    A pure function of its arguments, like :func:`generate`, with a random stream of its own."""
    w, h = _check_size(size)
    salt = _check_seed_params(seed, params)
    try:
        weights = tuple(float(c) for c in counts)
    except (TypeError, ValueError):
        raise ValueError(f"counts must be probabilities of 0, 1, ... defects, got {counts!r}"
                         ) from None
    if not weights or any(not c >= 0 for c in weights) or sum(weights) <= 0:
        raise ValueError(f"counts must be non-negative with a positive sum, got {counts!r}")
    rng = np.random.default_rng([int(seed), _SCENE_STREAM, w, h, salt])
    return _render_scene(rng, w, h, params, weights)


def _check_seed_params(seed: object, params: object) -> int:
    """Refuse a bad seed or params; the params' salt for the random stream."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    if not isinstance(params, SurfaceParams):
        raise ValueError(  # noqa: TRY004 -- the callers (and tests) take ValueError for bad input
            f"params must be a SurfaceParams, got {type(params).__name__}")
    return zlib.crc32(repr(_salted(params)).encode())


#: the defects' look: in an image's seed only where it differs from the default, so that every
#: image drawn with the default look is the one it was before these fields existed
_LOOK_FIELDS = ("scratch_width", "scratch_contrast")


def _salted(params: SurfaceParams) -> tuple:
    base = tuple(astuple(params)[i] for i, f in enumerate(fields(params))
                 if f.name not in _LOOK_FIELDS)
    look = tuple((name, getattr(params, name)) for name in _LOOK_FIELDS
                 if getattr(params, name) != getattr(TRAIN_PARAMS, name))
    return base + look if look else base


def generate_set(n_per_label: int, seed: int,
                 sizes: tuple[tuple[int, int], ...] = ((640, 480), (1280, 1024)),
                 params: SurfaceParams = TRAIN_PARAMS) -> Iterator[tuple[np.ndarray, str]]:
    """``n_per_label`` images of every label, interleaved (ok, scratch, ..., ok, ...).

    Sizes alternate through ``sizes``; image ``i`` of a label uses a seed derived from
    ``(seed, i)``, so a larger set starts with the images of a smaller one.
    """
    if isinstance(n_per_label, bool) or not isinstance(n_per_label, (int, np.integer)) \
            or n_per_label < 1:
        raise ValueError(f"n_per_label must be a positive integer, got {n_per_label!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    sizes = tuple(_check_size(s) for s in sizes)
    if not sizes:
        raise ValueError("sizes must name at least one (width, height)")
    for i in range(int(n_per_label)):
        image_seed = _item_seed(int(seed), i)
        size = sizes[i % len(sizes)]
        for label in LABELS:
            yield generate(label, image_seed, size, params), label


def _item_seed(seed: int, i: int) -> int:
    """Seed of the ``i``-th image (per label) of ``generate_set(..., seed)``."""
    return int(np.random.SeedSequence([seed, i]).generate_state(1)[0])


def encode(img: np.ndarray, fmt: str = "jpeg", quality: int = 90) -> bytes:
    """Encode a BGR (or grey) uint8 image as JPEG, PNG or BMP bytes."""
    fmt_l = str(fmt).lower()
    if fmt_l == "jpg":
        fmt_l = "jpeg"
    if fmt_l not in FORMATS:
        raise ValueError(f"unknown image format {fmt!r}; choose from {list(FORMATS)}")
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim not in (2, 3) \
            or (img.ndim == 3 and img.shape[2] not in (1, 3, 4)) or img.size == 0:
        raise ValueError("img must be a non-empty HxW or HxWx{1,3,4} uint8 array, got "
                         f"{getattr(img, 'dtype', type(img).__name__)} {getattr(img, 'shape', '')}")
    if fmt_l == "jpeg":
        if isinstance(quality, bool) or not isinstance(quality, (int, np.integer)) \
                or not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality must be an integer 1..100, got {quality!r}")
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
    elif fmt_l == "png":
        ok, buf = cv2.imencode(".png", img, [cv2.IMWRITE_PNG_COMPRESSION, 3])
    else:
        ok, buf = cv2.imencode(".bmp", img)
    if not ok:  # pragma: no cover - OpenCV only fails on shapes rejected above
        raise ValueError(f"OpenCV could not encode a {img.shape} image as {fmt_l}")
    return buf.tobytes()


def _check_size(size: object) -> tuple[int, int]:
    try:
        w, h = cast(Any, size)  # unpacking it checks it is a pair
    except (TypeError, ValueError):
        raise ValueError(f"size must be (width, height), got {size!r}") from None
    if isinstance(w, bool) or isinstance(h, bool) or not isinstance(w, (int, np.integer)) \
            or not isinstance(h, (int, np.integer)):
        # every bad size is a ValueError (the API's contract, pinned by tests)
        raise ValueError(f"size must be two integers (width, height), got {size!r}")  # noqa: TRY004
    if w < 16 or h < 16 or w > 8192 or h > 8192:
        raise ValueError(f"size must be between 16 and 8192 pixels per side, got {size!r}")
    return int(w), int(h)


# --------------------------------------------------------------------------- rendering


def _u(rng: np.random.Generator, r: Range) -> float:
    return float(rng.uniform(r[0], r[1])) if r[1] > r[0] else float(r[0])


def _render(rng: np.random.Generator, label: str, w: int, h: int, p: SurfaceParams,
            annotate: bool = False) -> tuple[np.ndarray, tuple[Defect, ...]]:
    s = min(w, h)
    texture = p.textures[int(rng.integers(len(p.textures)))]
    img = _surface(rng, texture, w, h, p)
    drawn = [(label, _DRAW[label](rng, img, s, p))] if label in _DRAW else []
    img, masks = _camera(rng, img, w, h, p, [m for _, m in drawn] if annotate else [])
    return img, _annotations([lab for lab, _ in drawn], masks)


def _render_scene(rng: np.random.Generator, w: int, h: int, p: SurfaceParams,
                  counts: tuple[float, ...]) -> tuple[np.ndarray, tuple[Defect, ...]]:
    """A surface with ``k`` defects (``k`` drawn with probabilities ``counts``), kinds drawn
    uniformly. A defect whose mask would touch an earlier one, or whose box would overlap an
    earlier box by IoU > :data:`SCENE_MAX_IOU`, is drawn again elsewhere (on a copy, so a refused
    attempt leaves no trace), at most :data:`SCENE_TRIES` times; then it is left out."""
    s = min(w, h)
    texture = p.textures[int(rng.integers(len(p.textures)))]
    img = _surface(rng, texture, w, h, p)
    k = int(rng.choice(len(counts), p=np.asarray(counts) / sum(counts)))
    gap = max(1, round(SCENE_GAP * s))
    taken = np.zeros((h, w), np.uint8)
    labels: list[str] = []
    masks: list[np.ndarray] = []
    boxes: list[np.ndarray] = []
    for _ in range(k):
        kind = DEFECT_LABELS[int(rng.integers(len(DEFECT_LABELS)))]
        for _ in range(SCENE_TRIES):
            trial = img.copy()
            mask = _DRAW[kind](rng, trial, s, p)
            on = mask > MASK_THRESHOLD
            box = _box(on)
            if box is None:
                continue
            if (taken[on].any() or any(_iou(box, b) > SCENE_MAX_IOU for b in boxes)):
                continue
            img = trial
            labels.append(kind)
            masks.append(mask)
            boxes.append(box)
            taken |= cv2.dilate(on.astype(np.uint8), np.ones((2 * gap + 1,) * 2, np.uint8))
            break
    img, masks = _camera(rng, img, w, h, p, masks)
    return img, _annotations(labels, masks)


def _box(on: np.ndarray) -> np.ndarray | None:
    """Bool mask -> [x1, y1, x2, y2] around its pixels (pixel edges: x2 = last column + 1)."""
    cols = np.flatnonzero(on.any(0))
    if not len(cols):
        return None
    rows = np.flatnonzero(on.any(1))
    return np.array([cols[0], rows[0], cols[-1] + 1, rows[-1] + 1], np.float64)


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    return float(inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter))


def _annotations(labels: list[str], masks: list[np.ndarray]) -> tuple[Defect, ...]:
    """Camera-space soft masks -> Defects; one that left the frame entirely is not reported."""
    out = []
    for label, soft in zip(labels, masks):
        on = soft > MASK_THRESHOLD
        box = _box(on)
        if box is not None:
            out.append(Defect(label, (float(box[0]), float(box[1]), float(box[2]),
                                      float(box[3])), on))
    return tuple(out)


def _noise_field(rng: np.random.Generator, w: int, h: int, cell: float) -> np.ndarray:
    """Smooth value noise with features about ``cell`` pixels wide, roughly N(0, 1)."""
    cell = max(cell, 1.0)
    gw, gh = max(2, math.ceil(w / cell) + 1), max(2, math.ceil(h / cell) + 1)
    small = rng.standard_normal((gh, gw)).astype(np.float32)
    if gw >= w and gh >= h:
        return small[:h, :w]
    return cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)


def _fractal(rng: np.random.Generator, w: int, h: int, cell: float, octaves: int) -> np.ndarray:
    out = np.zeros((h, w), np.float32)
    amp, total = 1.0, 0.0
    for _ in range(octaves):
        out += amp * _noise_field(rng, w, h, cell)
        total += amp
        amp *= 0.55
        cell /= 2.0
    return out / total


def _colour(rng: np.random.Generator, sat: float, value: float) -> np.ndarray:
    """A BGR colour (floats 0..1) of random hue with the given saturation and value."""
    hsv = np.array([[[rng.uniform(0, 180), sat * 255, min(value, 1.0) * 255]]], np.float32)
    bgr = cv2.cvtColor(hsv.astype(np.uint8), cv2.COLOR_HSV2BGR)[0, 0].astype(np.float32) / 255
    return bgr


def _surface(rng: np.random.Generator, kind: str, w: int, h: int, p: SurfaceParams) -> np.ndarray:
    s = min(w, h)
    base = _u(rng, p.brightness)
    amp = _u(rng, p.texture_contrast)
    grain = _u(rng, p.grain_scale)
    sat = _u(rng, p.saturation)
    if kind == "brushed":
        # Streaks: per-row noise stretched along the brushing direction, plus fine grain.
        vertical = bool(rng.integers(2))
        ww, hh = (h, w) if vertical else (w, h)
        streak = rng.standard_normal((hh, max(2, int(ww / (40 * grain))))).astype(np.float32)
        streak = cv2.resize(streak, (ww, hh), interpolation=cv2.INTER_LINEAR)
        streak = cv2.GaussianBlur(streak, (0, 0), sigmaX=0.1, sigmaY=0.6 * grain * s / 480)
        if vertical:
            streak = np.ascontiguousarray(streak.T)
        lum = 0.05 * streak + 0.04 * _fractal(rng, w, h, s * 0.3 * grain, 3)
        colour = np.array([1.0, 1.0, 1.0], np.float32) + rng.normal(0, 0.02, 3).astype(np.float32)
        sat = 0.0
    elif kind == "cast":
        lum = 0.06 * _fractal(rng, w, h, s * 0.08 * grain, 4)
        pores = _noise_field(rng, w, h, 1.2 * grain * s / 480)
        lum += 0.035 * pores
        colour = np.array([1.0, 1.0, 1.0], np.float32) + rng.normal(0, 0.03, 3).astype(np.float32)
        sat = 0.0
    elif kind == "painted":
        # Orange peel: low-amplitude bumps a few pixels wide, on a flat colour.
        lum = 0.02 * _fractal(rng, w, h, s * 0.02 * grain, 2) \
            + 0.02 * _noise_field(rng, w, h, s * 0.4)
        colour = None
    else:  # textile: basket weave with a random period and angle, plus fibre noise
        period = s / 45.0 * grain
        xx = np.arange(w, dtype=np.float32)[None, :]
        yy = np.arange(h, dtype=np.float32)[:, None]
        ang = rng.uniform(0, math.pi)
        u = xx * math.cos(ang) + yy * math.sin(ang)
        v = -xx * math.sin(ang) + yy * math.cos(ang)
        warp = np.sin(np.pi * u / period) ** 2
        weft = np.sin(np.pi * v / period) ** 2
        cell = (np.floor(u / (2 * period)) + np.floor(v / (2 * period))) % 2
        lum = 0.07 * (np.where(cell > 0, warp, weft) - 0.5)
        lum += 0.02 * _noise_field(rng, w, h, period * 0.5)
        colour = None
    if colour is None:
        colour = _colour(rng, sat, 1.0)
        colour = colour / max(float(colour.mean()), 1e-3)
    img = (base * (1.0 + amp * lum / max(base, 0.2)))[..., None] * colour[None, None, :]
    return np.ascontiguousarray(img, dtype=np.float32)


def _blend(img: np.ndarray, mask: np.ndarray, colour: np.ndarray | float,
           alpha: float = 1.0) -> None:
    """``img = img*(1-a*mask) + colour*a*mask`` in place; colour may be an HxWx3 map."""
    a = (alpha * mask)[..., None]
    img *= 1.0 - a
    img += a * colour


def _shade(img: np.ndarray, mask: np.ndarray, factor: float) -> None:
    """Multiply brightness by ``factor`` where ``mask`` is 1 (keeps the surface texture)."""
    img *= (1.0 + (factor - 1.0) * mask)[..., None]


def _ragged(rng: np.random.Generator, soft: np.ndarray, cell: float) -> np.ndarray:
    """Give a soft blob mask an irregular edge; stays inside the blob's blurred support."""
    h, w = soft.shape
    wobble = _noise_field(rng, w, h, cell)
    return np.clip(soft * (1.6 + 0.6 * wobble) - 0.3, 0, 1)


def _local_luminance(img: np.ndarray, c: np.ndarray, radius: float) -> float:
    h, w = img.shape[:2]
    r = max(4, int(radius))
    x0, x1 = max(0, int(c[0]) - r), min(w, int(c[0]) + r)
    y0, y1 = max(0, int(c[1]) - r), min(h, int(c[1]) + r)
    return float(img[y0:y1:4, x0:x1:4].mean()) if x1 > x0 and y1 > y0 else float(img.mean())


def _point(rng: np.random.Generator, w: int, h: int, margin: float) -> np.ndarray:
    return np.array([rng.uniform(margin * w, (1 - margin) * w),
                     rng.uniform(margin * h, (1 - margin) * h)], np.float64)


def _polyline_mask(h: int, w: int, pts: list[np.ndarray], thickness: float) -> np.ndarray:
    """Anti-aliased polyline of sub-pixel-accurate thickness (drawn at 4x, shift=2)."""
    mask = np.zeros((h, w), np.float32)
    arr = np.round(np.asarray(pts) * 4).astype(np.int32).reshape(-1, 1, 2)
    cv2.polylines(mask, [arr], False, 1.0, thickness=max(1, round(thickness)),
                  lineType=cv2.LINE_AA, shift=2)
    return mask


def _scratch(rng: np.random.Generator, img: np.ndarray, s: int,
             p: SurfaceParams = TRAIN_PARAMS) -> np.ndarray:
    h, w = img.shape[:2]
    length = rng.uniform(0.25, 0.65) * s
    thick = rng.uniform(*p.scratch_width) * s
    centre = _point(rng, w, h, 0.2)
    ang = rng.uniform(0, math.pi)
    d = np.array([math.cos(ang), math.sin(ang)])
    n = np.array([-d[1], d[0]])
    bow = rng.uniform(-0.12, 0.12) * length     # slightly curved: quadratic bow
    pts = []
    for t in np.linspace(-0.5, 0.5, 40):
        pts.append(centre + d * t * length + n * bow * (1 - 4 * t * t))
    mask = _polyline_mask(h, w, pts, thick)
    mask = cv2.GaussianBlur(mask, (0, 0), max(0.5, thick * 0.25))
    # A groove catches the light (bright) or shadows (dark); whichever, it must stand out from
    # the surface around it, or the label would be a lie.
    lum = _local_luminance(img, centre, length)
    if lum < 0.35 or (lum < 0.7 and rng.random() < 0.55):
        tone = min(1.0, lum + rng.uniform(0.3, 0.5))
    else:
        tone = lum * rng.uniform(0.25, 0.5)
    if p.scratch_contrast != TRAIN_PARAMS.scratch_contrast:   # the default draws nothing more
        tone = lum + (tone - lum) * _u(rng, p.scratch_contrast)
    _blend(img, mask, np.full(3, tone, np.float32), rng.uniform(0.8, 1.0))
    return mask


def _spot(rng: np.random.Generator, img: np.ndarray, s: int,
          p: SurfaceParams = TRAIN_PARAMS) -> np.ndarray:
    h, w = img.shape[:2]
    kind = rng.choice(["dent", "pit", "stain"])
    c = _point(rng, w, h, 0.15)
    if kind == "pit":
        r = rng.uniform(0.018, 0.035) * s
        rim = np.zeros((h, w), np.float32)
        cv2.circle(rim, (int(c[0] * 4), int(c[1] * 4)), int(r * 1.35 * 4), 1.0, -1, cv2.LINE_AA, 2)
        rim = cv2.GaussianBlur(rim, (0, 0), r * 0.25)
        core = np.zeros((h, w), np.float32)
        cv2.circle(core, (int(c[0] * 4), int(c[1] * 4)), int(r * 4), 1.0, -1, cv2.LINE_AA, 2)
        core = cv2.GaussianBlur(core, (0, 0), r * 0.2)
        _shade(img, np.clip(rim - core, 0, 1), 1.5)
        _shade(img, core, rng.uniform(0.15, 0.35))
        return np.maximum(rim, core)
    rx = rng.uniform(0.035, 0.075) * s
    ry = rx * rng.uniform(0.6, 1.0)
    ang = rng.uniform(0, 180)
    mask = np.zeros((h, w), np.float32)
    cv2.ellipse(mask, (int(c[0] * 4), int(c[1] * 4)), (int(rx * 4), int(ry * 4)), ang, 0, 360,
                1.0, -1, cv2.LINE_AA, 2)
    if kind == "dent":
        # Shading across the dent: lit on one side, shadowed on the other.
        mask = cv2.GaussianBlur(mask, (0, 0), rx * 0.25)
        la = rng.uniform(0, 2 * math.pi)
        xx = np.arange(w, dtype=np.float32)[None, :] - np.float32(c[0])
        yy = np.arange(h, dtype=np.float32)[:, None] - np.float32(c[1])
        side = (xx * np.float32(math.cos(la) / rx) + yy * np.float32(math.sin(la) / rx))
        strength = rng.uniform(0.5, 0.8)
        img *= (1.0 + strength * np.clip(side, -1.2, 1.2) * mask)[..., None]
        _shade(img, mask, rng.uniform(0.45, 0.65))
    else:
        # Stain: soft, slightly irregular edge, darker and tinted.
        mask = _ragged(rng, cv2.GaussianBlur(mask, (0, 0), rx * 0.3), rx * 0.5)
        tint = _colour(rng, rng.uniform(0.3, 0.7), 1.0)
        tint = tint / max(float(tint.mean()), 1e-3)
        factor = rng.uniform(0.3, 0.55)
        img *= (1.0 + (tint[None, None, :] * factor - 1.0) * mask[..., None])
    return mask


def _crack(rng: np.random.Generator, img: np.ndarray, s: int,
           p: SurfaceParams = TRAIN_PARAMS) -> np.ndarray:
    h, w = img.shape[:2]
    thick = rng.uniform(0.004, 0.008) * s
    mask = np.zeros((h, w), np.float32)

    def walk(start: np.ndarray, heading: float, length: float, width: float) -> list[np.ndarray]:
        ang = heading
        seg = s * rng.uniform(0.012, 0.025)
        pts = [start]
        p = start.copy()
        for _ in range(max(3, int(length / seg))):
            ang += rng.normal(0, 0.55)          # jagged: big random turns ...
            p = p + seg * np.array([math.cos(ang), math.sin(ang)])
            pts.append(p.copy())
            ang = 0.6 * ang + 0.4 * heading     # ... around a general direction
        mask[:] = np.maximum(mask, _polyline_mask(h, w, pts, width))
        return pts

    base = rng.uniform(0, 2 * math.pi)
    trunk = walk(_point(rng, w, h, 0.25), base, rng.uniform(0.3, 0.6) * s, thick)
    for _ in range(int(rng.integers(1, 4))):
        start = trunk[int(rng.integers(1, len(trunk) - 1))]
        branch = base + rng.choice([-1, 1]) * rng.uniform(0.5, 1.1)
        walk(start, branch, rng.uniform(0.08, 0.25) * s, thick * rng.uniform(0.5, 0.8))
    mask = cv2.GaussianBlur(mask, (0, 0), max(0.4, thick * 0.15))
    _shade(img, mask, rng.uniform(0.05, 0.25))
    return mask


def _contamination(rng: np.random.Generator, img: np.ndarray, s: int,
                   p: SurfaceParams = TRAIN_PARAMS) -> np.ndarray:
    h, w = img.shape[:2]
    c = _point(rng, w, h, 0.2)
    spread = rng.uniform(0.08, 0.18) * s
    colours = [np.array(x, np.float32) for x in (
        (0.05, 0.05, 0.05),     # soot / dark particles
        (0.05, 0.18, 0.35),     # rust (BGR)
        (0.08, 0.25, 0.30),     # brown dirt
        (0.55, 0.35, 0.10),     # blue lint
        (0.15, 0.45, 0.55),     # ochre / sand
        (0.80, 0.85, 0.88),     # white dust, dried coolant
    )]
    # Only materials that differ from the surface under them: dark dirt on a dark part is
    # invisible to any camera, and would teach the model that a clean look can be "contaminated".
    lum = _local_luminance(img, c, spread)
    visible = [k for k, col in enumerate(colours) if abs(float(col.mean()) - lum) > 0.3]
    base_colour = colours[visible[int(rng.integers(len(visible)))]]
    film = None
    if rng.random() < 0.4:
        # Smear: an irregular, elongated, translucent film (oil, coolant residue).
        mask = np.zeros((h, w), np.float32)
        axes = (int(spread * 4), int(spread * rng.uniform(0.2, 0.4) * 4))
        cv2.ellipse(mask, (int(c[0] * 4), int(c[1] * 4)), axes, rng.uniform(0, 180), 0, 360,
                    1.0, -1, cv2.LINE_AA, 2)
        mask = _ragged(rng, cv2.GaussianBlur(mask, (0, 0), spread * 0.15), spread * 0.3)
        _blend(img, mask, base_colour, rng.uniform(0.45, 0.7))
        film = mask
        n = int(rng.integers(6, 15))
    else:
        n = int(rng.integers(12, 35))
    mask = np.zeros((h, w), np.float32)
    for _ in range(n):
        # Irregular particle: a random polygon around a point scattered near the centre.
        q = c + rng.normal(0, spread * 0.5, 2)
        r = s * (rng.uniform(0.005, 0.012) if rng.random() < 0.7 else rng.uniform(0.012, 0.024))
        k = int(rng.integers(5, 9))
        angs = np.sort(rng.uniform(0, 2 * math.pi, k))
        rad = r * rng.uniform(0.5, 1.3, k)
        poly = np.stack([q[0] + rad * np.cos(angs), q[1] + rad * np.sin(angs)], 1)
        cv2.fillPoly(mask, [np.round(poly * 4).astype(np.int32)], 1.0, cv2.LINE_AA, 2)
    mask = cv2.GaussianBlur(mask, (0, 0), max(0.4, s * 0.0015))
    # Particles are usually another (darker) material than the film they sit in.
    particle_colour = colours[visible[int(rng.integers(len(visible)))]]
    _blend(img, mask, particle_colour, rng.uniform(0.8, 0.95))
    return mask if film is None else np.maximum(mask, film)


#: label -> the function that draws it into a float image and returns where (a 0..1 mask)
_DRAW = {"scratch": _scratch, "spot": _spot, "crack": _crack, "contamination": _contamination}


def _camera(rng: np.random.Generator, img: np.ndarray, w: int, h: int, p: SurfaceParams,
            masks: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Pose, lighting, blur, noise -> uint8; ``masks`` (where defects were drawn) follow the
    pose exactly: the same warp and border, so a defect reflected in at the edge is in its mask
    too. They take no random numbers: the image is the same with or without them."""
    s = min(w, h)
    # Part pose: small rotation and shift; the border is reflected surface, not black.
    rot = rng.uniform(-p.max_rotation_deg, p.max_rotation_deg)
    dx, dy = rng.uniform(-p.max_shift, p.max_shift, 2) * (w, h)
    m = cv2.getRotationMatrix2D((w / 2, h / 2), rot, 1.0)
    m[:, 2] += (dx, dy)
    img = cv2.warpAffine(img, m, (w, h), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT_101)
    masks = [cv2.warpAffine(k, m, (w, h), flags=cv2.INTER_LINEAR,
                            borderMode=cv2.BORDER_REFLECT_101) for k in masks]
    # Lighting: linear gradient in a random direction, vignetting, exposure. Smooth, so it is
    # computed on a coarse grid and interpolated (full-resolution numpy here was the slow part).
    gw, gh = max(2, w // 8), max(2, h // 8)
    xn = (np.arange(gw, dtype=np.float32)[None, :] + 0.5) / gw * 2 - 1
    yn = (np.arange(gh, dtype=np.float32)[:, None] + 0.5) / gh * 2 - 1
    la = rng.uniform(0, 2 * math.pi)
    light = 1.0 + _u(rng, p.gradient) * (xn * math.cos(la) + yn * math.sin(la))
    light = light * (1.0 - _u(rng, p.vignette) * np.clip((xn * xn + yn * yn) / 2.0, 0, 1))
    light = light * _u(rng, p.exposure) * 255.0
    light = cv2.resize(light.astype(np.float32), (w, h), interpolation=cv2.INTER_LINEAR)
    img *= light[..., None]
    sigma = _u(rng, p.blur_sigma) * s / 480
    if sigma > 0.3:
        img = cv2.GaussianBlur(img, (0, 0), sigma)
    img += _sensor_noise(rng, w, h) * _u(rng, p.noise_sigma)
    img += 0.5
    np.clip(img, 0, 255, out=img)
    return img.astype(np.uint8), masks


_NOISE_BANK: np.ndarray | None = None
_BANK_H, _BANK_W = 1031, 1289   # not multiples of common frame sizes, so windows don't align


def _sensor_noise(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """HxWx3 unit Gaussian noise: windows of a fixed bank at random offsets, signs and channels.

    Drawing 4M fresh normals per 1280x1024 frame took longer than the rest of the image; the bank
    is built once from a fixed seed, so results stay a pure function of the arguments.
    """
    global _NOISE_BANK
    if _NOISE_BANK is None:
        bank = np.random.default_rng(0x5EED).standard_normal((_BANK_H, _BANK_W), dtype=np.float32)
        _NOISE_BANK = np.tile(bank, (2, 2))
    chans = []
    for _ in range(3):
        oy, ox = int(rng.integers(_BANK_H)), int(rng.integers(_BANK_W))
        sign = 1.0 if rng.random() < 0.5 else -1.0
        if h <= _BANK_H and w <= _BANK_W:
            win = _NOISE_BANK[oy:oy + h, ox:ox + w]
        else:
            reps = (h // _BANK_H + 2, w // _BANK_W + 2)
            win = np.tile(_NOISE_BANK[:_BANK_H, :_BANK_W], reps)[oy:oy + h, ox:ox + w]
        chans.append(win * sign if sign < 0 else win)
    return cv2.merge(chans)
