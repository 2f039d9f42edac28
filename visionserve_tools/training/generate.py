"""Write a folder-per-label dataset of synthetic surface images (the layout train.py --data and
evaluate.py --data read; also handy as camera frames for load tests).

    python -m visionserve_tools.training.generate /tmp/surfaces --n-per-label 50 \\
        --params heldout --format jpeg

Result: ``OUT/ok/ok_00000.jpg``, ``OUT/scratch/scratch_00000.jpg``, ... Same arguments, same bytes.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from . import common
from .common import ScriptError

PARAMS = {"train": common.synthetic.TRAIN_PARAMS, "heldout": common.synthetic.HELDOUT_PARAMS}
EXT = {"jpeg": ".jpg", "png": ".png", "bmp": ".bmp"}


def _write_chunk(args: tuple) -> int:
    out, labels, seed, sizes, params, fmt, quality, start, stop = args
    for k in range(start, stop):
        i, li = divmod(k, len(labels))
        img = common.synthetic.generate(labels[li], common.synthetic._item_seed(seed, i),
                                        sizes[i % len(sizes)], params)
        path = out / labels[li] / f"{labels[li]}_{i:05d}{EXT[fmt]}"
        path.write_bytes(common.synthetic.encode(img, fmt, quality))
    return stop - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="output folder (created; must be empty if it exists)")
    ap.add_argument("--n-per-label", type=int, default=100)
    ap.add_argument("--labels", default=",".join(common.LABELS),
                    help=f"the kinds of surface to write (default all: {','.join(common.LABELS)})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sizes", default="640x480,1280x1024", help="frame sizes, alternating")
    ap.add_argument("--params", choices=sorted(PARAMS), default="train",
                    help="texture/lighting ranges: train or heldout")
    ap.add_argument("--format", choices=sorted(EXT), default="png")
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality 1..100")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        if args.n_per_label < 1:
            raise ScriptError(f"--n-per-label must be >= 1, got {args.n_per_label}")
        if args.seed < 0:
            raise ScriptError(f"--seed must be >= 0, got {args.seed}")
        if not 1 <= args.quality <= 100:
            raise ScriptError(f"--quality must be 1..100, got {args.quality}")
        sizes = common.parse_sizes(args.sizes)
        labels = tuple(dict.fromkeys(x.strip() for x in args.labels.split(",") if x.strip()))
        unknown = [x for x in labels if x not in common.LABELS]
        if unknown or not labels:
            raise ScriptError(f"--labels {args.labels!r}: choose from {','.join(common.LABELS)}")
        if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
            raise ScriptError(f"{args.out} exists and is not an empty folder; choose another")
        for lab in labels:
            (args.out / lab).mkdir(parents=True, exist_ok=True)
    except ScriptError as exc:
        return common.fail(exc)
    except OSError as exc:
        return common.fail(ScriptError(f"cannot create {args.out}: {exc.strerror or exc}"))
    total = args.n_per_label * len(labels)
    step = max(1, -(-total // (max(1, args.workers) * 4)))
    jobs = [(args.out, labels, args.seed, sizes, PARAMS[args.params], args.format, args.quality, a,
             min(a + step, total)) for a in range(0, total, step)]
    t0 = time.perf_counter()
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers) as pool:
            done = sum(pool.map(_write_chunk, jobs))
    else:
        done = sum(map(_write_chunk, jobs))
    print(f"wrote {done} images to {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
