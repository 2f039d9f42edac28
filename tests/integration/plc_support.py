"""What the PLC integration tests share: a real server with its PLC servers on free loopback
ports, a pymodbus PLC that does the station handshake, an asyncua client with a certificate, and
the fault hooks (plc_hooks/sitecustomize.py)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from conftest import ServerProcess, free_port, start_server, wait_for

from visionserve.plc.handshake import Control, Status

HOOKS = Path(__file__).resolve().parent / "plc_hooks"
E, ACK, RESET = int(Control.ENABLE), int(Control.RESULT_ACK), int(Control.FAULT_RESET)
USER, PASSWORD = "plc", "s3cret-line-3"


@dataclass
class PlcServer:
    server: ServerProcess
    modbus_port: int | None
    opcua_url: str | None
    data_dir: Path
    password_file: Path
    hooks: Path

    def inspect(self, part: str | None = None, camera: str | None = None, jpeg: bytes = b"",
                deadline_ms: float | None = None, timeout: float = 30) -> httpx.Response:
        headers = {"Content-Type": "image/jpeg"}
        if part is not None:
            headers["X-Part-Id"] = part
        if camera is not None:
            headers["X-Camera-Id"] = camera
        if deadline_ms is not None:
            headers["X-Deadline-Ms"] = f"{deadline_ms:g}"
        return httpx.post(f"{self.server.url}/v1/models/tiny/inspect", content=jpeg, headers=headers,
                          timeout=timeout)

    def metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(f"{self.server.url}/metrics", timeout=10).text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def hook(self, name: str, content: str = "") -> None:
        (self.hooks / name).write_text(content)

    def unhook(self, name: str) -> None:
        (self.hooks / name).unlink(missing_ok=True)


def start_plc_server(models: Path, tmp_path: Path, *extra: str, modbus: bool = True,
                     opcua: bool = False, wait: bool = True, hooks: tuple[str, ...] = ()) -> PlcServer:
    """``visionserve serve`` with --modbus / --opcua on free loopback ports; ``hooks``: fault
    hook files present from the start (the hooks are loaded in any case)."""
    hook_dir = tmp_path / "hooks"
    hook_dir.mkdir(exist_ok=True)
    for name in hooks:
        (hook_dir / name).write_text("")
    data_dir = tmp_path / "plcdata"
    password_file = tmp_path / "plc.pw"
    password_file.write_text(PASSWORD + "\n")
    args = [*extra, "--plc-data-dir", str(data_dir)]
    modbus_port = free_port() if modbus else None
    if modbus:
        args += ["--modbus", f"127.0.0.1:{modbus_port}"]
    url = f"opc.tcp://127.0.0.1:{free_port()}" if opcua else None
    if opcua:
        args += ["--opcua", url, "--opcua-user", USER, "--opcua-password-file", str(password_file)]
    env = {"PYTHONPATH": os.pathsep.join([str(HOOKS), os.environ.get("PYTHONPATH", "")]),
           "PLC_TEST_HOOKS": str(hook_dir)}
    server = start_server(models, tmp_path, *args, env=env, wait=wait)
    return PlcServer(server, modbus_port, url, data_dir, password_file, hook_dir)


def wait_listening(port: int, timeout: float = 60.0) -> None:
    def up() -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(up, timeout, f"a listener on port {port}")


class Plc:
    """A PLC on one station over Modbus TCP (a real pymodbus client)."""

    def __init__(self, port: int, unit: int = 1) -> None:
        from pymodbus.client import ModbusTcpClient

        self.unit = unit
        self.client = ModbusTcpClient("127.0.0.1", port=port, timeout=5, retries=1)
        assert self.client.connect(), f"cannot connect to the Modbus server on port {port}"

    def close(self) -> None:
        self.client.close()

    def control(self, word: int) -> None:
        rr = self.client.write_register(0, word, device_id=self.unit)
        assert not rr.isError(), rr

    def reset(self) -> None:
        """A fresh start: Enable off (clears the station), on with FaultReset, then on."""
        for word in (0, E | RESET, E):
            self.control(word)

    def regs(self) -> list[int]:
        rr = self.client.read_input_registers(0, count=16, device_id=self.unit)
        assert not rr.isError(), rr
        return rr.registers

    def status(self) -> Status:
        return Status(self.regs()[0])

    def take(self, timeout: float = 10.0) -> list[int]:
        """The next result's input registers, acknowledged with the four-edge handshake."""
        regs = wait_for(lambda: (r := self.regs()) and Status.RESULT_VALID in Status(r[0]) and r,
                        timeout, "ResultValid")
        self.control(E | ACK)
        wait_for(lambda: Status.RESULT_VALID not in self.status(), timeout, "ResultValid to drop")
        self.control(E)
        return regs

    def heartbeat_toggles(self, seconds: float) -> int:
        toggles, last, end = 0, None, time.monotonic() + seconds
        while time.monotonic() < end:
            beat = Status.HEARTBEAT in self.status()
            toggles += last is not None and beat != last
            last = beat
            time.sleep(0.01)
        return toggles


def part_of(regs: list[int]) -> int:
    assert regs[10] == 1, "numeric part id expected"
    return regs[8] << 16 | regs[9]


async def opcua_client(url: str, cert_dir: Path, *, user: str | None = USER,
                       password: str | None = PASSWORD, policy: str = "Basic256Sha256"):
    """A connected asyncua client (SignAndEncrypt with a client certificate made in cert_dir)."""
    from asyncua import Client

    from visionserve_tools.plcsim import client_certificate

    client = Client(url, timeout=10)
    if policy != "None":
        uri = "urn:visionserve:tests:plc"
        key, cert = await client_certificate(cert_dir, uri)
        client.application_uri = uri
        await client.set_security_string(f"{policy},SignAndEncrypt,{cert},{key}")
    if user is not None:
        client.set_user(user)
        client.set_password(password or "")
    await client.connect()
    return client


async def vision_system(client):
    from visionserve.plc.opcua import NAMESPACE

    ns = await client.get_namespace_index(NAMESPACE)
    return ns, await client.nodes.objects.get_child(f"{ns}:VisionSystem")


async def read(system, ns: int, *path: str):
    node = await system.get_child([f"{ns}:{p}" for p in path])
    return await node.read_value()
