"""A fixed-length PyTorch training loop, the guard's GPU-sharing benchmark job (issue 22).

    python -m visionserve_tools.trainloop --device cuda --seconds 30 [--model resnet50]
        [--batch-size 64] [--size 224] [--workers 2] [--no-amp]

Trains a torchvision classifier (random weights) on random images that ``--workers`` data-loader
processes hand over (pinned, copied non-blocking), for ``--seconds`` after ``--warmup-steps``.
It knows nothing of the guard: what the guard injects (memory cap, cooperative yielding) comes
through the environment. Prints JSON lines, flushed: ``{"event": "warm", "wall": ...}`` when
the timed part starts, ``{"event": "tick", ...}`` every second (steps so far), and at the end
``{"event": "done", "steps", "seconds", "steps_per_s", "step_ms_p50", "step_ms_p99", "hook",
...}`` (``hook``: the guard's yield hook was installed in this process). Exit 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seconds", type=float, default=30.0, help="timed training, after warm-up")
    ap.add_argument("--model", default="resnet50", help="a torchvision classifier name")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--size", type=int, default=224, help="square input size")
    ap.add_argument("--workers", type=int, default=2, help="data-loader processes")
    ap.add_argument("--data-size", type=int, default=None,
                    help="size the workers hand over, scaled up to --size on the device (default "
                         "half of it: little shared memory, /dev/shm in containers is often 64 MB)")
    ap.add_argument("--warmup-steps", type=int, default=10)
    ap.add_argument("--amp", action=argparse.BooleanOptionalAction, default=True,
                    help="bf16 autocast on cuda (default on)")
    args = ap.parse_args(argv)

    import torch
    import torchvision
    from torch.utils.data import DataLoader, IterableDataset

    cuda = args.device.startswith("cuda")
    dev = torch.device(args.device)
    if not cuda:
        torch.set_num_threads(1)
    batch, size = args.batch_size, args.size
    data_size = args.data_size or max(8, size // 2)

    class Images(IterableDataset):
        """Endless batches of uint8 images with labels, from the worker processes: four random
        batches each, in turn (making new ones would make the loop wait for its data)."""

        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            g = torch.Generator().manual_seed(info.id if info else 0)
            made = [(torch.randint(0, 256, (batch, 3, data_size, data_size), dtype=torch.uint8,
                                   generator=g),
                     torch.randint(0, 10, (batch,), generator=g)) for _ in range(4)]
            i = 0
            while True:
                x, y = made[i % 4]
                i += 1
                yield x.clone(), y.clone()

    loader = DataLoader(Images(), batch_size=None, num_workers=args.workers,
                        pin_memory=cuda, persistent_workers=args.workers > 0,
                        prefetch_factor=2 if args.workers else None)
    net = getattr(torchvision.models, args.model)(weights=None, num_classes=10).to(dev)
    if cuda:
        net = net.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and args.amp)

    def step(x, y) -> None:
        x = x.to(dev, non_blocking=True).float().div_(255)
        if data_size != size:
            x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear",
                                                align_corners=False)
        if cuda:
            x = x.contiguous(memory_format=torch.channels_last)
        y = y.to(dev, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    it = iter(loader)
    for _ in range(args.warmup_steps):
        step(*next(it))
    sync()
    t0 = time.monotonic()
    emit(event="warm", wall=time.time(), device=str(dev), model=args.model, batch_size=batch,
         size=size)
    times: list[float] = []
    last_tick = t0
    steps = 0
    while True:
        s0 = time.monotonic()
        step(*next(it))
        sync()  # per-step time is the GPU's too; costs the loop little (one step in flight)
        now = time.monotonic()
        times.append(now - s0)
        steps += 1
        if now - last_tick >= 1.0:
            last_tick = now
            emit(event="tick", wall=time.time(), steps=steps, seconds=round(now - t0, 3))
        if now - t0 >= args.seconds:
            break
    took = time.monotonic() - t0
    times.sort()
    emit(event="done", wall=time.time(), steps=steps, seconds=round(took, 3),
         steps_per_s=round(steps / took, 3),
         step_ms_p50=round(1000 * times[len(times) // 2], 2),
         step_ms_p99=round(1000 * times[min(len(times) - 1, int(0.99 * len(times)))], 2),
         hook="visionserve_guard_yield" in sys.modules,
         peak_gpu_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
