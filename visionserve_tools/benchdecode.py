"""Where a GPU batch's preparation time goes, on a CUDA machine: the JPEG decoders apart and in the
served preprocessor, alone and beside a busy Python thread (the serving process's event loop),
from one thread and from two at once.

    python -m visionserve_tools.benchdecode --out decode.json
    PYTHONPATH=<nvimgcodec and nvjpeg wheels>:$PYTHONPATH \
        python -m visionserve_tools.benchdecode --only nvimgcodec --out decode-hw.json

(nvImageCodec runs in a process of its own: the nvJPEG it brings is not the one torchvision was
built with, and torchvision's decoder failed with CUDA error 700 beside it on the H200.)

Figures (wall ms per batch of 32 JPEGs, 640x480 and 1080p; medians):

* ``torchvision_nvjpeg``: ``torchvision.io.decode_jpeg(list, device="cuda")``, what the
  preprocessor uses: nvJPEG with its hardware backend where the GPU has JPEG engines (baseline
  JPEGs in one batched call; others through the hybrid CUDA backend, one by one), one call at a
  time per process, returning when its stream is done (docs/gpu.md);
* ``nvimgcodec_hw``: nvImageCodec with the hardware backend only (the GPU's JPEG engines), where
  ``nvidia-nvimgcodec-cu13`` and ``nvidia-nvjpeg`` are importable;
* ``prepare``: ``TorchPreprocessor.prepare`` (decode, resize, normalise) of the ResNet-50 bench
  model's input, as served: one TorchScript call (``gpu/onecall.py``);
* ``prepare_eager``: the same with ``one_call=False`` (some 40 torch calls from Python), and its
  two halves (decode, assemble);
* each ``alone``, ``busy_python_thread`` (one more thread spinning in Python, as the event loop
  does under load: a call that holds the interpreter stretches), and ``two_threads`` (batches per
  second of two threads calling at once: whether the decoder runs two batches side by side).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from visionserve_tools.benchgpu import wall_ms

ROUNDS = 30
SIZES = (("640x480", (480, 640)), ("1080p", (1080, 1920)))


def _median_ms(fn: Callable[[], object]) -> float:
    return wall_ms(fn, ROUNDS)["p50_ms"]


def _busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(1000):
            x += 1


def measure(fn: Callable[[], object], frames: int) -> dict:
    """``fn`` runs one batch of ``frames`` and waits for its device work."""
    out: dict = {"alone_ms": _median_ms(fn)}
    stop = threading.Event()
    hog = threading.Thread(target=_busy, args=(stop,), daemon=True)
    hog.start()
    try:
        out["busy_python_thread_ms"] = _median_ms(fn)
    finally:
        stop.set()
        hog.join()
    done = [0, 0]
    t_end = time.perf_counter() + 2.0

    def worker(k: int) -> None:
        while time.perf_counter() < t_end:
            fn()
            done[k] += 1

    t0 = time.perf_counter()
    workers = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    out["img_per_s_one_thread"] = round(frames / out["alone_ms"] * 1000)
    out["img_per_s_two_threads"] = round(sum(done) * frames / wall)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("decode.json"))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--only", choices=("torchvision", "nvimgcodec"), default="torchvision",
                    help="torchvision: its nvJPEG decoder and the preprocessor; nvimgcodec: the "
                         "hardware decoder alone")
    ap.add_argument("--switch-interval-ms", type=float, default=0.5,
                    help="Python's switch interval (the serving process's default); a figure "
                         "beside the busy thread that grows with it is time spent waiting for "
                         "the interpreter")
    args = ap.parse_args(argv)
    sys.setswitchinterval(args.switch_interval_ms / 1000)

    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from visionserve import imaging
    from visionserve.gpu.preprocess import TorchPreprocessor
    from visionserve_tools.benchgpu import export_models, make_jpegs

    res: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "batch": args.batch, "switch_interval_ms": args.switch_interval_ms}
    stream = torch.cuda.Stream()

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=2) + "\n")

    hw = None
    if args.only == "nvimgcodec":
        try:
            from nvidia import nvimgcodec

            hw = nvimgcodec.Decoder(
                backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)])
            res["nvimgcodec"] = getattr(nvimgcodec, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 -- recorded: the machine or the wheels lack it
            res["nvimgcodec"] = f"unavailable: {exc!r}"[:300]
            save()
            return 1
    if hw is not None:  # the hardware decoder alone: no model, no torchvision decode
        for name, (h, w) in SIZES:
            jpegs = (make_jpegs(16, h, w) * 4)[:args.batch]

            def nvic(jpegs=jpegs) -> None:
                imgs = hw.decode(jpegs, cuda_stream=stream.cuda_stream)
                stream.synchronize()
                if any(i is None for i in imgs):
                    raise RuntimeError("the hardware decoder refused a frame")

            try:
                res[name] = {"nvimgcodec_hw": measure(nvic, args.batch)}
            except Exception as exc:  # noqa: BLE001 -- recorded
                res[name] = {"nvimgcodec_hw": {"error": repr(exc)[:300]}}
            save()
            print(name, json.dumps(res[name]), flush=True)
    else:
        import tempfile

        from visionserve.backends.torch import TorchBackend
        from visionserve.config import load_model_config

        with tempfile.TemporaryDirectory(prefix="benchdecode-") as tmp:
            repos = export_models(Path(tmp), ("rn50",))
            cfg = load_model_config(repos["rn50"] / "rn50" / "model.toml")
            backend = TorchBackend()
            backend.load(repos["rn50"] / "rn50" / "1" / "model.pt2", cfg, "cuda:0")
            for name, (h, w) in SIZES:
                jpegs = (make_jpegs(16, h, w) * 4)[:args.batch]
                part: dict = {"jpeg_bytes_mean": int(statistics.fmean(len(j) for j in jpegs))}
                datas = [torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs]

                def tv(datas=datas) -> None:
                    with torch.cuda.stream(stream):
                        decode_jpeg(datas, mode=ImageReadMode.RGB, device="cuda")
                    stream.synchronize()

                part["torchvision_nvjpeg"] = measure(tv, args.batch)
                frames = [imaging.encoded_frame(j) for j in jpegs]
                prep, eager = (TorchPreprocessor.for_config(
                    cfg, device="cuda:0", dtype=backend.input_dtype, stream=backend.stream,
                    channels_last=backend.channels_last, one_call=flag) for flag in (True, False))
                for p in (prep, eager):
                    p.warmup((args.batch,))

                def full(prep=prep, frames=frames) -> None:
                    prep.prepare(frames, args.batch)
                    backend.stream.synchronize()

                def full_eager(eager=eager, frames=frames) -> None:
                    eager.prepare(frames, args.batch)
                    backend.stream.synchronize()

                def halves(eager=eager, frames=frames) -> tuple[float, float]:
                    with torch.cuda.stream(backend.stream), torch.inference_mode():
                        t0 = time.perf_counter()
                        images, _ = eager._decode_all(frames)
                        backend.stream.synchronize()
                        t1 = time.perf_counter()
                        eager._assemble([images[i] for i in sorted(images)], args.batch)
                        backend.stream.synchronize()
                        t2 = time.perf_counter()
                    return (t1 - t0) * 1000, (t2 - t1) * 1000

                part["prepare"] = measure(full, args.batch)
                part["prepare"]["one_call_batches"] = prep.counts["one_call"]
                part["prepare_eager"] = measure(full_eager, args.batch)
                split = [halves() for _ in range(ROUNDS)]
                part["prepare_eager"]["decode_all_ms"] = round(
                    statistics.median(a for a, _ in split), 3)
                part["prepare_eager"]["assemble_ms"] = round(
                    statistics.median(b for _, b in split), 3)
                res[name] = part
                save()
                print(name, json.dumps(part), flush=True)
            backend.close()
    res["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
