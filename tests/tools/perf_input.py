"""Write perf_analyzer's ``--input-data`` JSON for a visionserve model from image files.

    python tests/tools/perf_input.py part.jpg [more.jpg ...] > input.json
    tests/tools/perf_analyzer -m defect-classifier --input-data input.json --shape image:1 ...

perf_analyzer reads a BYTES tensor given as ``{"b64": ...}`` as the tensor's binary form: each
element a 4-byte little-endian length followed by its bytes. One entry per file; perf_analyzer
sends them round-robin. ``--name`` sets the input tensor name (default ``image``).
"""

from __future__ import annotations

import argparse
import base64
import json
import struct
import sys
from pathlib import Path


def entry(image: bytes, name: str) -> dict:
    blob = struct.pack("<I", len(image)) + image
    return {name: {"b64": base64.b64encode(blob).decode("ascii")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("images", nargs="+", type=Path, help="JPEG/PNG/BMP files")
    parser.add_argument("--name", default="image", help="input tensor name (default: image)")
    args = parser.parse_args(argv)
    data = []
    for path in args.images:
        try:
            data.append(entry(path.read_bytes(), args.name))
        except OSError as exc:
            print(f"perf_input: cannot read {path}: {exc.strerror}", file=sys.stderr)
            return 2
    json.dump({"data": data}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
