"""Frame sent -> result seen on the PLC side, against the inspect answer, bus on and bus off
interleaved (the issue 20 benchmark in docs/benchmarks.md).

    python tests/tools/plc_latency.py --rates 10,100 --seconds 15 --min-frames 600 --rounds 3 \
        --json plc-bench.json
    python tests/tools/plc_latency.py --baseline-tree /tmp/old-checkout ...   # before vs after

Two servers run the shipped model on the CPU side by side: "on" with both PLC servers (Modbus
and OPC UA, Basic256Sha256 SignAndEncrypt, a user and password), "off" with none. Each round
runs, at each rate, ``visionserve plc-sim`` three times in a rotating order: the line alone
against "off", the Modbus PLC against "on", the OPC UA PLC against "on" (the simulator is also
the line: inspect API, part ids 1, 2, 3 ...). A box shared with other work moves every figure,
so the comparisons are made inside a round, then the median over the rounds is reported.
``--baseline-tree DIR`` adds a third server, with both PLC servers, run from another checkout
(an earlier commit), and its Modbus and OPC UA runs to each round: before and after a change
under the same load. The simulator is always this checkout's.


- answer p99 on / off: the inspect answer's p99 with the PLC servers running, over the one of the
  line alone in the same round (what the bus costs the answer path);
- added p99 (issue 20's figure): p99 of frame sent -> result seen on the PLC side, minus the
  inspect answer's p99, both from the same run;
- per-frame added p99: p99 over frames of (result seen on the PLC side - that frame's answer);
- CPU per frame (user + system, from /proc): the serving process on and off (what the bus costs
  it, whatever else runs on the box), the PLC server processes, and the simulator (a real PLC is
  another machine; here it takes the same two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from conftest import ServerProcess, free_port  # the tests' server handle

USER, PASSWORD = "plc", "bench-password-1"


class Server(ServerProcess):
    """A ``visionserve serve`` run from ``tree`` (this checkout, or a baseline's)."""

    def __init__(self, name: str, work: Path, plc: bool, models: Path, tree: Path = REPO) -> None:
        self.name, self.work = name, work
        port = free_port()
        self.modbus = f"127.0.0.1:{free_port()}" if plc else None
        self.opcua = f"opc.tcp://127.0.0.1:{free_port()}" if plc else None
        self.password_file = work / "plc.pw"
        self.password_file.write_text(PASSWORD)
        args = [sys.executable, "-m", "visionserve", "serve", "--host", "127.0.0.1",
                "--http-port", str(port), "--grpc-port", "-1", "--device", "cpu",
                "--models", str(models), "--log-level", "warning"]
        if plc:
            args += ["--modbus", self.modbus, "--opcua", self.opcua, "--opcua-user", USER,
                     "--opcua-password-file", str(self.password_file),
                     "--plc-data-dir", str(work / "plcdata")]
        env = {**os.environ, "PYTHONPATH": str(tree)}  # (python -m puts the tree first anyway)
        with open(work / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(args, cwd=str(tree), stdout=log, stderr=subprocess.STDOUT,
                                    env=env)
        super().__init__(proc, port, -1, work / f"{name}.log", args)


def sim(server: Server, protocol: str | None, rate: float, count: int, images: str,
        out: Path) -> dict:
    args = [sys.executable, "-m", "visionserve", "plc-sim", "--url", server.url,
            "--rate", f"{rate:g}", "--count", str(count), "--images", images, "--json", str(out),
            "--model", "defect-classifier"]
    if protocol == "modbus":
        args += ["--modbus", server.modbus]
    elif protocol == "opcua":
        args += ["--opcua", server.opcua, "--user", USER, "--password-file",
                 str(server.password_file), "--cert-dir", str(server.work / "sim-pki")]
    proc = subprocess.run(args, cwd=str(REPO), capture_output=True, text=True, timeout=600,
                          check=False)
    if proc.returncode not in (0, 1) or not out.exists():
        raise SystemExit(f"plc-sim failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return json.loads(out.read_text())


def loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_s(server: Server) -> tuple[float, float]:
    """CPU seconds of the serving process, and of its child processes (the PLC servers)."""
    p = psutil.Process(server.proc.pid)
    own = sum(p.cpu_times()[:2])
    kids = 0.0
    for c in p.children(recursive=True):
        try:
            kids += sum(c.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return own, kids


def sim_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="10,100")
    p.add_argument("--seconds", type=float, default=15.0, help="per run [%(default)s]")
    p.add_argument("--min-frames", type=int, default=20,
                   help="at least this many frames a run (a p99 wants hundreds) [%(default)s]")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--images", default="gen:160x160:n=8", help="[%(default)s]: at model size")
    p.add_argument("--models", type=Path, default=REPO / "models")
    p.add_argument("--protocols", default="modbus,opcua")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="also a server with PLC servers from this checkout "
                        "(runs named <protocol>@base)")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    protocols = [x for x in args.protocols.split(",") if x]
    work = Path(tempfile.mkdtemp(prefix="plc-bench-"))
    servers = {}
    for name, plc, tree in (("on", True, REPO), ("off", False, REPO),
                            ("base", True, args.baseline_tree)):
        if tree is not None:
            (work / name).mkdir()
            servers[name] = Server(name, work / name, plc, args.models, tree)
    runs: list[dict] = []
    try:
        for s in servers.values():
            s.wait_ready(180)
        for s in servers.values():  # warm up: first frames load code paths
            sim(s, None, 20, 40, args.images, work / "warm.json")
        kinds = [("off", None)] + [(name, proto) for name in ("on", "base") if name in servers
                                   for proto in protocols]
        for rnd in range(args.rounds):
            for rate in rates:
                order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]
                for name, proto in order:
                    server = servers[name]
                    kind = None if proto is None else proto if name == "on" else f"{proto}@base"
                    out = work / f"r{rnd}-{rate:g}-{kind or 'off'}.json"
                    la = loadavg()
                    count = max(args.min_frames, round(rate * args.seconds))
                    (own0, kids0), sim0 = cpu_s(server), sim_cpu_s()
                    rep = sim(server, proto, rate, count, args.images, out)
                    (own1, kids1), sim1 = cpu_s(server), sim_cpu_s()
                    ms = 1000 / count  # CPU seconds -> ms per frame
                    run = {"round": rnd, "rate": rate, "kind": kind or "off", "loadavg": la,
                           "answer": rep["line"]["answer_ms"],
                           "answered_200": rep["line"]["answered_200"],
                           "cpu_ms_per_frame": {"server": round((own1 - own0) * ms, 3),
                                                "plc_processes": round((kids1 - kids0) * ms, 3),
                                                "simulator": round((sim1 - sim0) * ms, 3)}}
                    if proto is not None:
                        e = rep["protocols"][proto]
                        run |= {"seen": e["seen_ms"], "added": e["added_ms"],
                                "missing": e["missing"], "in_order": e["in_order"],
                                "bus": e["server_bus_delay"]}
                    runs.append(run)
                    print(json.dumps(run), flush=True)
    finally:
        for s in servers.values():
            s.stop()
    based = [f"{x}@base" for x in protocols if "base" in servers]
    summary = summarize(runs, rates, protocols + based)
    for line in summary["table"]:
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    return 0


def summarize(runs: list[dict], rates: list[float], protocols: list[str]) -> dict:
    def med(values: list[float]) -> float:
        return round(statistics.median(values), 2)

    table = [("| rate | protocol | answer p50 / p99 off | answer p50 / p99 on | answer p99 on "
              "/ off | seen on the PLC p50 / p99 | added p99 (seen p99 - answer p99) | per-frame "
              "added p50 / p99 | missing, in order | CPU ms/frame: server off / on, PLC "
              "processes, simulator |"),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    out: dict = {}
    for rate in rates:
        off = {r["round"]: r for r in runs if r["rate"] == rate and r["kind"] == "off"}
        for proto in protocols:
            on = [r for r in runs if r["rate"] == rate and r["kind"] == proto]
            ratio = [r["answer"]["p99"] / off[r["round"]]["answer"]["p99"] for r in on]
            added = [r["seen"]["p99"] - r["answer"]["p99"] for r in on]
            s = {"answer_off_p50": med([off[r["round"]]["answer"]["p50"] for r in on]),
                 "answer_off_p99": med([off[r["round"]]["answer"]["p99"] for r in on]),
                 "answer_on_p50": med([r["answer"]["p50"] for r in on]),
                 "answer_on_p99": med([r["answer"]["p99"] for r in on]),
                 "answer_p99_on_over_off": med(ratio),
                 "seen_p50": med([r["seen"]["p50"] for r in on]),
                 "seen_p99": med([r["seen"]["p99"] for r in on]),
                 "added_p99": med(added), "added_rounds": [round(a, 2) for a in added],
                 "frame_added_p50": med([r["added"]["p50"] for r in on]),
                 "frame_added_p99": med([r["added"]["p99"] for r in on]),
                 "missing": sum(r["missing"] for r in on),
                 "in_order": all(r["in_order"] for r in on),
                 "cpu_server_off": med([off[r["round"]]["cpu_ms_per_frame"]["server"] for r in on]),
                 "cpu_server_on": med([r["cpu_ms_per_frame"]["server"] for r in on]),
                 "cpu_plc": med([r["cpu_ms_per_frame"]["plc_processes"] for r in on]),
                 "cpu_sim": med([r["cpu_ms_per_frame"]["simulator"] for r in on])}
            out[f"{rate:g}/{proto}"] = s
            table.append(
                f"| {rate:g}/s | {proto} | {s['answer_off_p50']} / {s['answer_off_p99']} | "
                f"{s['answer_on_p50']} / {s['answer_on_p99']} | {s['answer_p99_on_over_off']}x | "
                f"{s['seen_p50']} / {s['seen_p99']} | {s['added_p99']} ({s['added_rounds']}) | "
                f"{s['frame_added_p50']} / {s['frame_added_p99']} | {s['missing']}, "
                f"{'yes' if s['in_order'] else 'NO'} | {s['cpu_server_off']} / "
                f"{s['cpu_server_on']}, "
                f"{s['cpu_plc']}, {s['cpu_sim']} |")
    return {"per": out, "table": table}


if __name__ == "__main__":
    sys.exit(main())
