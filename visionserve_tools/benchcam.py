"""Trigger to verdict with the server's own cameras, timed where the PLC sees it.

A PLC (``visionserve plc-sim --trigger``, a process of its own, as a PLC is a machine of its own)
triggers a station over Modbus TCP with a numeric part id; the server grabs a frame from the
station's camera, inspects it and puts the part's result in the station's result registers; the
PLC reads them every millisecond and times each part from its trigger write to its result. Each
scenario is a server of its own, started with no tuning flag, on the shipped classifier, and
beside it the bare figure of the same run: the camera's pixels made into a frame, prepared and
run through the model at batch 1, no server (:func:`.benchshipped.bare_reference`).

Cameras:

* ``gige`` (the default): Aravis's GigE Vision camera simulator, the one
  ``arv-fake-gv-camera-0.8`` (Debian ``aravis-tools``) runs, software-triggered, hosted by this
  tool so that it looks for a trigger 1,000 times a second rather than the command's 25
  (:func:`simulate`). One listens on 127.0.0.1; the two of ``--soak`` listen on the two ends of
  a veth pair made for the run (``ip link``: root), since a simulator takes GigE Vision's port on
  every address of loopback.
* ``--replay`` (the GPU machine, where the simulator's packages cannot be installed): a camera
  source of this tool (``replay:``) that hands out recorded frames from memory, so the
  measurement starts at the source interface: no acquisition and no GigE Vision transfer.

Scenarios: 640x480 Mono8, and the simulator's largest frame, 2048x2048 BayerRG8; one camera,
``--count`` parts at ``--rate``. ``--soak SECONDS``: two cameras at 640x480 Mono8, each triggered
``--soak-rate`` times a second for that long, then the accounting: every trigger answered at the
PLC, and every frame the cameras sent (the frame ids of the parts' records, and the sources'
own drops) a verdict or a counted fault.

  python -m visionserve_tools.benchcam --json docs/results/cameras-cpu-2026-12-06.json
  python -m visionserve_tools.benchcam --soak 600 --json docs/results/cameras-soak-cpu.json
  python -m visionserve_tools.benchcam --replay --device cuda --json cameras-gpu.json

Exit codes: 0 done, every trigger answered (and, with --soak, every frame accounted for);
1 a trigger unanswered or a frame not accounted for; 2 bad arguments or a missing tool.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .benchgpu import Server, free_port, get, log
from .benchshipped import bare_reference

REPO = Path(__file__).resolve().parents[1]
MODEL = "defect-classifier"
SIMULATOR = "Aravis's GigE Vision camera simulator"
#: (name, width, height, pixel format, triggers a second): one camera each; the large frame's
#: rate is what the simulator sends on loopback (about 8 such frames a second on the VM)
SCENARIOS = (("640x480 Mono8", 640, 480, "Mono8", 20.0),
             ("2048x2048 BayerRG8", 2048, 2048, "BayerRG8", 5.0))
SOAK = ("640x480 Mono8", 640, 480, "Mono8")
#: GigE Vision packets of 9000 bytes (jumbo frames, as docs/cameras.md tunes a camera NIC; the
#: loopback and the veth pair carry them)
PACKET_SIZE = 9000
#: how often the simulator looks for a software trigger (see :func:`simulate`)
TRIGGER_HZ = 200.0
#: the veth pair of --soak's two simulators
VETH = (("vscam0", "10.77.0.1"), ("vscam1", "10.77.0.2"))


# --- the recorded frames of --replay --------------------------------------------------------

def recorded(width: int, height: int, pixel_format: str, n: int = 8) -> list[np.ndarray]:
    """``n`` synthetic parts (OK and defects) as the camera's pixels in ``pixel_format``."""
    from visionserve.cameras import pixels
    from visionserve_tools import synthetic

    out = []
    for i in range(n):
        rgb = synthetic.generate(synthetic.LABELS[i % len(synthetic.LABELS)], seed=i,
                                 size=(width, height))[..., ::-1]  # BGR -> RGB
        fmt = pixels.get_format(pixel_format)
        if fmt.layout == "mono":
            out.append(np.ascontiguousarray(rgb.mean(axis=2).round().astype(np.uint8)))
        elif fmt.layout == "bayer":
            out.append(pixels.mosaic(np.ascontiguousarray(rgb), pixel_format[5:7]))
        else:
            raise SystemExit(f"--replay takes Mono8 or Bayer formats, not {pixel_format}")
    return out


class Replay:
    """``replay:WIDTHxHEIGHT`` with ``settings = { pixel_format = "..." }``: a camera that hands
    out recorded frames in turn, each grab at once, with frame ids from 1 and the wall clock as
    its timestamp."""

    def __init__(self, name: str, uri: str, settings: Mapping[str, Any]) -> None:
        from visionserve.cameras.source import own_settings

        own = own_settings(name, "replay", settings, ("pixel_format",))
        width, height = (int(v) for v in uri.split(":", 1)[1].split("x"))
        self.name = name
        self.uri = uri
        self.pixel_format = str(own.get("pixel_format", "Mono8"))
        self.frames = recorded(width, height, self.pixel_format)
        self.sent = 0

    def describe(self) -> str:
        return self.uri

    def open(self) -> None:
        pass

    def grab(self, timeout_s: float):
        from visionserve.cameras.source import Grabbed

        self.sent += 1
        return Grabbed(self.frames[self.sent % len(self.frames)], self.pixel_format,
                       camera_time=time.time(), frame_id=self.sent)

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"frames": self.sent}


def serve(argv: list[str]) -> int:
    """``python -m visionserve_tools.benchcam serve ...``: ``visionserve serve`` with the
    ``replay:`` camera source registered."""
    from visionserve.cameras.source import register
    from visionserve.cli import main

    register("replay", Replay)
    return main(argv)


# --- cameras ---------------------------------------------------------------------------------

def simulate(address: str, serial: str, trigger_hz: float) -> int:
    """``python -m visionserve_tools.benchcam simulate ADDRESS SERIAL TRIGGER_HZ``: Aravis's
    GigE Vision camera simulator (the ``ArvGvFakeCamera`` that ``arv-fake-gv-camera-0.8`` runs)
    on ``address``, looking for a software trigger ``trigger_hz`` times a second. The command
    line tool looks 25 times a second: at most 25 triggered frames a second, each 0-40 ms late.
    Runs until SIGTERM."""
    import signal

    import gi

    gi.require_version("Aravis", "0.8")
    from gi.repository import Aravis, GLib

    camera = Aravis.GvFakeCamera.new(address, serial)
    if not camera.is_running():
        print(f"the simulator could not start on {address}", file=sys.stderr)
        return 1
    camera.get_fake_camera().set_trigger_frequency(trigger_hz)
    loop = GLib.MainLoop()
    GLib.unix_signal_add(GLib.PRIORITY_DEFAULT, signal.SIGTERM, loop.quit)
    loop.run()
    return 0


@contextlib.contextmanager
def simulators(addresses: list[str], log_dir: Path) -> Iterator[list[str]]:
    """A simulator on each address; yields their serials."""
    from visionserve.cameras import gige

    procs, serials = [], []
    try:
        for i, address in enumerate(addresses):
            serial = f"BENCH{i}"
            out = open(log_dir / f"simulator-{i}.log", "ab")  # noqa: SIM115 - the process's log
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "visionserve_tools.benchcam", "simulate", address, serial,
                 str(TRIGGER_HZ)], stdout=out, stderr=subprocess.STDOUT))
            out.close()
            deadline = time.monotonic() + 20
            while (found := gige.probe(address, 0.2)) is None or found.serial != serial:
                if procs[-1].poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the simulator on {address} did not answer; see {log_dir}")
            serials.append(serial)
        yield serials
    finally:
        for p in procs:
            p.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(10)


@contextlib.contextmanager
def veth_pair() -> Iterator[list[str]]:
    """Two addresses on the two ends of a veth pair, removed afterwards."""
    (a, ip_a), (b, ip_b) = VETH
    subprocess.run(["ip", "link", "del", a], capture_output=True, check=False)
    steps = [["ip", "link", "add", a, "type", "veth", "peer", "name", b],
             ["ip", "addr", "add", f"{ip_a}/24", "dev", a],
             ["ip", "addr", "add", f"{ip_b}/24", "dev", b],
             ["ip", "link", "set", a, "up"], ["ip", "link", "set", b, "up"]]
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"two simulated cameras need a veth pair (root): "
                                 f"{' '.join(step)}: {done.stderr.strip()}")
        yield [ip_a, ip_b]
    finally:
        subprocess.run(["ip", "link", "del", a], capture_output=True, check=False)


def recipes(path: Path, sources: list[str], pixel_format: str, width: int, height: int,
            replay: bool) -> list[str]:
    """A recipes file with one software-triggered camera per source; the cameras' names."""
    names, text = [], []
    for i, source in enumerate(sources):
        name = f"cam{i + 1}"
        settings = (f'{{ pixel_format = "{pixel_format}" }}' if replay else
                    f'{{ pixel_format = "{pixel_format}", roi = [0, 0, {width}, {height}], '
                    f'packet_size = {PACKET_SIZE} }}')
        text.append(f'[camera.{name}]\nsource = "{source}"\nmodel = "{MODEL}"\n'
                    f'settings = {settings}\n')
        names.append(name)
    path.write_text("\n".join(text))
    return names


# --- one scenario ------------------------------------------------------------------------------

def bare(width: int, height: int, pixel_format: str, device: str, quick: bool) -> dict:
    """The bare figure: the camera's pixels into a frame, prepared, and the model at batch 1."""
    from visionserve.cameras import pixels

    frame = recorded(width, height, pixel_format, n=1)[0]
    res = bare_reference(REPO / "models", MODEL, {}, device, quick, inputs={
        f"{width}x{height}": lambda: pixels.to_frame(frame, pixel_format)})
    return {"device": res["device"], "backend": res["backend"],
            "model_ms": res["one"]["ms"], **res["single_frame_pipeline"][f"{width}x{height}"]}


def plc_sim(modbus: str, units: list[int], rate: float, count: int, out: Path,
            log_path: Path) -> dict:
    """``visionserve plc-sim --trigger``: its JSON report."""
    args = [sys.executable, "-m", "visionserve", "plc-sim", "--modbus", modbus, "--trigger",
            "--units", ",".join(map(str, units)), "--rate", str(rate), "--count", str(count),
            "--json", str(out)]
    with open(log_path, "ab") as f:
        f.write(f"\n=== {' '.join(args)}\n".encode())
        f.flush()
        done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, check=False,
                              timeout=count / rate + 300)
    if not out.exists():
        raise RuntimeError(f"plc-sim exited {done.returncode} without a report; see {log_path}")
    report = json.loads(out.read_text())
    report["exit_code"] = done.returncode
    return report


def camera_counts(server: Server) -> dict[str, dict[str, float]]:
    """The cameras' series of ``/metrics``: camera -> {frames, faults_<reason>, source_drops,
    ..., and the mean of each histogram in ms: trigger_to_frame_ms, frame_to_verdict_ms}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = get(server.url + "/metrics", 10)
    out: dict[str, dict[str, float]] = {}
    if status != 200:
        return out
    for family in text_string_to_metric_families(body.decode()):
        if not family.name.startswith("visionserve_camera_"):
            continue
        key = family.name.removeprefix("visionserve_camera_")
        sums: dict[str, dict[str, float]] = {}
        for sample in family.samples:
            if "camera" not in sample.labels:
                continue
            camera = sample.labels["camera"]
            if sample.name.endswith(("_sum", "_count")):  # a histogram: its mean
                sums.setdefault(camera, {})[sample.name.rsplit("_", 1)[1]] = sample.value
                continue
            if not sample.name.endswith("_total"):
                continue
            name = key + (f"_{sample.labels['reason']}" if "reason" in sample.labels else "")
            counts = out.setdefault(camera, {})
            counts[name] = counts.get(name, 0) + sample.value
        for camera, h in sums.items():
            if h.get("count"):
                out.setdefault(camera, {})[key.removesuffix("_seconds") + "_ms_mean"] = \
                    round(h.get("sum", 0.0) / h["count"] * 1000, 3)
    return out


#: GigE Vision 1.x block ids are 16 bits: 1..65535, then 1 again (0 is never a frame's)
BLOCK_IDS = 65535


def frames_accounted(records: Path, cameras: list[str], counts: dict) -> dict:
    """Per camera, from the parts' records in the order they were made: the camera's frame ids
    (each once; 16-bit ids wrap from 65535 to 1), the ids missing between one record's and the
    next's, against the frames the source counted lost, and the faults the server counted."""
    out = {}
    with contextlib.closing(sqlite3.connect(f"file:{records}?mode=ro", uri=True)) as db:
        for camera in cameras:
            ids = [r[0] for r in db.execute(
                "SELECT camera_frame FROM records WHERE camera = ? AND camera_frame IS NOT NULL "
                "ORDER BY time, id", (camera,))]
            c = counts.get(camera, {})
            wrap = BLOCK_IDS if ids and max(ids) <= BLOCK_IDS else None
            steps = [(b - a) % wrap if wrap else b - a for a, b in itertools.pairwise(ids)]
            repeated = sum(1 for d in steps if d <= 0)
            gaps = sum(d - 1 for d in steps if d > 1)
            faults = sum(v for k, v in c.items() if k.startswith("faults_"))
            drops = c.get("source_drops", 0)
            out[camera] = {"records": len(ids), "frame_ids_repeated": repeated,
                           "first_frame_id": ids[0] if ids else None,
                           "last_frame_id": ids[-1] if ids else None, "frame_ids_missing": gaps,
                           "source_drops": drops, "faults": faults,
                           "ok": repeated == 0 and gaps <= drops}
    return out


def models_of(work: Path) -> Path:
    """A model repository of the shipped classifier alone (the server starts sooner)."""
    models = work / "models"
    if not (models / MODEL).is_dir():
        shutil.copytree(REPO / "models" / MODEL, models / MODEL)
    return models


def scenario(name: str, width: int, height: int, pixel_format: str, *, cameras: int,
             rate: float, count: int, args: argparse.Namespace, work: Path) -> dict:
    """One server with ``cameras`` cameras, triggered by one plc-sim; its figures."""
    log_path = work / "bench.log"
    res: dict = {"scenario": name, "cameras": cameras, "rate_hz_per_camera": rate,
                 "parts_per_camera": count}
    res["bare"] = bare(width, height, pixel_format, args.device, args.quick)
    with contextlib.ExitStack() as stack:
        if args.replay:
            sources = [f"replay:{width}x{height}"] * cameras
        else:
            addresses = ["127.0.0.1"] if cameras == 1 else stack.enter_context(veth_pair())
            serials = stack.enter_context(simulators(addresses, work))
            sources = [f"gige://{a}" for a in addresses]
            res["simulators"] = dict(zip(serials, addresses))
        names = recipes(work / "recipes.toml", sources, pixel_format, width, height, args.replay)
        modbus = f"127.0.0.1:{free_port()}"
        server = Server(models_of(work.parent), log_path, "--recipes", str(work / "recipes.toml"),
                        "--modbus", modbus, "--plc-stations", ",".join(names),
                        "--records", "--records-dir", str(work / "records"),
                        device=args.device, log_level=None, as_shipped=True,
                        module="visionserve_tools.benchcam" if args.replay else "visionserve")
        stack.callback(server.stop)
        res["server_start_s"] = server.start_s
        res["execution"] = next((line.split("execution: ", 1)[1] for line in server.startup_log
                                 if "execution: " in line), None)
        report = plc_sim(modbus, list(range(1, cameras + 1)), rate, count,
                         work / f"plc-{name.replace(' ', '-')}.json", log_path)
        res["plc"] = report
        counts = camera_counts(server)
        res["camera_counts"] = counts
    res["accounting"] = frames_accounted(work / "records" / "records.sqlite", names, counts)
    return res


# --- main ------------------------------------------------------------------------------------

def summary(res: dict) -> list[str]:
    plc, b = res["plc"], res["bare"]
    lines = [(f"{res['scenario']}, {res['cameras']} camera(s) at "
              f"{res['rate_hz_per_camera']:g}/s: trigger -> result at the PLC p50 "
              f"{plc.get('p50_ms')} ms, p99 {plc.get('p99_ms')} ms, max {plc.get('max_ms')} ms; "
              f"bare (pixels -> frame, prepare, model bs 1) {b['total_ms']} ms on {b['device']}"),
             (f"  triggers {plc.get('triggers')}, results {plc.get('results')}, missing "
              f"{plc.get('missing')}, no decision {plc.get('no_decision')}, refused "
              f"{plc.get('refused')}")]
    for camera, acc in res["accounting"].items():
        means = res["camera_counts"].get(camera, {})
        lines.append(f"  {camera}: {acc['records']} records, frame ids {acc['first_frame_id']}.."
                     f"{acc['last_frame_id']} ({acc['frame_ids_missing']} missing, "
                     f"{acc['source_drops']:g} counted dropped), faults {acc['faults']:g}: "
                     f"{'accounted for' if acc['ok'] else 'NOT accounted for'}; mean trigger "
                     f"-> frame {means.get('trigger_to_frame_ms_mean')} ms, frame -> verdict "
                     f"{means.get('frame_to_verdict_ms_mean')} ms")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv)
    if argv[:1] == ["simulate"]:
        return simulate(argv[1], argv[2], float(argv[3]))
    ap = argparse.ArgumentParser(prog="python -m visionserve_tools.benchcam",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="the server's --device [%(default)s]")
    ap.add_argument("--replay", action="store_true",
                    help="recorded frames from memory instead of the GigE Vision simulator")
    ap.add_argument("--rate", type=float, default=None,
                    help="triggers a second [20 at 640x480, 5 at 2048x2048]")
    ap.add_argument("--count", type=int, default=1000, help="parts a scenario [%(default)s]")
    ap.add_argument("--scenario", choices=[s[0].split()[0] for s in SCENARIOS], default=None,
                    help="only this one of the scenarios [both]")
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="instead of the scenarios: two cameras at 640x480 Mono8 for this long")
    ap.add_argument("--soak-rate", type=float, default=30.0,
                    help="--soak: triggers a second per camera [%(default)s]")
    ap.add_argument("--quick", action="store_true", help="few iterations (a smoke run)")
    ap.add_argument("--work", type=Path, default=None, help="logs and records [a temp folder]")
    ap.add_argument("--json", type=Path, default=None, help="write the report here too")
    args = ap.parse_args(argv)
    if not args.replay:
        from visionserve.cameras import gige

        missing = gige.available()
        if missing is not None:
            print(f"{missing}; on a machine without Aravis use --replay", file=sys.stderr)
            return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="benchcam-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": dt.date.today().isoformat(), "device": args.device,
                    "cameras": "replay (recorded frames, from the source interface)"
                    if args.replay else f"{SIMULATOR} (GigE Vision on this host, trigger polled at "
                    f"{TRIGGER_HZ:g} Hz)",
                    "command": " ".join(["python -m visionserve_tools.benchcam", *argv]),
                    "runs": []}
    plan = ([(*SOAK, 2, args.soak_rate, round(args.soak * args.soak_rate))] if args.soak else
            [(*s[:4], 1, args.rate or s[4], args.count) for s in SCENARIOS
             if args.scenario in (None, s[0].split()[0])])
    ok = True
    for i, (name, width, height, fmt, cameras, rate, count) in enumerate(plan):
        log(f"{name}: {cameras} camera(s), {count} parts each at {rate:g}/s")
        sub = work / str(i)
        sub.mkdir(exist_ok=True)
        res = scenario(name, width, height, fmt, cameras=cameras, rate=rate, count=count,
                       args=args, work=sub)
        report["runs"].append(res)
        for line in summary(res):
            print(line, flush=True)
        ok &= res["plc"]["exit_code"] == 0 and not res["plc"].get("missing")
        ok &= all(a["ok"] for a in res["accounting"].values())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(f"logs: {work}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
