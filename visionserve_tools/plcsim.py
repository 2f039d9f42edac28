"""A PLC for tests, demos and the latency benchmark: connects to the PLC servers as a client
(pymodbus, asyncua), enables a station, acknowledges every result, counts rejects and watches
the heartbeat and Fault.

With --url it is also the line: it sends --count frames at --rate to the inspect API (part ids
1, 2, 3, ...; --camera sets X-Camera-Id) and reports, per protocol, each frame's time from
sending it to its result seen on the PLC side, against the inspect answer's own latency, and
whether every part's result came, in order. The PLC side then runs in a process of its own (a
PLC is a machine of its own), so that its decoding and the line's answers do not wait for each
other. With --url and neither protocol it is only the line: the inspect answer's latency, the
baseline to compare a server without PLC servers against.

With --trigger it is the PLC that triggers the cameras (no line): --count triggers at --rate on
each station of --units (default --station), part ids 1, 2, 3, ...; Modbus writes holding
registers 1-4 (trigger, part id kind 1, the number) in one request and reads input registers
16-17 until the server answered it, OPC UA calls the station's Trigger method. It reports, per
station, each part's time from the trigger to its result seen on the PLC side, results missing,
no decisions and refusals.

Without --url or --trigger it prints a line per result as it comes (and a summary when Ctrl-C or
--duration-s ends it); with --url only the summary.

Examples:
  visionserve plc-sim --modbus 127.0.0.1:5020                        # Ctrl-C (or --duration-s) ends
  visionserve plc-sim --opcua opc.tcp://127.0.0.1:4840 --user plc --password-file plc.pw
  visionserve plc-sim --modbus 127.0.0.1:5020 --opcua opc.tcp://127.0.0.1:4840 --user plc \\
      --password-file plc.pw --url http://127.0.0.1:8000 --model defect-classifier --rate 100 \\
      --count 1000 --json plc.json
  visionserve plc-sim --modbus 127.0.0.1:5020 --trigger --units 1,2 --rate 30 --count 1000

Latency on the PLC side includes the PLC's own cycle: --poll-ms (Modbus) is how often the input
registers are read (a real PLC: its Modbus client's cycle, often 10-100 ms); OPC UA events are
asked for with publishing interval --publish-ms (0: at once).

Exit codes: 0 done (with --url: every answered part's result seen on every protocol, verdicts
in the order sent; with --trigger: every trigger's result seen),
1 results missing or out of order (a refused trigger has no result), 2 bad arguments, 3 could not
connect.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from visionserve.errors import ConfigError, VisionServeError
from visionserve.plc import require
from visionserve.plc.handshake import Control, Status

log = logging.getLogger(__name__)

CODES = {0: "none", 1: "OK", 2: "NG", 3: "no decision"}
#: --trigger over Modbus: a trigger the server has not answered (input register 16) by then is
#: counted refused ("no answer")
TRIGGER_ANSWER_S = 2.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("PLC side")
    c.add_argument("--modbus", default=None, metavar="HOST:PORT", help="the Modbus TCP server")
    c.add_argument("--opcua", default=None, metavar="URL", help="the OPC UA server, opc.tcp://...")
    c.add_argument("--station", type=int, default=1,
                   help="station number (Modbus unit id, OPC UA Station<N>) [%(default)s]")
    c.add_argument("--poll-ms", type=float, default=1.0,
                   help="Modbus: read the input registers this often [%(default)s]")
    c.add_argument("--publish-ms", type=float, default=0.0,
                   help="OPC UA: requested publishing interval (0: at once) [%(default)s]")
    c.add_argument("--no-ack", action="store_true",
                   help="Modbus: never acknowledge (fills the buffer until Fault)")
    c.add_argument("--user", default=None, help="OPC UA user name")
    c.add_argument("--password-file", type=Path, default=None, help="OPC UA password file")
    c.add_argument("--security", default="Basic256Sha256",
                   choices=("Basic256Sha256", "Aes128Sha256RsaOaep", "None"),
                   help="OPC UA security policy (SignAndEncrypt) [%(default)s]")
    c.add_argument("--cert-dir", type=Path, default=None,
                   help="where the simulator keeps its OPC UA client certificate [a plc-sim "
                        "folder beside the server's data]")
    c.add_argument("--duration-s", type=float, default=None,
                   help="stop after this long (without --url: else until Ctrl-C)")
    line = p.add_argument_group("line (with --url)")
    line.add_argument("--url", default=None, help="the server's HTTP base URL: also send frames")
    line.add_argument("--model", default="defect-classifier", help="[%(default)s]")
    line.add_argument("--rate", type=float, default=10.0, help="parts per second [%(default)s]")
    line.add_argument("--count", type=int, default=100, help="parts to send [%(default)s]")
    line.add_argument("--camera", default=None, help="X-Camera-Id of the frames")
    line.add_argument("--deadline-ms", type=float, default=None, help="X-Deadline-Ms")
    line.add_argument("--images", default="gen:640x480:n=8",
                      help="frames: gen:WxH[:n=N] or a folder of images [%(default)s]")
    line.add_argument("--settle-s", type=float, default=5.0,
                      help="after the last answer, wait this long for results [%(default)s]")
    trig = p.add_argument_group("triggers (with --trigger)")
    trig.add_argument("--trigger", action="store_true",
                      help="trigger the stations' cameras from the PLC side, --count at --rate")
    trig.add_argument("--units", default=None, metavar="N,M",
                      help="the stations to trigger, each at --rate [--station]")
    p.add_argument("--json", type=Path, default=None, help="write the report here too")


@dataclass
class Tally:
    """What one protocol's PLC side saw."""

    protocol: str
    seen: dict[str, float] = field(default_factory=dict)  # part id -> perf_counter when seen
    code: dict[str, int] = field(default_factory=dict)  # part id -> result code
    codes: dict[str, int] = field(default_factory=lambda: {c: 0 for c in CODES.values()})
    order: list[str] = field(default_factory=list)
    last_beat: bool | None = None
    last_beat_t: float | None = None
    beats: int = 0
    max_beat_gap_s: float = 0.0
    faults: int = 0  # readings with Fault set
    fault_bits: int = 0
    echo: bool = False  # print a line per result
    station: int = 1
    #: --trigger: part id -> perf_counter when its trigger was sent, and why one was refused
    sent: dict[str, float] = field(default_factory=dict)
    refusals: dict[str, str] = field(default_factory=dict)

    def result(self, part: str, code: int, now: float, detail: str = "") -> None:
        self.codes[CODES.get(code, "none")] += 1
        if self.echo:
            print(f"{self.protocol}: part {part or '-'} {CODES.get(code, code)}"
                  f"{f' ({detail})' if detail else ''}", flush=True)
        if part not in self.seen:
            self.seen[part] = now
            self.code[part] = code
            self.order.append(part)

    def beat(self, value: bool, now: float) -> None:
        if self.last_beat is not None and value != self.last_beat:
            self.beats += 1
            if self.last_beat_t is not None:
                self.max_beat_gap_s = max(self.max_beat_gap_s, now - self.last_beat_t)
            self.last_beat_t = now
        elif self.last_beat is None:
            self.last_beat_t = now
        self.last_beat = value

    @property
    def rejects(self) -> int:
        return self.codes["NG"] + self.codes["no decision"]


class ModbusPlc:
    """The Cognex-style handshake from the PLC's side (docs/plc.md)."""

    protocol = "modbus"

    def __init__(self, address: str, unit: int, poll_s: float, ack: bool,
                 trigger: bool = False) -> None:
        from visionserve.plc.service import parse_address

        self.host, self.port = parse_address(address)
        self.unit, self.poll_s, self.ack = unit, poll_s, ack
        self.tally = Tally(self.protocol, station=unit)
        self.client: Any = None
        # --trigger: its own connection writes the triggers; the trigger value last written
        self.trigger_mode = trigger
        self.triggers: Any = None
        self.value = 0

    async def connect(self) -> None:
        from pymodbus.client import AsyncModbusTcpClient

        self.client = AsyncModbusTcpClient(self.host, port=self.port, timeout=3, retries=1)
        if not await self.client.connect():
            raise ConnectionError(f"Modbus: cannot connect to {self.host}:{self.port}")
        # a fresh start: drop Enable (clears what waits), then enable with the fault reset
        for word in (0, Control.ENABLE | Control.FAULT_RESET, Control.ENABLE):
            await self._control(int(word))
        if self.trigger_mode:
            self.triggers = AsyncModbusTcpClient(self.host, port=self.port, timeout=3, retries=1)
            if not await self.triggers.connect():
                raise ConnectionError(f"Modbus: cannot connect to {self.host}:{self.port}")
            rr = await self.triggers.read_holding_registers(1, count=1, device_id=self.unit)
            if rr.isError():
                raise ConnectionError(f"Modbus: the server has no trigger register: {rr}")
            self.value = rr.registers[0]  # the next trigger must differ from it

    async def trigger(self, n: int) -> None:
        """Trigger part ``n``: holding registers 1-4 (a new trigger value, part id kind 1, the
        number) in one write, then input registers 16-17 read until the server answered it
        (a refusal is kept by its code)."""
        self.value = self.value % 0xFFFF + 1
        part = str(n)
        self.tally.sent[part] = time.perf_counter()
        rr = await self.triggers.write_registers(1, [self.value, 1, n >> 16 & 0xFFFF, n & 0xFFFF],
                                                 device_id=self.unit)
        if rr.isError():
            raise ConnectionError(f"Modbus: writing the trigger was refused: {rr}")
        deadline = time.perf_counter() + TRIGGER_ANSWER_S
        while time.perf_counter() < deadline:
            rr = await self.triggers.read_input_registers(16, count=2, device_id=self.unit)
            if rr.isError():
                raise ConnectionError(f"Modbus: reading the trigger's answer failed: {rr}")
            ack, refusal = rr.registers
            if ack == self.value:
                if refusal:
                    self.tally.refusals[part] = str(refusal)
                return
            await asyncio.sleep(self.poll_s)
        self.tally.refusals[part] = "no answer"

    async def _control(self, word: int) -> None:
        rr = await self.client.write_register(0, word, device_id=self.unit)
        if rr.isError():
            raise ConnectionError(f"Modbus: writing the control word was refused: {rr}")

    async def run(self, stop: asyncio.Event) -> None:
        acking = False
        t = self.tally
        while not stop.is_set():
            rr = await self.client.read_input_registers(0, count=16, device_id=self.unit)
            if rr.isError():
                raise ConnectionError(f"Modbus: reading the input registers failed: {rr}")
            now = time.perf_counter()
            regs = rr.registers
            status = Status(regs[0])
            t.beat(Status.HEARTBEAT in status, now)
            if Status.FAULT in status:
                t.faults += 1
                t.fault_bits |= regs[1]
            valid = Status.RESULT_VALID in status
            if valid and not acking:
                t.result(_modbus_part(regs[8], regs[9], regs[10]), regs[3], now,
                         f"inspection {regs[2]}, label {regs[5]}, score {regs[6] / 1000:.3f}")
                if self.ack:
                    await self._control(int(Control.ENABLE | Control.RESULT_ACK))
                    acking = True
                    continue  # at once: the next result is presented as soon as we drop the ack
            elif acking and not valid:
                await self._control(int(Control.ENABLE))
                acking = False
                continue
            await asyncio.sleep(self.poll_s)

    async def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self._control(0)
            self.client.close()
        if self.triggers is not None:
            self.triggers.close()


def _modbus_part(high: int, low: int, kind: int) -> str:
    n = high << 16 | low
    return "" if kind == 0 else str(n) if kind == 1 else f"crc32:{n:08x}"


class OpcUaPlc:
    """Subscribes to the station's ResultReady events and the heartbeat."""

    protocol = "opcua"

    def __init__(self, url: str, station: int, publish_ms: float, user: str | None,
                 password: str | None, security: str, cert_dir: Path) -> None:
        self.url, self.station, self.publish_ms = url, station, publish_ms
        self.user, self.password, self.security, self.cert_dir = user, password, security, cert_dir
        self.tally = Tally(self.protocol, station=station)
        self.client: Any = None
        self._node: Any = None  # the station's object, and its Trigger method
        self._method: Any = None

    async def connect(self) -> None:
        from asyncua import Client, ua

        from visionserve.plc.opcua import NAMESPACE

        client = Client(self.url, timeout=10)
        # within what servers grant (asyncua's: 5 s to 10 min): asyncua's own default, an hour,
        # is cut down and warned about; a minute outlives a short outage of the network
        client.session_timeout = 60_000
        if self.security != "None":
            uri = f"urn:{socket.gethostname()}:visionserve:plc-sim"
            key, cert = await client_certificate(self.cert_dir, uri)
            client.application_uri = uri
            await client.set_security_string(f"{self.security},SignAndEncrypt,{cert},{key}")
        if self.user:
            client.set_user(self.user)
            client.set_password(self.password or "")
        await client.connect()
        self.client = client
        ns = await client.get_namespace_index(NAMESPACE)
        system = await client.nodes.objects.get_child(f"{ns}:VisionSystem")
        station = await system.get_child([f"{ns}:ResultManagement", f"{ns}:Station{self.station}"])
        self._node = station
        with contextlib.suppress(ua.UaError):  # a server without triggers: none asked for
            self._method = await station.get_child(f"{ns}:Trigger")
        etype = await client.nodes.base_event_type.get_child(f"{ns}:ResultReadyEventType")
        beat = await system.get_child([f"{ns}:Status", f"{ns}:Heartbeat"])
        fault = await system.get_child([f"{ns}:Status", f"{ns}:Fault"])
        self._beat, self._fault = beat.nodeid, fault.nodeid
        # asked within what servers grant, so that asyncua does not warn of revised values: a
        # keep-alive about every 10 s, the lifetime (10,000 intervals) over three of them
        params = ua.CreateSubscriptionParameters(
            RequestedPublishingInterval=self.publish_ms, RequestedLifetimeCount=10_000,
            RequestedMaxKeepAliveCount=max(1, min(3000, int(10_000 / max(self.publish_ms, 1)))),
            MaxNotificationsPerPublish=10_000, PublishingEnabled=True, Priority=0)
        sub = await client.create_subscription(params, self)
        await sub.subscribe_events(station, etype)
        await sub.subscribe_data_change([beat, fault])

    # asyncua calls these (subscription handler)
    def event_notification(self, event) -> None:
        self.tally.result(event.PartId or "", int(event.ResultCode), time.perf_counter(),
                          f"{event.Verdict} {event.Label} {event.Score:.3f}")

    def datachange_notification(self, node, value, data) -> None:
        if node.nodeid == self._beat:
            self.tally.beat(bool(value), time.perf_counter())
        elif node.nodeid == self._fault and value:
            self.tally.faults += 1

    async def run(self, stop: asyncio.Event) -> None:
        await stop.wait()

    async def trigger(self, n: int) -> None:
        """Trigger part ``n``: the station's Trigger method; a refusal is its Bad status."""
        from asyncua import ua

        if self._method is None:
            raise ConnectionError(f"OPC UA: Station{self.station} has no Trigger method")
        part = str(n)
        self.tally.sent[part] = time.perf_counter()
        try:
            await self._node.call_method(self._method, part)
        except ua.UaStatusCodeError as exc:
            self.tally.refusals[part] = type(exc).__name__  # asyncua's class per status

    async def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.disconnect()


async def client_certificate(folder: Path, uri: str) -> tuple[Path, Path]:
    from asyncua.crypto import cert_gen
    from cryptography.x509.oid import ExtendedKeyUsageOID

    folder.mkdir(parents=True, exist_ok=True)
    key, cert = folder / "plc-sim-key.pem", folder / "plc-sim-cert.der"
    await cert_gen.setup_self_signed_certificate(
        key, cert, uri, socket.gethostname(), [ExtendedKeyUsageOID.CLIENT_AUTH],
        {"commonName": "visionserve plc-sim"})
    return key, cert


class Line:
    """Sends the frames on a fixed schedule (open loop) over a few keep-alive connections."""

    def __init__(self, url: str, model: str, frames: list, rate: float, count: int,
                 camera: str | None, deadline_ms: float | None, connections: int = 4) -> None:
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.model, self.frames, self.rate, self.count = model, frames, rate, count
        self.camera, self.deadline_ms, self.connections = camera, deadline_ms, connections
        self.sent: dict[str, float] = {}
        self.answered: dict[str, tuple[float, int, str]] = {}  # part -> (t, status, verdict)

    def _request(self, part: str, frame) -> tuple[bytes, bytes]:
        extra = f"X-Camera-Id: {self.camera}\r\n" if self.camera else ""
        if self.deadline_ms:
            extra += f"X-Deadline-Ms: {self.deadline_ms:g}\r\n"
        head = (f"POST /v1/models/{self.model}/inspect HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Content-Type: {frame.content_type}\r\nContent-Length: {len(frame.data)}\r\n"
                f"X-Part-Id: {part}\r\n{extra}\r\n").encode()
        return head, frame.data

    async def run(self) -> None:
        from visionserve_tools.benchclient.wire import HttpConnection

        pool: asyncio.Queue = asyncio.Queue()
        for _ in range(self.connections):
            pool.put_nowait(await HttpConnection(self.host, self.port).open())

        async def send(i: int) -> None:
            part = str(i + 1)
            head, body = self._request(part, self.frames[i % len(self.frames)])
            conn = await pool.get()
            try:
                if conn.closed:
                    await conn.open()
                self.sent[part] = time.perf_counter()
                status, _, data = await conn.request(head, body)
                verdict = ""
                with contextlib.suppress(ValueError, AttributeError):
                    verdict = json.loads(data).get("verdict", "")
                self.answered[part] = (time.perf_counter(), status, verdict)
            except (OSError, asyncio.IncompleteReadError) as exc:
                log.warning("part %s: %s", part, exc)
                conn.close()
            finally:
                pool.put_nowait(conn)

        start = time.perf_counter()
        tasks = []
        for i in range(self.count):
            delay = start + i / self.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(i)))
        await asyncio.gather(*tasks)
        while not pool.empty():
            pool.get_nowait().close()


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    v = sorted(values)
    def rank(q: float) -> float:  # nearest rank
        return round(v[min(len(v) - 1, math.ceil(q * len(v)) - 1)], 3)

    return {"n": len(v), "p50": rank(0.5), "p99": rank(0.99), "max": round(v[-1], 3)}


def bus_delays(url: str) -> dict[str, dict[str, float]]:
    """The server's ``visionserve_plc_bus_delay_seconds`` buckets: protocol -> {le: count}."""
    import urllib.request

    out: dict[str, dict[str, float]] = {}
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("visionserve_plc_bus_delay_seconds_bucket{"):
            labels, _, value = line.partition("} ")
            kv = dict(p.split("=", 1) for p in labels.split("{", 1)[1].split(","))
            out.setdefault(kv["protocol"].strip('"'), {})[kv["le"].strip('"')] = float(value)
    return out


def _within(before: dict, after: dict) -> dict[str, float] | None:
    """Of the results published between two scrapes, the share within 1 and 2 ms of the answer."""
    total = after.get("+Inf", 0) - before.get("+Inf", 0)
    if total <= 0:
        return None
    return {f"within_{ms}ms": round((after.get(le, 0) - before.get(le, 0)) / total, 4)
            for ms, le in (("1", "0.001"), ("2", "0.002"))} | {"n": int(total)}


def report(line: Line | None, plcs: list, elapsed_s: float, delays: tuple = ({}, {})) -> dict:
    out: dict = {"elapsed_s": round(elapsed_s, 2), "protocols": {}}
    if line is not None:
        ok = [p for p, (_, status, _) in line.answered.items() if status == 200]
        out["line"] = {"sent": len(line.sent), "answered": len(line.answered),
                       "answered_200": len(ok), "rate": line.rate,
                       "answer_ms": percentiles([(line.answered[p][0] - line.sent[p]) * 1000
                                                 for p in line.answered])}
    for plc in plcs:
        t: Tally = plc.tally
        entry: dict = {"results": len(t.order), "codes": t.codes, "rejects": t.rejects,
                       "heartbeat_toggles": t.beats,
                       "max_heartbeat_gap_ms": round(t.max_beat_gap_s * 1000, 1),
                       "fault_seen": t.faults > 0, "fault_bits": t.fault_bits}
        if line is not None:
            sent_order = [p for p in sorted(line.answered, key=int)]
            missing = [p for p in sent_order if p not in t.seen]
            seen_sent = [p for p in t.order if p in line.sent]
            entry["missing"] = len(missing)
            entry["missing_parts"] = missing[:20]
            # verdicts come in the order the frames were sent; a no decision may overtake them
            # (refused at once, or dropped LATE from the queue while earlier frames compute)
            verdicts = [p for p in seen_sent if t.code[p] in (1, 2)]
            entry["in_order"] = verdicts == sorted(verdicts, key=int)
            entry["seen_ms"] = percentiles([(t.seen[p] - line.sent[p]) * 1000 for p in seen_sent])
            entry["added_ms"] = percentiles([(t.seen[p] - line.answered[p][0]) * 1000
                                             for p in seen_sent if p in line.answered])
            entry["server_bus_delay"] = _within(delays[0].get(plc.protocol, {}),
                                                delays[1].get(plc.protocol, {}))
        out["protocols"][plc.protocol] = entry
    return out


def trigger_report(plcs: list, rate: float, elapsed_s: float) -> dict:
    """--trigger: each part's trigger to its result (by part id), over every station and per
    protocol and station (``stations``)."""
    out: dict = {"elapsed_s": round(elapsed_s, 2), "rate": rate, "stations": {}}
    every: list[float] = []
    for plc in plcs:
        t: Tally = plc.tally
        seen = [p for p in t.sent if p in t.seen]
        missing = [p for p in t.sent if p not in t.seen]
        refusals: dict[str, int] = {}
        for why in t.refusals.values():
            refusals[why] = refusals.get(why, 0) + 1
        times = [(t.seen[p] - t.sent[p]) * 1000 for p in seen]
        every += times
        out["stations"].setdefault(plc.protocol, {})[str(t.station)] = {
            "count": len(t.sent), "results": len(seen), "missing": len(missing),
            "missing_parts": missing[:20],
            "no_decision": sum(t.code[p] == 3 for p in seen),
            "ng": sum(t.code[p] == 2 for p in seen),
            "refused": len(t.refusals), "refusals": refusals,
            "result_ms": percentiles(times)}
    entries = [e for stations in out["stations"].values() for e in stations.values()]
    out.update({"triggers": sum(e["count"] for e in entries)},
               **{k: sum(e[k] for e in entries)
                  for k in ("results", "missing", "no_decision", "ng", "refused")})
    p = percentiles(every)
    out.update(p50_ms=p["p50"], p99_ms=p["p99"], max_ms=p["max"])
    return out


def _ms(d: dict) -> str:
    if not d["n"]:
        return "-"
    return f"p50 {d['p50']:.2f} ms, p99 {d['p99']:.2f} ms, max {d['max']:.2f} ms"


def _print_triggers(rep: dict) -> None:
    for protocol, stations in rep["stations"].items():
        for station, e in stations.items():
            refused = ", ".join(f"{k} x{v}" for k, v in e["refusals"].items())
            print(f"{protocol} station {station}: {e['count']} triggers at {rep['rate']:g}/s, "
                  f"{e['results']} results ({e['ng']} NG, {e['no_decision']} no decision), "
                  f"{e['refused']} refused{f' ({refused})' if refused else ''}, "
                  f"{e['missing']} missing")
            print(f"  trigger -> result on the PLC side: {_ms(e['result_ms'])}")


def _print(rep: dict) -> None:
    ms = _ms
    line = rep.get("line")
    if line:
        print(f"line: {line['sent']} parts sent at {line['rate']:g}/s, {line['answered_200']} "
              f"answered 200; inspect answer {ms(line['answer_ms'])}")
    for name, e in rep["protocols"].items():
        codes = ", ".join(f"{k} {v}" for k, v in e["codes"].items() if v)
        print(f"{name}: {e['results']} results ({codes or 'none'}), {e['rejects']} rejects; "
              f"heartbeat {e['heartbeat_toggles']} toggles, longest gap "
              f"{e['max_heartbeat_gap_ms']:.0f} ms; Fault {'seen' if e['fault_seen'] else 'never'}")
        if "seen_ms" in e:
            print(f"  sent -> seen on the PLC side: {ms(e['seen_ms'])}")
            print(f"  after the inspect answer (per frame): {ms(e['added_ms'])}")
            if e["server_bus_delay"]:
                d = e["server_bus_delay"]
                print(f"  in the PLC server's data within 1 ms of the final answer: "
                      f"{d['within_1ms']:.1%}, within 2 ms: {d['within_2ms']:.1%} "
                      "(server's histogram)")
            parts = f" {e['missing_parts']}" if e["missing"] else ""
            print(f"  missing {e['missing']}{parts}; "
                  f"{'in order' if e['in_order'] else 'OUT OF ORDER'}")


def _raise_if_failed(runners: list[asyncio.Task]) -> None:
    """A PLC client that stopped on an error: raise it."""
    for r in runners:
        exc = r.exception() if r.done() and not r.cancelled() else None
        if exc is not None:
            raise exc


def _plc_process(conn, args: argparse.Namespace) -> None:
    """With --url, the PLC side runs here, in a process of its own, as a PLC is a machine of its
    own: the line's HTTP answers and the PLC clients' decoding (asyncua decrypts and decodes
    each event in Python) do not queue behind each other on one event loop. Times are
    ``time.perf_counter()``, the machine's monotonic clock, the same in both processes."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        conn.send(("done", asyncio.run(_plc_side(conn, make_plcs(args)))))
    except Exception as exc:  # noqa: BLE001 - any failure: the line's process says it, exits 3
        conn.send(("error", str(exc) or type(exc).__name__))


async def _plc_side(conn, plcs: list) -> list[Tally]:
    stop = asyncio.Event()
    for plc in plcs:
        await plc.connect()
    runners = [asyncio.create_task(plc.run(stop)) for plc in plcs]
    try:
        conn.send(("ready", None))
        want, settle_s = await asyncio.to_thread(conn.recv)  # the line has sent every frame
        deadline = time.perf_counter() + settle_s
        while time.perf_counter() < deadline and not all(want <= set(p.tally.seen) for p in plcs):
            _raise_if_failed(runners)
            await asyncio.sleep(0.02)
    finally:
        stop.set()
        await asyncio.gather(*runners, return_exceptions=True)
        for plc in plcs:
            await plc.close()
    return [p.tally for p in plcs]


async def _simulate_apart(args: argparse.Namespace, plcs: list, line: Line) -> dict:
    """The line here, the PLC side in a process of its own (:func:`_plc_process`)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    picklable = argparse.Namespace(**{k: v for k, v in vars(args).items()
                                      if not k.startswith("_") and not callable(v)})
    proc = ctx.Process(target=_plc_process, args=(theirs, picklable), daemon=True)
    proc.start()
    theirs.close()

    async def receive() -> Any:
        try:
            kind, value = await asyncio.to_thread(ours.recv)
        except EOFError:
            raise ConnectionError("the PLC side's process exited") from None
        if kind == "error":
            raise ConnectionError(value)
        return value

    try:
        await receive()  # connected
        before = await asyncio.to_thread(bus_delays, args.url)
        start = time.perf_counter()
        await line.run()
        ours.send((set(line.answered), args.settle_s))
        tallies = await receive()
        elapsed = time.perf_counter() - start
    finally:
        await asyncio.to_thread(proc.join, 30)
        if proc.is_alive():
            proc.kill()
    for plc, tally in zip(plcs, tallies):
        plc.tally = tally
    after = await asyncio.to_thread(bus_delays, args.url)
    return report(line, plcs, elapsed, (before, after))


async def _simulate_triggers(args: argparse.Namespace, plcs: list) -> dict:
    """--trigger: each station triggered --count times at --rate (all at once), until every
    trigger's result is seen or refused, or --settle-s after the last."""
    stop = asyncio.Event()
    for plc in plcs:
        await plc.connect()
    runners = [asyncio.create_task(plc.run(stop)) for plc in plcs]

    async def fire(plc) -> None:
        start = time.perf_counter()
        for i in range(args.count):
            delay = start + i / args.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await plc.trigger(i + 1)

    def answered(t: Tally) -> bool:
        return all(p in t.seen or p in t.refusals for p in t.sent)

    start = time.perf_counter()
    try:
        await asyncio.gather(*(fire(plc) for plc in plcs))
        deadline = time.perf_counter() + args.settle_s
        while time.perf_counter() < deadline and not all(answered(p.tally) for p in plcs):
            _raise_if_failed(runners)
            await asyncio.sleep(0.02)
        _raise_if_failed(runners)
    finally:
        stop.set()
        await asyncio.gather(*runners, return_exceptions=True)
        for plc in plcs:
            await plc.close()
    return trigger_report(plcs, args.rate, time.perf_counter() - start)


async def simulate(args: argparse.Namespace, plcs: list, line: Line | None) -> dict:
    if args.trigger:
        return await _simulate_triggers(args, plcs)
    if line is not None and plcs:
        return await _simulate_apart(args, plcs, line)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    for plc in plcs:
        await plc.connect()
        if line is None:
            plc.tally.echo = True
            where = args.modbus if plc.protocol == "modbus" else args.opcua
            print(f"{plc.protocol}: connected to {where}, station {args.station}; a line per "
                  "result, Ctrl-C ends", flush=True)
    before = await asyncio.to_thread(bus_delays, args.url) if line is not None else {}
    start = time.perf_counter()
    runners = [asyncio.create_task(plc.run(stop)) for plc in plcs]
    try:
        if line is not None:
            await line.run()
            deadline = time.perf_counter() + args.settle_s
            want = set(line.answered)
            while time.perf_counter() < deadline and not stop.is_set():
                if all(want <= set(p.tally.seen) for p in plcs):
                    break
                await asyncio.sleep(0.02)
        elif args.duration_s:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), args.duration_s)
        else:
            await stop.wait()
        _raise_if_failed(runners)
    finally:
        stop.set()
        await asyncio.gather(*runners, return_exceptions=True)
        for plc in plcs:
            await plc.close()
    elapsed = time.perf_counter() - start
    after = await asyncio.to_thread(bus_delays, args.url) if line is not None else {}
    return report(line, plcs, elapsed, (before, after))


def units(args: argparse.Namespace) -> list[int]:
    """The stations to act as the PLC of: --units with --trigger, else --station."""
    if not args.trigger or not args.units:
        return [args.station]
    try:
        out = [int(u) for u in args.units.split(",")]
    except ValueError:
        out = []
    if not out or any(not 1 <= u <= 247 for u in out) or len(set(out)) != len(out):
        raise ConfigError(f"--units {args.units!r}: station numbers 1-247, comma-separated, "
                          "each once")
    return out


def make_plcs(args: argparse.Namespace) -> list:
    """The PLC clients asked for, not connected yet (ConfigError for bad arguments): one per
    protocol and station."""
    plcs: list = []
    for unit in units(args):
        if args.modbus:
            require("pymodbus")
            plcs.append(ModbusPlc(args.modbus, unit, args.poll_ms / 1000, not args.no_ack,
                                  trigger=args.trigger))
        if args.opcua:
            require("asyncua")
            from visionserve.plc.opcua import read_password
            from visionserve.plc.service import default_data_dir

            plcs.append(OpcUaPlc(args.opcua, unit, args.publish_ms, args.user,
                                 read_password(args.password_file), args.security,
                                 args.cert_dir or default_data_dir() / "plc-sim"))
    return plcs


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not (args.modbus or args.opcua or args.url):
        print("visionserve plc-sim: give --modbus HOST:PORT and/or --opcua URL (or only --url: "
              "the line alone, the baseline without a PLC)", file=sys.stderr)
        return 2
    try:
        if args.trigger and (args.url or not (args.modbus or args.opcua)):
            raise ConfigError("--trigger is the PLC triggering the cameras: give --modbus and/or "
                              "--opcua, and no --url")
        if args.rate <= 0 or args.count < 1:
            raise ConfigError("--rate must be > 0 and --count at least 1")
        plcs = make_plcs(args)
        line = None
        if args.url:
            from visionserve_tools.benchclient.images import ImageSetError, load

            try:
                frames = load(args.images)
            except ImageSetError as exc:
                raise ConfigError(f"--images: {exc}") from None
            line = Line(args.url, args.model, frames, args.rate, args.count, args.camera,
                        args.deadline_ms)
    except VisionServeError as exc:
        print(f"visionserve plc-sim: {exc.message}", file=sys.stderr)
        return 2
    failures: tuple = (ConnectionError, OSError, asyncio.TimeoutError)
    if args.opcua:
        from asyncua.ua import UaError

        failures += (UaError,)
    try:
        rep = asyncio.run(simulate(args, plcs, line))
    except failures as exc:
        print(f"visionserve plc-sim: {exc or type(exc).__name__}", file=sys.stderr)
        return 3
    if args.json:
        args.json.write_text(json.dumps(rep, indent=2))
    if args.trigger:
        _print_triggers(rep)
        return 1 if rep["missing"] else 0
    _print(rep)
    if line is not None and any(e["missing"] or not e["in_order"]
                                for e in rep["protocols"].values()):
        return 1
    return 0
