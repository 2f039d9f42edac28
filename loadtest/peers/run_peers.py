"""Run visionserve and its peers side by side with the same model file and the same generator.

Start every target at once (peers in their own venvs under .work/peers/, made by
setup_venvs.sh), run ``visionserve bench`` against each at a fixed rate (p50/p99, CPU), then
sweep the rate upwards going round the targets in turn at each step (a shared machine's free CPU
drifts; interleaving spreads the drift over all targets), dropping a target once its p99 exceeds
the budget twice in a row at one rate. Then stop them all and write a comparison table into docs/benchmarks.md (between
the ``peers:begin``/``peers:end`` markers) and .work/peers/results/peers.json.

    .venv/bin/python loadtest/peers/run_peers.py --models models --model defect-classifier

Targets: visionserve (inspect API, and OIP HTTP binary), naive (FastAPI + onnxruntime, one
request one inference), litserve (LitServe batching, JSON/base64 body), triton (pytriton 0.7.0 /
Triton 2.51 dynamic batcher, OIP HTTP binary).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from visionserve_tools.bench import http_status

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).resolve().parent
WORK = Path(os.environ.get("PEERS_WORK", ROOT / ".work" / "peers"))
BEGIN, END = "<!-- peers:begin -->", "<!-- peers:end -->"

# name -> (venv or None for the project's, protocol, description)
TARGETS = {
    "visionserve": (None, "inspect", "visionserve, inspect API"),
    "visionserve-oip": (None, "oip", "visionserve, OIP v2 HTTP binary"),
    "visionserve-scaled": (None, "inspect", ("visionserve, inspect API, JPEGs decoded at reduced "
                                             "size (input.scaled_decode = true)")),
    "visionserve-full": (None, "inspect", ("visionserve, inspect API, JPEGs decoded in full "
                                           "(input.scaled_decode = false)")),
    "naive": ("naive", "inspect", "FastAPI + onnxruntime, one request one inference"),
    "litserve": ("litserve", "json", "LitServe 0.2.19, max_batch_size 32, batch_timeout 2 ms"),
    "triton": ("pytriton", "oip", "Triton 2.51 (pytriton 0.7.0), dynamic batcher, 2 ms delay"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Target:
    """One server of ``TARGETS``, started. A peer runs its venv's Python, or ``python`` where given
    (the GPU machine, run_peers_gpu.py), with ``--device`` where it is not the CPU."""

    def __init__(self, name: str, args: argparse.Namespace, logdir: Path, *, device: str = "cpu",
                 python: str | None = None) -> None:
        self.name = name
        venv, self.protocol, self.description = TARGETS[name]
        self.port = free_port()
        self.grpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        models, model = str(args.models), args.model
        if venv is None:
            if name in ("visionserve-scaled", "visionserve-full"):
                models = str(decode_copy(args.models, model, scaled=name == "visionserve-scaled"))
            cmd = [sys.executable, "-m", "visionserve", "serve", "--models", models, "--host", "127.0.0.1",
                   "--http-port", str(self.port), "--grpc-port", "-1", "--device", "cpu", "--log-level", "warning"]
            self.ready_url = self.url + "/v2/health/ready"
        else:
            py = python or str(WORK / venv / "bin" / "python")
            on = [] if device == "cpu" else ["--device", device]
            if name == "naive":
                cmd = [py, str(PEERS / "naive_server.py"), "--models", models, "--model", model,
                       "--port", str(self.port), *on]
                self.ready_url = self.url + "/v2/health/ready"
            elif name == "litserve":
                cmd = [py, str(PEERS / "litserve_server.py"), "--models", models, "--model", model,
                       "--port", str(self.port)]
                self.ready_url = self.url + "/health"
            else:
                libdir = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                                        capture_output=True, text=True, check=True).stdout.strip()
                # Triton's Python-backend stub must load this venv's libpython first
                env["LD_LIBRARY_PATH"] = libdir + os.pathsep + env.get("LD_LIBRARY_PATH", "")
                cmd = [py, str(PEERS / "pytriton_server.py"), "--models", models, "--model", model,
                       "--http-port", str(self.port), "--grpc-port", str(self.grpc_port),
                       "--metrics-port", str(free_port()), *on]
                self.ready_url = f"{self.url}/v2/models/{model}/ready"
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 -- the server's log, for its lifetime
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            if http_status(self.ready_url) == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            # SIGINT: pytriton stops Triton on KeyboardInterrupt; uvicorn and visionserve drain on it
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only its own children
                self.proc.wait()
        self._log.close()


def decode_copy(models: Path, model: str, *, scaled: bool) -> Path:
    """A repository holding only ``model``, with ``scaled_decode`` set to ``scaled`` in its
    [input], whatever its model.toml says (the model's files are linked, not copied)."""
    toml = (models / model / "model.toml").read_text()
    value = f"scaled_decode = {'true' if scaled else 'false'}"
    toml, n = re.subn(r"(?m)^scaled_decode\s*=\s*\w+", value, toml)
    if not n:
        toml = toml.replace("[input]\n", f"[input]\n{value}\n", 1)
    root = WORK / ("scaled-models" if scaled else "full-models")
    folder = root / model
    if folder.exists():
        for p in folder.iterdir():
            p.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    for p in (models / model).iterdir():
        if p.name != "model.toml":
            (folder / p.name).symlink_to(p.resolve())
    (folder / "model.toml").write_text(toml)
    return root


def parse_rates(text: str) -> list[float]:
    sys.path.insert(0, str(ROOT))
    from visionserve_tools.bench import parse_rates as parse

    return parse(text)


def bench(target: Target, args: argparse.Namespace, out: Path, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "visionserve", "bench", "--url", target.url, "--protocol", target.protocol,
           "--model", args.model, "--images", args.images, "--budget-ms", str(args.budget_ms),
           "--processes", str(args.processes), "--server-pid", str(target.proc.pid), "--label", target.name,
           "--json", str(out), "--quiet", *extra]
    print("  $", " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT), check=False)
    if r.returncode not in (0, 1) or not out.exists():
        raise RuntimeError(f"bench failed for {target.name}: {r.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", type=Path, default=ROOT / "models")
    p.add_argument("--model", default="defect-classifier")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma list of " + ", ".join(TARGETS))
    p.add_argument("--images", default="gen:640x480")
    p.add_argument("--budget-ms", type=float, default=200.0, help="p99 budget (the takt window)")
    p.add_argument("--fixed-rate", type=float, default=20.0, help="frames/s for the p50/p99/CPU columns")
    p.add_argument("--sweep", default="10:200:10", help="rates for the max-rate-at-budget sweep")
    p.add_argument("--duration-s", type=float, default=6.0)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--out", type=Path, default=WORK / "results")
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--no-setup", action="store_true", help="do not run setup_venvs.sh")
    args = p.parse_args()
    names = [n.strip() for n in args.targets.split(",") if n.strip()]
    bad = [n for n in names if n not in TARGETS]
    if bad:
        p.error(f"unknown targets {bad}; choose from {list(TARGETS)}")
    venvs = sorted({TARGETS[n][0] for n in names if TARGETS[n][0]})
    if venvs and not args.no_setup:
        subprocess.run(["bash", str(PEERS / "setup_venvs.sh"), *venvs], check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    # All servers run at once and every load step goes round the targets in turn, so that the
    # drift of a shared machine's free CPU spreads over all of them instead of favouring one.
    targets: dict[str, Target] = {}
    failed: dict[str, str] = {}
    try:
        for name in names:
            targets[name] = Target(name, args, args.out)
        for name, t in targets.items():
            try:
                t.wait_ready()
            except RuntimeError as exc:
                failed[name] = str(exc)
        live = [n for n in names if n not in failed]
        common = ["--duration-s", str(args.duration_s), "--warmup-s", "1"]
        fixed: dict[str, dict] = {}
        for name in live:
            print(f"== {name}: fixed rate {args.fixed_rate:g}/s", flush=True)
            extra = ["--bare", "--models", str(args.models)] if name == "visionserve" else []
            try:
                fixed[name] = bench(targets[name], args, args.out / f"{name}-fixed.json",
                                    ["--rate", str(args.fixed_rate), *common, *extra])
            except RuntimeError as exc:
                failed[name] = str(exc)
        steps: dict[str, list[dict]] = {n: [] for n in live}
        active = [n for n in live if n not in failed]
        for rate in parse_rates(args.sweep):
            if not active:
                break
            for name in list(active):
                try:
                    r = bench(targets[name], args, args.out / f"{name}-rate{rate:g}.json",
                              ["--rate", str(rate), *common])
                except RuntimeError as exc:
                    failed[name] = str(exc)
                    active.remove(name)
                    continue
                run = r["runs"][0]
                if not run["within_slo"]:
                    # one retry: on a shared machine a single stall can push a short step's p99 over
                    r = bench(targets[name], args, args.out / f"{name}-rate{rate:g}-retry.json",
                              ["--rate", str(rate), *common])
                    run = r["runs"][0] if r["runs"][0]["within_slo"] else run
                steps[name].append(run)
                print(f"   {name} {rate:g}/s: p50 {run['latency_ms']['p50']} p99 {run['latency_ms']['p99']} ms, "
                      f"misses {run['miss_ratio']}, {'ok' if run['within_slo'] else 'OVER'}", flush=True)
                if not run["within_slo"]:
                    active.remove(name)
    finally:
        for t in targets.values():
            t.stop()
    rows = []
    for name in names:
        if name in failed and name not in fixed:
            rows.append({"target": name, "description": TARGETS[name][2], "error": failed[name]})
            continue
        f = fixed[name]["runs"][0]
        ok = [s for s in steps.get(name, []) if s["within_slo"]]
        if steps.get(name):
            from visionserve_tools.benchclient import report as rep

            rep.plot_sweep(steps[name], str(args.out / f"{name}-sweep.png"), args.budget_ms, name)
        rows.append({
            "target": name, "description": TARGETS[name][2], "protocol": TARGETS[name][1],
            "max_rate_at_budget": max((s["offered_rate"] for s in ok), default=None),
            "throughput_at_budget": max((s["throughput_fps"] for s in ok), default=None),
            "steps": [{k: s.get(k) for k in ("offered_rate", "throughput_fps", "latency_ms", "miss_ratio",
                                             "errors", "server_cpu_cores", "within_slo")} for s in steps.get(name, [])],
            "fixed_rate": args.fixed_rate, "p50_ms": f["latency_ms"]["p50"], "p99_ms": f["latency_ms"]["p99"],
            "miss_ratio": f["miss_ratio"], "cpu_cores": f.get("server_cpu_cores"),
            "cpu_ms_per_frame": f.get("server_cpu_ms_per_frame"),
            "mean_batch": (f.get("batch_size_server") or {}).get("mean_batch_size")
            or f["batch_size_per_frame"]["mean"],
            "errors": f["errors"], "bare": fixed[name].get("bare"), "vs_bare": f.get("vs_bare"),
            "meta": fixed[name]["meta"],
        })
        print(f"{name}: max rate at p99 <= {args.budget_ms:g} ms: {rows[-1]['max_rate_at_budget']}; at "
              f"{args.fixed_rate:g}/s p50 {rows[-1]['p50_ms']} p99 {rows[-1]['p99_ms']} ms, "
              f"CPU {rows[-1]['cpu_cores']} cores", flush=True)
    result = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "args": vars(args) | {
                  "models": str(args.models), "out": str(args.out), "docs": str(args.docs)}, "rows": rows}
    (args.out / "peers.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_docs(args, result)
    return 0


def _f(v, nd=1) -> str:
    return "—" if v is None else f"{v:.{nd}f}"


def table(args: argparse.Namespace, result: dict) -> str:
    rows = result["rows"]
    ok = [r for r in rows if "error" not in r and r["max_rate_at_budget"]]
    vs = next((r for r in ok if r["target"] == "visionserve"), None)
    best_peer = max((r for r in ok if not r["target"].startswith("visionserve")),
                    key=lambda r: r["max_rate_at_budget"], default=None)
    meta = next((r["meta"] for r in rows if "meta" in r), {})
    lines = [
        (f"Measured {result['date']} on `{meta.get('host', '?')}` ({meta.get('cpus', '?')} CPUs, "
         f"{meta.get('cpu_model', '?')}; load average at start {meta.get('load_average_at_start')}), "
         f"model `{args.model}` from `{args.models}`, images `{args.images}`, p99 budget {args.budget_ms:g} ms."),
        "",
        f"Command: `{result['command']}`",
        "",
        (f"| target | protocol | max rate at p99 ≤ {args.budget_ms:g} ms (frames/s) "
         f"| p50 at {args.fixed_rate:g}/s (ms) "
         f"| p99 at {args.fixed_rate:g}/s (ms) | server CPU (cores) | server CPU per frame (ms) | mean batch "
         "| what it is |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['target']} | | failed: {r['error'][:80]} | | | | | | {r['description']} |")
            continue
        lines.append(f"| {r['target']} | {r['protocol']} | {_f(r['max_rate_at_budget'], 0)} | {_f(r['p50_ms'], 2)} "
                     f"| {_f(r['p99_ms'], 2)} | {_f(r['cpu_cores'], 2)} | {_f(r['cpu_ms_per_frame'], 2)} "
                     f"| {_f(r['mean_batch'], 2)} | {r['description']} |")
    lines.append("")
    if vs and vs.get("bare"):
        b = vs["bare"]["batch_sizes"]
        parts = [f"bs {k}: pipeline {v['pipeline_fps']:.1f} frames/s, model alone {v['model_fps']:.1f} frames/s"
                 for k, v in b.items()]
        lines.append("Bare model in the same run (decode + resize + normalise + model + softmax, one thread): "
                     + "; ".join(parts) + ".")
        bp = max(v["pipeline_fps"] for v in b.values())
        lines.append("Max rate at budget / best bare pipeline throughput: " + ", ".join(
            f"{r['target']} {r['max_rate_at_budget'] / bp:.2f}" for r in ok) + ".")
    if best_peer:
        for r in ok:
            if r["target"].startswith("visionserve"):
                lines.append(f"{r['target']} / best peer ({best_peer['target']}) at the budget: "
                             f"{r['max_rate_at_budget'] / best_peer['max_rate_at_budget']:.2f}x.")
    return "\n".join(lines)


def write_docs(args: argparse.Namespace, result: dict) -> None:
    block = f"{BEGIN}\n{table(args, result)}\n{END}"
    path = args.docs
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip() + "\n\n## Peers side by side\n\n" + block + "\n"
    path.write_text(text)
    print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
