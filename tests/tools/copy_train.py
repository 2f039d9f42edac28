"""A stand-in for a user's training command (``[training] command`` in model.toml): counts the
labelled set it is handed, copies the from-version's model file into the output folder and
writes metrics.json. A real process run through the guard, as a user's trainer would be.

    python copy_train.py DATA OUT --from FROM [--file model.onnx] [--fail]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("data", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--from", dest="source", type=Path, required=True)
    ap.add_argument("--file", default="model.onnx")
    ap.add_argument("--fail", action="store_true", help="exit 3 without writing the model")
    args = ap.parse_args()
    per_label = {p.name: sum(1 for f in p.iterdir() if f.is_file())
                 for p in sorted(args.data.iterdir()) if p.is_dir()}
    print(json.dumps({"step": 1, "steps": 1, "images": per_label}), flush=True)
    if args.fail:
        return 3
    shutil.copy(args.source / args.file, args.out / args.file)
    (args.out / "metrics.json").write_text(json.dumps({"images": per_label,
                                                       "cwd": str(Path.cwd())}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
