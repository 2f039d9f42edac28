"""Train the compact defect classifier and write a new model version.

    nice -n 10 python -m visionserve_tools.training.train         # the shipped model
    python -m visionserve_tools.training.train --data my_photos --name my-line --init \\
        models/defect-classifier/1/weights.pt                      # fine-tune on real photos

Writes ``<models-dir>/<name>/<N>/`` (N = highest existing + 1; ``--models-dir`` default
``./models``) with ``weights.pt``, ``model.onnx``, ``model.pt2``, ``metrics.json`` and
``export.json``; writes ``<models-dir>/<name>/model.toml`` too if the model has none yet.
Training data is either the synthetic generator (default) or ``--data``: one sub-folder per
label of PNG/JPEG/BMP photos, with ``--mix-synthetic SHARE`` the synthetic images mixed in as that
share of the training set (the model's original data, for a fine-tune on a few labelled frames).

The closed loop's fine-tune (docs/closed-loop.md) writes exactly into one folder:

    python -m visionserve_tools.training.train --data labelled --init 1/weights.pt \
        --steps 800 --keep-batch-norm --lr 0.001 --mix-synthetic 0.5 --out candidates/c-1

``--steps N`` runs N optimizer steps (instead of ``--epochs``) and prints each as a JSON line
(``{"step": i, "steps": N, "loss": ...}``): the job's progress. ``--keep-batch-norm`` trains every
layer but keeps the features' batch-norm statistics (a few hundred labelled frames would skew
them); ``--freeze-backbone`` trains the classifier head only (the features and their
statistics stay as they are).
Seeded and single-process, so the same command on the same machine gives the same weights.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import cv2
import numpy as np

from visionserve import imaging

from . import common, export
from .common import ScriptError


def augment_geometry(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Flips, rotation +-12 deg, scale 0.9-1.1, shift +-5 %, and sometimes a JPEG re-encode, on
    uint8 model-resolution pixels (cheap: the frames were resized once, up front)."""
    out = np.empty_like(batch)
    n, h, w = batch.shape[:3]
    for i in range(n):
        img = batch[i]
        if rng.random() < 0.5:
            img = img[:, ::-1]
        if rng.random() < 0.5:
            img = img[::-1]
        if rng.random() < 0.7:
            m = cv2.getRotationMatrix2D((w / 2, h / 2), rng.uniform(-12, 12), rng.uniform(0.9, 1.1))
            m[:, 2] += rng.uniform(-0.05, 0.05, 2) * (w, h)
            border = cv2.BORDER_REFLECT_101 if rng.random() < 0.8 else cv2.BORDER_REPLICATE
            img = cv2.warpAffine(np.ascontiguousarray(img), m, (w, h), flags=cv2.INTER_LINEAR,
                                 borderMode=border)
        if rng.random() < 0.3:
            _, buf = cv2.imencode(".jpg", np.ascontiguousarray(img),
                                   [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(40, 96))])
            decoded = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
            assert decoded is not None  # it decodes what it just encoded
            img = decoded.reshape(img.shape)
        out[i] = img
    return out


def photometric(x, gen):
    """Brightness x0.6-1.4, contrast x0.8-1.2 and Gaussian noise (sigma up to 10 levels) on a
    float NHWC 0..255 torch batch; torch's RNG is fast where numpy's normals were the bottleneck."""
    import torch

    n = x.shape[0]
    gain = torch.empty(n, 1, 1, 1).uniform_(0.6, 1.4, generator=gen)
    contrast = torch.empty(n, 1, 1, 1).uniform_(0.8, 1.2, generator=gen)
    mean = x.mean(dim=(1, 2, 3), keepdim=True)
    x = (x - mean) * contrast + mean
    x = x * gain
    sigma = torch.empty(n, 1, 1, 1).uniform_(0, 10, generator=gen)
    sigma = sigma * (torch.rand(n, 1, 1, 1, generator=gen) < 0.6)
    x = x + torch.randn(x.shape, generator=gen) * sigma
    return x.clamp_(0, 255)


def evaluate(model, pixels: np.ndarray, targets: np.ndarray, spec,
             device) -> tuple[float, np.ndarray]:
    import torch

    model.eval()
    preds = []
    with torch.no_grad():
        for i in range(0, len(pixels), 64):
            x = torch.from_numpy(imaging.normalize(pixels[i:i + 64], spec)).to(device)
            preds.append(model(x).argmax(1).cpu().numpy())
    p = np.concatenate(preds)
    return float((p == targets).mean()), p


def split(ds: common.Dataset, val_fraction: float,
          seed: int) -> tuple[common.Dataset, common.Dataset]:
    """Stratified, seeded train/validation split of a photo dataset."""
    rng = np.random.default_rng(seed)
    tr_list: list[int] = []
    va_list: list[int] = []
    for c in range(len(ds.labels)):
        idx = np.flatnonzero(ds.targets == c)
        rng.shuffle(idx)
        k = max(1, round(len(idx) * val_fraction)) if len(idx) > 1 else 0
        va_list += idx[:k].tolist()
        tr_list += idx[k:].tolist()
    tr, va = np.sort(tr_list), np.sort(va_list)

    def take(ix: np.ndarray) -> common.Dataset:
        return common.Dataset(ds.pixels[ix], ds.targets[ix], ds.labels, [ds.names[i] for i in ix])
    return take(tr), take(va)


def mix_synthetic(real: common.Dataset, share: float, args: argparse.Namespace,
                  spec) -> common.Dataset:
    """``real`` with synthetic images (the training parameters, ``--sizes``) added as ``share``
    of the result, spread evenly over the synthetic labels that ``real`` has."""
    known = [name for name in common.LABELS if name in real.labels]
    if not known:
        raise ScriptError(f"--mix-synthetic: the synthetic generator makes {list(common.LABELS)}, "
                          f"none of this model's labels {list(real.labels)}")
    want = round(len(real.targets) * share / (1.0 - share))
    per_label = max(1, -(-want // len(known)))
    syn = common.synthetic_dataset(per_label, args.seed + 7, common.parse_sizes(args.sizes),
                                   common.synthetic.TRAIN_PARAMS, spec, args.workers)
    index = {name: real.labels.index(name) for name in known}
    keep = np.flatnonzero(np.isin(np.asarray(syn.labels)[syn.targets], known))
    targets = np.array([index[syn.labels[t]] for t in syn.targets[keep]], dtype=real.targets.dtype)
    print(f"data: {len(keep)} synthetic images mixed in ({share:.0%} of the training set)",
          flush=True)
    return common.Dataset(np.concatenate([real.pixels, syn.pixels[keep]]),
                          np.concatenate([real.targets, targets]), real.labels,
                          real.names + [f"synthetic-{i}" for i in keep])


def write_model_toml(model_dir: Path, labels: tuple[str, ...], spec) -> None:
    ok = ["ok"] if "ok" in labels else [labels[0]]
    fmt = common.toml_list
    text = f"""# Written by visionserve_tools.training.train; see docs/model-toml.md for every \
field.
description = "Surface defect classifier trained with visionserve_tools.training.train"
task = "classification"

{common.input_section(spec)}
[output]
tensor_name = "{common.ONNX_OUTPUT}"
labels = {fmt(labels)}
activation = "softmax"

[verdict]
ok_labels = {fmt(tuple(ok))}
ok_threshold = 0.5
"""
    (model_dir / "model.toml").write_text(text)
    common.read_model_config(model_dir)  # refuse to leave an invalid file behind


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--name", default="defect-classifier",
                    help="model name (folder under --models-dir)")
    ap.add_argument("--models-dir", type=Path, default=Path("models"))
    ap.add_argument("--data", type=Path, help="folder-per-label photos; default: synthetic images")
    ap.add_argument("--init", type=Path, help="weights.pt to start from (fine-tuning)")
    ap.add_argument("--n-per-label", type=int, default=800,
                    help="synthetic training images per label")
    ap.add_argument("--val-per-label", type=int, default=40,
                    help="synthetic validation images per label")
    ap.add_argument("--sizes", default="640x480,1280x1024", help="synthetic camera frame sizes")
    ap.add_argument("--input-size", type=int, default=common.DEFAULT_INPUT.width,
                    help="model input width = height in pixels (new models only)")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2,
                    help="torch CPU threads (fixed, for reproducibility)")
    ap.add_argument("--workers", type=int, default=2, help="processes generating synthetic images")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--version", type=int, help="version number to write (default: highest + 1); "
                    "must not exist yet")
    ap.add_argument("--check-per-label", type=int, default=10,
                    help="held-out images per label for the export agreement check")
    ap.add_argument("--steps", type=int,
                    help="train this many optimizer steps (one pass) instead of --epochs")
    ap.add_argument("--freeze-backbone", action="store_true",
                    help="train the last layer only (with --init: a short fine-tune)")
    ap.add_argument("--keep-batch-norm", action="store_true",
                    help="every layer trains, but the backbone's batch-norm statistics stay "
                    "the --init model's (a fine-tune on a few hundred frames)")
    ap.add_argument("--mix-synthetic", type=float, default=0.0, metavar="SHARE",
                    help="with --data: synthetic images as this share (0..<1) of the training set")
    ap.add_argument("--out", type=Path, help="write the version's files into this folder "
                    "(created; must not hold weights.pt) instead of <models-dir>/<name>/<N>")
    args = ap.parse_args(argv)
    try:
        return train(args, argv if argv is not None else sys.argv[1:])
    except ScriptError as exc:
        return common.fail(exc)
    except export.ExportMismatch as exc:
        print(f"error: EXPORT CHECK FAILED: {exc}", file=sys.stderr)
        return 1


def train(args: argparse.Namespace, argv: list[str]) -> int:
    for name in ("n_per_label", "val_per_label", "epochs", "batch_size", "threads", "workers",
                 "check_per_label"):
        if getattr(args, name) < 1:
            raise ScriptError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps is not None and args.steps < 1:
        raise ScriptError(f"--steps must be >= 1, got {args.steps}")
    if not 0.0 <= args.mix_synthetic < 1.0:
        raise ScriptError(f"--mix-synthetic must be from 0 to below 1, got {args.mix_synthetic}")
    if args.keep_batch_norm and args.freeze_backbone:
        raise ScriptError("--keep-batch-norm trains every layer, --freeze-backbone the last one: "
                          "pass one of them")
    if args.mix_synthetic and args.data is None:
        raise ScriptError("--mix-synthetic mixes synthetic images into --data: pass --data")
    if args.out is not None and (args.out / "weights.pt").exists():
        raise ScriptError(f"--out {args.out} already holds weights.pt; not overwriting it")
    if args.out is None:
        common.check_new_version(args.models_dir / args.name, args.version)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ScriptError(f"--device {args.device}: CUDA is not available here")
    model_dir = args.models_dir / args.name
    t_start = time.perf_counter()

    init_meta = None
    if args.init is not None:
        init_model, init_meta = common.load_checkpoint(args.init)
        spec = common.InputSpec(**init_meta["input"])
    else:
        cfg = common.read_model_config(model_dir)
        spec = cfg.input if cfg is not None else common.DEFAULT_INPUT.model_copy(
            update={"width": args.input_size, "height": args.input_size})

    if args.data is not None:
        labels = None
        if init_meta is not None:
            names = {p.name for p in args.data.iterdir() if p.is_dir()} if args.data.is_dir() \
                else set()
            if names <= set(init_meta["labels"]):
                labels = init_meta["labels"]    # keep the head: same label order as the base model
        full = common.load_folder(args.data, spec, labels)
        train_ds, val_ds = split(full, 0.15, args.seed)
        check_x = imaging.normalize(val_ds.pixels if len(val_ds.pixels) else train_ds.pixels, spec)
        print(f"data: {len(train_ds.targets)} training / {len(val_ds.targets)} validation photos "
              f"from {args.data}, labels {list(full.labels)}")
        if args.mix_synthetic:
            train_ds = mix_synthetic(train_ds, args.mix_synthetic, args, spec)
    else:
        sizes = common.parse_sizes(args.sizes)
        train_ds = common.synthetic_dataset(args.n_per_label, args.seed, sizes,
                                            common.synthetic.TRAIN_PARAMS, spec, args.workers)
        val_ds = common.synthetic_dataset(args.val_per_label,
                                          common.VALIDATION_SEED + args.seed * 1000, sizes,
                                          common.synthetic.TRAIN_PARAMS, spec, args.workers)
        check_x = export.check_inputs({"labels": common.LABELS, "input": spec.model_dump()}, None,
                                      args.check_per_label)
    labels = tuple(train_ds.labels)
    t_data = time.perf_counter() - t_start
    print(f"data ready: {len(train_ds.targets)} train, {len(val_ds.targets)} val images "
          f"({t_data:.0f} s)", flush=True)

    # torch from here on (the data above is numpy and OpenCV, seeded on its own): a bad dataset
    # is refused without the seconds torch takes to import, and the seeds are set before the
    # model is built, as before
    import torch

    common.set_determinism(args.seed, args.threads)
    device = torch.device(args.device)
    widths = tuple(init_meta["widths"]) if init_meta else common.DEFAULT_WIDTHS
    model = common.build_model(len(labels), widths, spec.channels)
    if init_meta is not None:
        state = init_model.state_dict()
        if tuple(init_meta["labels"]) != labels:   # new label set: keep the features, new head
            state = {k: v for k, v in state.items() if not k.startswith("4.")}
        model.load_state_dict(state, strict=False)
    model.to(device)
    if args.freeze_backbone:
        model[0].requires_grad_(False)

    steps_per_epoch = max(1, len(train_ds.targets) // args.batch_size)
    if args.steps is not None:
        args.epochs, steps_per_epoch = 1, args.steps
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, epochs=args.epochs,
                                                steps_per_epoch=steps_per_epoch, pct_start=0.15)
    loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=0.05)
    gen = torch.Generator().manual_seed(args.seed)
    history = []
    for epoch in range(args.epochs):
        model.train()
        if args.freeze_backbone or args.keep_batch_norm:
            model[0].eval()  # the features' batch-norm statistics stay the base model's
        rng = np.random.default_rng([args.seed, epoch])
        n = len(train_ds.targets)
        passes = -(-steps_per_epoch * args.batch_size // n)  # --steps may need more than one
        order = np.concatenate([rng.permutation(n) for _ in range(max(1, passes))])
        t0, total, correct, seen = time.perf_counter(), 0.0, 0, 0
        for b in range(steps_per_epoch):
            idx = np.sort(order[b * args.batch_size:(b + 1) * args.batch_size])
            px = augment_geometry(train_ds.pixels[idx], rng)
            # the server's normalisation, on the augmented (float) pixels
            x = torch.from_numpy(imaging.normalize(photometric(torch.from_numpy(px).float(), gen)
                                                   .numpy(), spec)).to(device)
            y = torch.from_numpy(train_ds.targets[idx]).to(device)
            logits = model(x)
            loss = loss_fn(logits, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(idx)
            correct += int((logits.argmax(1) == y).sum())
            seen += len(idx)
            if args.steps is not None:
                print(json.dumps({"step": b + 1, "steps": args.steps,
                                  "loss": round(float(loss.detach()), 4)}), flush=True)
        val_acc, _ = evaluate(model, val_ds.pixels, val_ds.targets, spec, device) \
            if len(val_ds.targets) else (float("nan"), None)
        history.append({"epoch": epoch + 1, "loss": round(total / seen, 4),
                        "train_acc": round(correct / seen, 4), "val_acc": round(val_acc, 4),
                        "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(history[-1]), flush=True)
    t_train = time.perf_counter() - t_start - t_data

    if args.out is not None:
        version_dir = args.out
        version_dir.mkdir(parents=True, exist_ok=True)
    else:
        version_dir = common.make_version_dir(model_dir, args.version)
    model = model.cpu().eval()
    meta = {"labels": list(labels), "widths": list(widths), "input": spec.model_dump(mode="json"),
            "seed": args.seed}
    torch.save({"state_dict": model.state_dict(), "meta": json.dumps(meta)},
               version_dir / "weights.pt")
    if args.out is None and not (model_dir / "model.toml").is_file():
        write_model_toml(model_dir, labels, spec)
    report = export.export_version(version_dir, check_x)
    metrics = {
        "command": "python -m visionserve_tools.training.train " + shlex.join(argv),
        "data": str(args.data) if args.data else "synthetic",
        "mix_synthetic": args.mix_synthetic, "steps": args.steps,
        "freeze_backbone": args.freeze_backbone, "keep_batch_norm": args.keep_batch_norm,
        "train_images": len(train_ds.targets), "val_images": len(val_ds.targets),
        "labels": list(labels), "input": meta["input"], "widths": list(widths),
        "macs": common.count_macs(widths, spec.width, spec.height, spec.channels),
        "history": history, "final_val_acc": history[-1]["val_acc"], "device": str(device),
        **common.run_facts(model, args.threads, t_start, t_data, t_train),
        "export": report,
    }
    (version_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(f"wrote {version_dir} (val acc {history[-1]['val_acc']:.4f}, "
          f"{metrics['seconds']['total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
