"""What the front ends' traffic costs the engine's loop, the one interpreter they all share, in
one process, rounds alternating (a ratio, good on a noisy machine):

* ``per_answer``: sending answers, per task: a loop turn's answers pickled as one message
  (``framing.encode``) and unpickled in the front end, with the answers' own pickling
  (``tasks.base.pickled_as_fields``; a classification's scores as float32 bytes) and with the
  dataclasses' default pickling;
* ``per_frame_intake``: taking a frame from a front end's arena (``hub.Link._frame``): a copy
  (the server's way) against a view in place that holds its request's lease (zero-copy mode,
  ``Link.zero_copy``), for JPEGs of 41 KB (a 640x480 frame) to 1.2 MB.

    python -m visionserve_tools.benchwire --out wire.json

Answers: a classification of 3 labels, detections of 1 and 5 objects (with a rule that made the
part NG), and an anomaly answer with a 64x64 map; 32 answers a message, each its own object (a
repeated object would be pickled once). Figures: microseconds per answer, medians of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def answers() -> dict[str, Callable[[], Any]]:
    from visionserve.execution.results import FrameResult
    from visionserve.tasks.anomaly import Anomaly, FrameRegion
    from visionserve.tasks.classification import Classified
    from visionserve.tasks.detection import Detected, Detection
    from visionserve.tasks.rules import Reason

    def envelope(result: Any) -> FrameResult:
        return FrameResult("NG", result, 32, 1.0, 2.0, 3.0, True)

    def detected(k: int) -> FrameResult:
        return envelope(Detected(tuple(Detection("scratch", 1, 0.9, (1.0, 2.0, 30.0, 40.0), 1064.0)
                                       for _ in range(k)),
                                 (Reason("defect:scratch", "a scratch", (0,)),)))

    return {
        "classification, 3 labels": lambda: envelope(Classified(
            "scratch", 1, 0.7, np.array([0.1, 0.7, 0.2], np.float32))),
        "detection, 1 object": lambda: detected(1),
        "detection, 5 objects": lambda: detected(5),
        "anomaly, 64x64 map": lambda: envelope(Anomaly(
            0.8, 12.5, (FrameRegion((1.0, 2.0, 3.0, 4.0), 5.0, 0.9),), 1, ("area",),
            np.zeros((64, 64), np.float32))),
    }


def _classes() -> tuple[type, ...]:
    from visionserve.execution.results import FrameResult
    from visionserve.tasks.anomaly import Anomaly, FrameRegion
    from visionserve.tasks.classification import Classified
    from visionserve.tasks.detection import Detected, Detection
    from visionserve.tasks.rules import Reason

    return (FrameResult, Classified, Detection, Detected, Reason, FrameRegion, Anomaly)


def measure(rounds: int = 7, encodes: int = 200, per_message: int = 32) -> dict[str, Any]:
    from visionserve.framing import encode

    classes = _classes()
    # each class's own pickling (``__reduce__``: pickled_as_fields, or a task's own); without it
    # the dataclass's default (its __getstate__ over the fields, numpy's for an array)
    own = {c: c.__dict__["__reduce__"] for c in classes}

    def use(theirs: bool) -> None:
        for c in classes:
            if theirs:
                c.__reduce__ = own[c]  # type: ignore[method-assign]
            elif "__reduce__" in c.__dict__:
                delattr(c, "__reduce__")

    out: dict[str, Any] = {}
    try:
        for name, make in answers().items():
            msgs = [("result", i, [make()], 1) for i in range(per_message)]
            runs: dict[str, list[tuple[float, float]]] = {"fields": [], "default": []}
            for _ in range(rounds):
                for mode, figures in runs.items():
                    use(mode == "fields")
                    t = time.perf_counter()
                    for _ in range(encodes):
                        wire = encode(msgs)
                    enc = (time.perf_counter() - t) / encodes / per_message * 1e6
                    t = time.perf_counter()
                    for _ in range(encodes):
                        pickle.loads(wire[4:])
                    dec = (time.perf_counter() - t) / encodes / per_message * 1e6
                    figures.append((enc, dec))
            med = {m: (statistics.median(e for e, _ in v), statistics.median(d for _, d in v))
                   for m, v in runs.items()}
            out[name] = {
                "engine_pickle_us": {m: round(v[0], 2) for m, v in med.items()},
                "front_end_unpickle_us": {m: round(v[1], 2) for m, v in med.items()},
                "pickle_ratio_fields_over_default": round(med["fields"][0] / med["default"][0], 3),
            }
    finally:
        use(True)
    return out


def intake(rounds: int = 9, repeat: int = 10, sizes_kb: tuple[int, ...] = (41, 100, 200, 400, 1200)
           ) -> dict[str, Any]:
    """Microseconds the engine's loop takes to make a Frame of one arena extent: copied, or in
    place; 64 extents spread over a 256 MiB arena, as a front end's are."""
    from visionserve.frontends import hub
    from visionserve.frontends.arena import Arena, ArenaReader, create_memfd

    size = 256 << 20
    fd = create_memfd(size)
    writer, reader = Arena(fd, size), ArenaReader(fd, size)
    link = hub.Link.__new__(hub.Link)  # only _frame and its arena
    link.arena = reader
    out: dict[str, Any] = {}
    try:
        for kb in sizes_kb:
            data = np.random.default_rng(kb).integers(0, 256, kb * 1024, np.uint8).tobytes()
            offs = []
            for _ in range(64):
                off = writer.alloc(len(data))
                assert off is not None
                writer.write(off, data)
                offs.append(off)
            runs: dict[str, list[float]] = {"copy": [], "zero_copy": []}
            for _ in range(rounds):
                for mode, figures in runs.items():
                    t = time.perf_counter()
                    for _ in range(repeat):
                        for off in offs:
                            lease: Any = object() if mode == "zero_copy" else None
                            link._frame(("jpeg", 640, 480, 3, None, off, len(data), None), lease)
                    figures.append((time.perf_counter() - t) / (repeat * len(offs)) * 1e6)
            for off in offs:
                writer.free(off, len(data))
            out[f"{kb} KB"] = {m: round(statistics.median(v), 2) for m, v in runs.items()}
    finally:
        reader.close()
        writer.close()
        os.close(fd)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m visionserve_tools.benchwire", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--encodes", type=int, default=200, help="messages encoded per round")
    p.add_argument("--out", help="write the results here as JSON")
    args = p.parse_args(argv)
    report = {"per_answer": measure(args.rounds, args.encodes),
              "per_frame_intake": intake(args.rounds),
              "setup": {"rounds": args.rounds, "encodes": args.encodes, "answers_per_message": 32}}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
