"""GPU peers side by side, in one run on one machine: visionserve, Triton through pytriton, and a
naive FastAPI + torch server, with the same model, the same JPEGs and the same load generator.

    python loadtest/peers/run_peers_gpu.py --out gpu-peers.json [--quick] [--triton-python PY]

- Model: the GPU benchmark's ResNet-50 (``visionserve_tools.benchgpu.export_models``: random
  weights, 224x224, exported with ``torch.export``). visionserve serves it in fp16 with CUDA
  graphs; the peers run the same ``.pt2`` in fp16, eager (``common.load_torch``).
- Frames: 16 JPEGs of 640x480 (``benchgpu.make_jpegs``), decoded by nvJPEG in every target.
- Generator: ``benchgpu.load``, closed loop from several processes: one client (p50/p99), then
  saturation (throughput and p99 at the same number of clients).
- The targets run one after another, so that none shares the GPU with another. The bare model's
  batch-32 throughput (CUDA graph replay) is measured in the same run, for the ratios.

Targets: ``visionserve`` (``--frontends``, inspect API), ``visionserve-oip`` (the same server,
OIP v2 HTTP binary tensors: Triton's protocol), ``visionserve-ort`` (a server of its own serving
the same network exported to ONNX, fp32, on onnxruntime's CUDA execution provider, inspect API;
it needs onnxruntime-gpu, carried to the GPU machine by ``ORT=1 bash tests/gpu/peers_wheels.sh``,
and is an error where only the CPU build is installed), ``triton`` (pytriton 0.7.0 / Triton 2.51, its
dynamic batcher, max batch 32, 2 ms delay; OIP v2 HTTP binary), ``naive`` (FastAPI + torch,
one request one inference). fastapi and uvicorn must be importable by this Python, and pytriton by
``--triton-python`` (default: this one). pytriton 0.7.0 needs numpy < 2: where this Python has
numpy 2, give it a venv whose site-packages hold numpy 1.26 and pytriton, and a ``.pth`` file
naming this Python's site-packages (tests/gpu/run_on_device.sh, ``PEERS=1``, makes one). Triton's
Python-backend stub runs that venv's interpreter (it is first on Triton's PATH), so the stub sees
numpy 1.26 too; with numpy 2 it misreads BYTES inputs and dies.
``--device cpu`` runs the same comparison on the CPU, without the bare figure (a smoke test of
the harness; the CPU comparison proper is run_peers.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

PEERS = Path(__file__).resolve().parent
ROOT = PEERS.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(PEERS))

from run_peers import Target

from visionserve_tools import benchgpu
from visionserve_tools.benchclient import report

TARGETS = {
    "visionserve": "inspect",
    "visionserve-oip": "oip",
    "visionserve-ort": "inspect",
    "triton": "oip",
    "naive": "inspect",
}
MODEL = "rn50"
ORT_MODEL = "rn50-ort"  # the same network, exported to ONNX (benchgpu.export_models)


def measure(server, protocols: list[str], jpegs: list[bytes], args,
            model: str = MODEL) -> dict[str, dict]:
    """One client, then saturation, per protocol, against one running server; the batch sizes
    it ran at saturation from the OIP statistics extension (Triton's and visionserve's)."""
    out = {}
    for protocol in protocols:
        single = benchgpu.load(server, model, jpegs, 1, 1, args.single_s, protocol)
        before = report.scrape_oip_batch_stats(server.url, model)
        sat = benchgpu.load(server, model, jpegs, args.client_processes, args.threads,
                            args.saturation_s, protocol)
        sat["batches"] = report.oip_batch_delta(before,
                                                report.scrape_oip_batch_stats(server.url, model))
        out[protocol] = {"single_client": single, "saturation": sat}
        benchgpu.log(f"  {protocol}: one client p50 {single.get('p50_ms')} p99 "
                     f"{single.get('p99_ms')} ms; saturation {sat.get('throughput_per_s')}/s "
                     f"p99 {sat.get('p99_ms')} ms, errors {sat.get('errors')}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--frontends", type=int, default=8)
    ap.add_argument("--client-processes", type=int, default=8)
    ap.add_argument("--threads", type=int, default=12, help="closed-loop senders per process")
    ap.add_argument("--single-s", type=float, default=6.0)
    ap.add_argument("--saturation-s", type=float, default=12.0)
    ap.add_argument("--quick", action="store_true", help="shorter phases")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    ap.add_argument("--triton-python", default=sys.executable,
                    help="the Python that runs pytriton (numpy < 2)")
    args = ap.parse_args(argv)
    if args.quick:
        args.single_s, args.saturation_s = 3.0, 5.0
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    bad = [n for n in names if n not in TARGETS]
    if bad:
        ap.error(f"unknown targets {bad}; choose from {list(TARGETS)}")
    log_dir = args.log_dir or args.out.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "command": " ".join([Path(sys.executable).name, *sys.argv]),
                 "setup": {"client_processes": args.client_processes, "threads": args.threads,
                           "frontends": args.frontends, "jpeg": "640x480"},
                 "targets": {}}

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=2, default=str) + "\n")

    with tempfile.TemporaryDirectory(prefix="gpupeers-") as tmp:
        repos = benchgpu.export_models(
            Path(tmp), ("rn50", ORT_MODEL) if "visionserve-ort" in names else ("rn50",))
        jpegs = benchgpu.make_jpegs()
        if args.device.startswith("cuda"):
            bare = benchgpu.bare(repos, jpegs, args.quick)
            graph = bare["torch_fp16_cuda_graph"]
            res["bare"] = {"device": bare["device"], "torch": bare["torch"],
                           "bs32_img_per_s": graph[32]["img_per_s"],
                           "bs1_run_p50_ms": graph[1]["run_device_input"]["p50_ms"]}
            save()
        models = repos["rn50"]
        budget = ("--gpu-memory-budget", "8GiB") if args.device.startswith("cuda") else ()
        # visionserve's targets: one server per model, each measured over its targets' protocols
        for model, vs, log_name in (
                (MODEL, [n for n in names if n in ("visionserve", "visionserve-oip")],
                 "visionserve.log"),
                (ORT_MODEL, [n for n in names if n == "visionserve-ort"],
                 "visionserve-ort.log")):
            if not vs:
                continue
            benchgpu.log(f"visionserve --frontends {args.frontends}, model {model}")
            try:
                s = benchgpu.Server(repos[model], log_dir / log_name, *budget, "--frontends",
                                    str(args.frontends), device=args.device)
            except RuntimeError as exc:
                res["targets"].update({n: {"error": str(exc)} for n in vs})
            else:
                try:
                    got = measure(s, [TARGETS[n] for n in vs], jpegs, args, model)
                    res["targets"].update({n: got[TARGETS[n]] for n in vs})
                finally:
                    s.stop()
            save()
        for name in [n for n in names if not n.startswith("visionserve")]:
            benchgpu.log(name)
            python = args.triton_python if name == "triton" else sys.executable
            t = Target(name, argparse.Namespace(models=models, model=MODEL), log_dir,
                       device=args.device, python=python)
            try:
                t.wait_ready()
                res["targets"][name] = measure(t, [TARGETS[name]], jpegs, args)[TARGETS[name]]
            except RuntimeError as exc:
                res["targets"][name] = {"error": str(exc), "log_tail": t.log_path.read_text(
                    errors="replace")[-3000:]}
            finally:
                t.stop()
            save()
    res["ratios"] = ratios(res)
    save()
    print(json.dumps({"bare": res.get("bare"), "ratios": res["ratios"]}, indent=2))
    return 0


def ratios(res: dict) -> dict:
    """Each target's saturation against the bare model, and visionserve's against each peer."""
    sat = {n: t["saturation"] for n, t in res["targets"].items()
           if "saturation" in t and t["saturation"].get("answers")}
    out: dict = {}
    if "bare" in res:
        rate = res["bare"]["bs32_img_per_s"]
        out.update({f"{n}_vs_bare_bs32": round(s["throughput_per_s"] / rate, 3)
                    for n, s in sat.items()})
    for v in ("visionserve", "visionserve-oip", "visionserve-ort"):
        for peer in ("triton", "naive"):
            if v in sat and peer in sat:
                out[f"{v}_vs_{peer}"] = {
                    "throughput": round(sat[v]["throughput_per_s"] / sat[peer]["throughput_per_s"],
                                        2),
                    "p99_ms": [sat[v]["p99_ms"], sat[peer]["p99_ms"]]}
    return out


if __name__ == "__main__":
    sys.exit(main())
