"""Triggers from the PLC (issue 50) on a real server with folder cameras: Modbus's trigger and
part id registers written by a real pymodbus client, OPC UA's Station<N>.Trigger called by a
real asyncua client, and ``visionserve plc-sim --trigger``. The verdict comes back through the
PLC result path with the trigger's part id; a station with two cameras gives the PLC exactly one
result per part."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest
from conftest import REPO, wait_for
from plc_support import USER, Plc, opcua_client, read, start_plc_server, vision_system
from test_cameras_serving import BLACK, WHITE, _bright_model

from visionserve.plc.handshake import Status

modbus = pytest.importorskip("visionserve.plc.modbus")
pytestmark = pytest.mark.timeout(240)

#: PLC stations: unit 1 a camera, 2 a station with two cameras, 3 nothing, 4 a free-running
#: camera, 5 a station without a recipe, 6 every other camera
STATIONS = "cam-solo,st1,nothing,cam-free,st0,*"
SOLO, ST1, NOTHING, FREE, ST0, REST = range(1, 7)


@pytest.fixture(scope="module")
def bright_repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trigrepo")
    _bright_model(root / "bright")
    return root


def _line(bright_repo: Path, tmp_path: Path) -> tuple[Path, Path]:
    drops = tmp_path / "drops"
    for name in ("a", "b", "s", "f", "z"):
        (drops / name).mkdir(parents=True)
    repo = tmp_path / "repo"
    repo.mkdir()
    os.symlink(bright_repo / "bright", repo / "bright")
    (repo / "recipes.toml").write_text(f"""\
[recipe.parts]
model = "bright"

[station.st1]
recipe = "parts"
cameras = ["cam-a", "cam-b"]

[station.st0]
cameras = ["cam-z"]

[camera.cam-a]
source = "folder:{drops / 'a'}"
timeout_s = 0.5
settings = {{ done = "delete" }}

[camera.cam-b]
source = "folder:{drops / 'b'}"
timeout_s = 0.5
settings = {{ done = "delete" }}

[camera.cam-solo]
source = "folder:{drops / 's'}"
model = "bright"
timeout_s = 0.5
settings = {{ done = "delete" }}

[camera.cam-free]
source = "folder:{drops / 'f'}"
model = "bright"
trigger = "free"
rate_hz = 10

[camera.cam-z]
source = "folder:{drops / 'z'}"
""")
    return repo, drops


class TriggerPlc(Plc):
    """A PLC that triggers its station through the holding registers (docs/plc.md)."""

    def __init__(self, port: int, unit: int) -> None:
        super().__init__(port, unit)
        self.value = 0

    def ir(self) -> list[int]:
        rr = self.client.read_input_registers(0, count=len(modbus.INPUT_REGISTERS),
                                              device_id=self.unit)
        assert not rr.isError(), rr
        return rr.registers

    def trigger(self, part: str | int | None = None, words: list[int] | None = None) -> int:
        """One FC16 write of holding registers 1-20: the next trigger value and the part id;
        returns the refusal code once the server answered it (input registers 16, 17)."""
        self.value = self.value % 0xFFFF + 1
        rr = self.client.write_registers(
            1, [self.value, *(modbus.part_id_words(part) if words is None else words)],
            device_id=self.unit)
        assert not rr.isError(), rr
        return self.answer()

    def answer(self) -> int:
        regs = wait_for(lambda: (r := self.ir())[16] == self.value and r, 10, "the trigger's ack")
        return regs[17]

    def result(self) -> tuple[str, int]:
        """The next result's part id (as plc-sim reads it) and result code, acknowledged."""
        regs = self.take()
        high, low, kind = regs[8:11]
        n = high << 16 | low
        return ("" if kind == 0 else str(n) if kind == 1 else f"crc32:{n:08x}"), regs[3]

    def quiet(self, seconds: float = 0.5) -> bool:
        """No result presented for ``seconds``."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if Status.RESULT_VALID in Status(self.ir()[0]):
                return False
            time.sleep(0.02)
        return True


def _crc(text: str) -> str:
    return f"crc32:{zlib.crc32(text.encode()):08x}"


def _record(server, part: str) -> list[dict]:
    return wait_for(lambda: (h := httpx.get(f"{server.url}/v1/parts/{part}", timeout=10))
                    .status_code == 200 and h.json()["records"], 20, f"{part}'s records")


@pytest.fixture
def line_server(bright_repo, tmp_path):
    repo, drops = _line(bright_repo, tmp_path)
    s = start_plc_server(repo, tmp_path, "--plc-stations", STATIONS, "--records",
                         "--records-dir", str(tmp_path / "data"))
    yield s, drops
    s.server.stop()


def test_modbus_trigger_registers(line_server):
    s, drops = line_server
    plc = TriggerPlc(s.modbus_port, SOLO)
    rest = TriggerPlc(s.modbus_port, REST)
    try:
        plc.reset()
        rest.reset()
        # a numeric part id: the verdict comes as the station's result, part id kind 1
        (drops / "s" / "1.jpg").write_bytes(WHITE)
        assert plc.trigger(1234) == 0
        assert plc.result() == ("1234", 1)
        assert _record(s.server, "1234")[0]["camera"] == "cam-solo"
        # the same value again (a retried write) is no new trigger, whatever else it writes
        (drops / "s" / "2.jpg").write_bytes(BLACK)
        rr = plc.client.write_registers(1, [plc.value, *modbus.part_id_words(99)],
                                        device_id=plc.unit)
        assert not rr.isError() and plc.quiet()
        assert (drops / "s" / "2.jpg").exists()  # nobody grabbed
        # 0 never triggers
        assert not plc.client.write_register(1, 0, device_id=plc.unit).isError() and plc.quiet()
        plc.value = 0  # the next trigger writes 1, which differs from the 0 last written
        # a text part id; the same registers read back as written
        assert plc.trigger("LOT7-A.42") == 0
        assert plc.result() == (_crc("LOT7-A.42"), 2)  # NG: the black frame
        assert _record(s.server, "LOT7-A.42")[0]["verdict"] == "NG"
        held = plc.client.read_holding_registers(0, count=21, device_id=plc.unit).registers
        assert held == [1, plc.value, *modbus.part_id_words("LOT7-A.42")]
        # no part id: the server names the part after the PLC station
        (drops / "s" / "3.jpg").write_bytes(WHITE)
        assert plc.trigger(None) == 0
        assert plc.result() == (_crc("cam-solo-1"), 1)
        assert _record(s.server, "cam-solo-1")[0]["part_id"] == "cam-solo-1"
        # a camera with no frame: taken, then no decision with the part id (never OK)
        assert plc.trigger(77) == 0
        assert plc.result() == ("77", 3)
        # refusals, each in input register 17 with the trigger value acknowledged in 16
        bad_text = modbus.part_id_words("x")
        bad_text[3] = 0xC3A9  # "é" in UTF-8: not ASCII
        assert plc.trigger(words=bad_text) == 4
        assert plc.trigger(words=[3] + [0] * 18) == 4  # kind 3
        assert plc.trigger(words=[2] + [0] * 18) == 4  # an empty text
        for unit, code in ((NOTHING, 1), (REST, 1), (FREE, 2), (ST0, 2)):
            other = TriggerPlc(s.modbus_port, unit)
            try:
                assert other.trigger(5) == code, unit
            finally:
                other.close()
        # past holding register 20: the protocol's exception, nothing written
        rr = plc.client.write_registers(20, [1, 2], device_id=plc.unit)
        assert rr.isError() and rr.exception_code == 2
        rr = plc.client.write_register(0, 0x8000, device_id=plc.unit)
        assert rr.isError() and rr.exception_code == 3
        assert plc.ir()[16] == plc.value
        assert rest.quiet(0.1) and rest.ir()[2] == 0  # station * saw no result of all this
        assert s.server.proc.poll() is None
    finally:
        plc.close()
        rest.close()


def test_a_two_camera_station_gives_the_plc_one_result_per_part(line_server):
    """Many parts of station st1 (cam-a, cam-b), each with its own part id and frames that make
    it OK or NG: every PLC result carries its own part's id and verdict, one per part, on the
    station named st1; the cameras' own frames reach the records, not the PLC."""
    s, drops = line_server
    st1, rest = TriggerPlc(s.modbus_port, ST1), TriggerPlc(s.modbus_port, REST)
    rng = random.Random(50)
    try:
        st1.reset()
        rest.reset()
        expected: dict[str, int] = {}
        for i in range(24):
            part = 5000 + i
            a, b = rng.random() < 0.7, rng.random() < 0.7  # True: a bright (OK) frame
            (drops / "a" / f"{part}.jpg").write_bytes(WHITE if a else BLACK)
            if i % 8 != 7:  # every eighth part: cam-b sends nothing, the part is no decision
                (drops / "b" / f"{part}.jpg").write_bytes(WHITE if b else BLACK)
            code = 3 if i % 8 == 7 else 1 if a and b else 2
            expected[str(part)] = code
            assert st1.trigger(part) == 0
            assert st1.result() == (str(part), code), part
        # over HTTP too: the station's one result, with the part id
        (drops / "a" / "h.jpg").write_bytes(WHITE)
        (drops / "b" / "h.jpg").write_bytes(BLACK)
        r = httpx.post(f"{s.server.url}/v1/stations/st1/trigger", headers={"X-Part-Id": "9001"},
                       timeout=30)
        assert r.status_code == 200 and r.json()["verdict"] == "NG", r.text
        assert st1.result() == ("9001", 2)
        assert st1.quiet() and st1.ir()[12] == 0  # nothing more, nothing dropped
        assert rest.ir()[2] == 0  # cam-a's and cam-b's frames were never results of their own
        # each camera's verdict is in its own record, with the part id
        records = _record(s.server, "5000")
        assert {r["camera"] for r in records} == {"cam-a", "cam-b"}
    finally:
        st1.close()
        rest.close()


async def test_opcua_trigger_method(bright_repo, tmp_path):
    from asyncua import ua

    repo, drops = _line(bright_repo, tmp_path)
    s = start_plc_server(repo, tmp_path, "--plc-stations", STATIONS, opcua=True, modbus=False)
    client = await opcua_client(s.opcua_url, tmp_path / "pki")
    try:
        ns, system = await vision_system(client)

        async def trigger(n: int, part: str) -> dict:
            station = await system.get_child([f"{ns}:ResultManagement", f"{ns}:Station{n}"])
            method = await station.get_child(f"{ns}:Trigger")
            return json.loads(await station.call_method(method, part))

        async def last(n: int, part: str) -> str:
            for _ in range(200):
                if await read(system, ns, "ResultManagement", f"Station{n}", "LastResult",
                              "PartId") == part:
                    return await read(system, ns, "ResultManagement", f"Station{n}",
                                      "LastResult", "Verdict")
                await asyncio.sleep(0.05)
            raise AssertionError(f"no result for part {part}")

        (drops / "a" / "1.jpg").write_bytes(WHITE)
        (drops / "b" / "1.jpg").write_bytes(BLACK)
        assert await trigger(ST1, "P-1") == {"station": "st1", "part_id": "P-1",
                                             "cameras": ["cam-a", "cam-b"]}
        assert await last(ST1, "P-1") == "NG"
        assert await read(system, ns, "ResultManagement", f"Station{ST1}", "ResultCount") == 1
        (drops / "s" / "2.jpg").write_bytes(WHITE)
        answer = await trigger(SOLO, "")  # the server names the part
        assert answer["part_id"] == "cam-solo-1"
        assert await last(SOLO, "cam-solo-1") == "OK"
        for n, status in ((NOTHING, "BadNotFound"), (REST, "BadNotFound"),
                          (FREE, "BadInvalidState"), (ST0, "BadInvalidState")):
            with pytest.raises(ua.UaStatusCodeError, match=status):
                await trigger(n, "P-x")
        with pytest.raises(ua.UaStatusCodeError, match="BadInvalidArgument"):
            await trigger(SOLO, "x" * 200)
    finally:
        await client.disconnect()
        s.server.stop()


def test_plc_sim_triggers_two_stations(bright_repo, tmp_path):
    """plc-sim --trigger on two Modbus unit ids, then over OPC UA: every trigger's result seen
    by part id."""
    repo, drops = _line(bright_repo, tmp_path)
    s = start_plc_server(repo, tmp_path, "--plc-stations", STATIONS, opcua=True)
    stop = threading.Event()

    def camera() -> None:  # the cameras' folders always hold a fresh frame
        i = 0
        while not stop.is_set():
            for d in ("s", "a", "b"):
                (drops / d / f"{i}.jpg").write_bytes(WHITE)
            i += 1
            stop.wait(0.01)

    feeder = threading.Thread(target=camera, daemon=True)
    feeder.start()
    out = tmp_path / "sim.json"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "visionserve", "plc-sim", "--modbus",
             f"127.0.0.1:{s.modbus_port}", "--trigger", "--units", f"{SOLO},{ST1}", "--rate",
             "10", "--count", "8", "--json", str(out)],
            capture_output=True, text=True, timeout=120, cwd=str(REPO), check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        rep = json.loads(out.read_text())
        for unit in (SOLO, ST1):
            t = rep["stations"]["modbus"][str(unit)]
            assert (t["count"], t["results"], t["missing"], t["refused"]) == (8, 8, 0, 0), t
            assert t["no_decision"] == 0 and t["result_ms"]["n"] == 8, t
        assert (rep["triggers"], rep["results"], rep["missing"]) == (16, 16, 0), rep
        assert rep["p50_ms"] <= rep["p99_ms"] <= rep["max_ms"]
        assert "trigger -> result" in proc.stdout
        # a station that refuses: each trigger refused, none answered: exit 1
        proc = subprocess.run(
            [sys.executable, "-m", "visionserve", "plc-sim", "--modbus",
             f"127.0.0.1:{s.modbus_port}", "--trigger", "--units", str(NOTHING), "--rate",
             "20", "--count", "3", "--settle-s", "1", "--json", str(out)],
            capture_output=True, text=True, timeout=120, cwd=str(REPO), check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr
        t = json.loads(out.read_text())["stations"]["modbus"][str(NOTHING)]
        assert (t["refused"], t["missing"], t["refusals"]) == (3, 3, {"1": 3}), t
        proc = subprocess.run(
            [sys.executable, "-m", "visionserve", "plc-sim", "--opcua", s.opcua_url, "--user",
             USER, "--password-file", str(s.password_file), "--cert-dir", str(tmp_path / "pki"),
             "--trigger", "--units", f"{ST1},{FREE}", "--rate", "10", "--count", "4",
             "--settle-s", "2", "--json", str(out)],
            capture_output=True, text=True, timeout=120, cwd=str(REPO), check=False)
        assert proc.returncode == 1, proc.stdout + proc.stderr  # FREE refuses every trigger
        rep = json.loads(out.read_text())["stations"]["opcua"]
        assert (rep[str(ST1)]["results"], rep[str(ST1)]["missing"]) == (4, 0), rep
        assert rep[str(FREE)]["refusals"] == {"BadInvalidState": 4}, rep
    finally:
        stop.set()
        feeder.join()
        s.server.stop()
