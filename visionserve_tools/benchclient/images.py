"""The frames a load test sends: generated defect images of given resolutions, or a user's folder.

Both the locustfile and ``visionserve bench`` take an image-set spec string:

* ``gen:640x480`` (default), ``gen:640x480,1280x1024``, ``gen:640x480:n=40:q=90`` -- synthetic
  surfaces from :mod:`visionserve_tools.synthetic`, every label in turn, JPEG at quality ``q``;
* a folder path (or ``dir:PATH``) -- every .jpg/.jpeg/.png/.bmp file in it, sent as is.

Frames are encoded once, up front, so the sender spends no time encoding during the run.
Generated sets are cached on disk (``$VISIONSERVE_IMAGE_CACHE``, default
``~/.cache/visionserve/images``; ``off`` disables it), keyed by the spec and the generator's
source, because drawing a surface costs a quarter of a second on a small CPU.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SPEC = "gen:640x480"
_SUFFIXES = {".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".png": "image/png", ".bmp": "image/bmp"}
_SIZE_RE = re.compile(r"^(\d+)x(\d+)$")


class ImageSetError(ValueError):
    """A bad image-set spec; the message names the bad part."""


@dataclass(frozen=True)
class Frame:
    name: str
    data: bytes
    content_type: str
    label: str | None = None


def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        m = _SIZE_RE.match(part.strip().lower())
        if not m:
            raise ImageSetError(f"image size {part!r} is not WIDTHxHEIGHT (e.g. 640x480)")
        w, h = int(m.group(1)), int(m.group(2))
        if not (16 <= w <= 8192 and 16 <= h <= 8192):
            raise ImageSetError(f"image size {part!r} is out of range 16..8192")
        sizes.append((w, h))
    return sizes


def load(spec: str = DEFAULT_SPEC, seed: int = 0) -> list[Frame]:
    """Frames for ``spec`` (see the module doc); raises ImageSetError for a bad spec."""
    spec = (spec or DEFAULT_SPEC).strip()
    if spec.startswith("gen:"):
        return generated(spec[4:], seed)
    folder = Path(spec.removeprefix("dir:"))
    return from_folder(folder)


def generated(text: str, seed: int = 0) -> list[Frame]:
    parts = text.split(":")
    sizes = parse_sizes(parts[0])
    n, quality = 10, 90
    for opt in parts[1:]:
        key, _, value = opt.partition("=")
        try:
            if key == "n":
                n = int(value)
            elif key == "q":
                quality = int(value)
            else:
                raise ImageSetError(f"unknown image-set option {opt!r}; use n=COUNT or "
                                    "q=JPEG_QUALITY")
        except ValueError:
            raise ImageSetError(f"image-set option {opt!r} needs an integer value") from None
    if not (1 <= n <= 10_000):
        raise ImageSetError(f"n={n} is out of range 1..10000")
    if not (1 <= quality <= 100):
        raise ImageSetError(f"q={quality} is out of range 1..100")
    from .. import synthetic

    cache = _cache_path(synthetic.__file__, sizes, n, quality, seed)
    if cache is not None and cache.is_file():
        try:
            return pickle.loads(cache.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
            # unreadable, or written by another layout of the package (a class moved): made anew
            pass
    frames = []
    for w, h in sizes:
        for i in range(n):
            label = synthetic.LABELS[i % len(synthetic.LABELS)]
            img = synthetic.generate(label, seed + i, size=(w, h))
            frames.append(Frame(f"{label}-{w}x{h}-{seed + i}",
                                synthetic.encode(img, "jpeg", quality), "image/jpeg", label))
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(pickle.dumps(frames))
            tmp.replace(cache)
        except OSError:
            pass
    return frames


def _cache_path(source: str, sizes, n: int, quality: int, seed: int) -> Path | None:
    root = os.environ.get("VISIONSERVE_IMAGE_CACHE", "")
    if root.lower() in ("off", "0", "none"):
        return None
    base = Path(root) if root else Path.home() / ".cache" / "visionserve" / "images"
    try:
        digest = hashlib.sha1(Path(source).read_bytes()).hexdigest()[:12]
    except OSError:
        return None
    key = hashlib.sha1(repr((sizes, n, quality, seed, digest)).encode()).hexdigest()[:20]
    return base / f"{key}.pickle"


def from_folder(folder: Path) -> list[Frame]:
    if not folder.is_dir():
        raise ImageSetError(f"image folder {str(folder)!r} does not exist (or use "
                            "gen:WIDTHxHEIGHT)")
    frames = [Frame(p.name, p.read_bytes(), _SUFFIXES[p.suffix.lower()])
              for p in sorted(folder.iterdir()) if p.is_file() and p.suffix.lower() in _SUFFIXES]
    if not frames:
        raise ImageSetError(f"image folder {str(folder)!r} holds no .jpg/.jpeg/.png/.bmp file")
    return frames
