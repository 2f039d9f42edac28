"""The OPC UA server of a real ``visionserve serve`` (OPC 40100-style address space), with real
asyncua clients over TCP on loopback: ResultReady events and LastResult variables in order with
their part ids, per station; security (anonymous off, bad passwords, policies, read-only nodes,
the server certificate); the state machine following readiness and drain; and ``visionserve
plc-sim`` end to end on both protocols."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, wait_for
from plc_support import PASSWORD, USER, Plc, opcua_client, read, start_plc_server, vision_system

from visionserve.plc.handshake import Status

pytest.importorskip("asyncua")
pytestmark = pytest.mark.timeout(240)
MAX_CLIENTS = 4


@pytest.fixture(scope="module")
def plc_server(tiny_repo, tmp_path_factory):
    s = start_plc_server(tiny_repo, tmp_path_factory.mktemp("plc-opcua"), "--plc-stations", "cam1,cam2",
                         "--plc-max-clients", str(MAX_CLIENTS), opcua=True, modbus=True)
    yield s
    s.server.stop()


@pytest.fixture
def pki(tmp_path):
    return tmp_path / "client-pki"


class Events:
    """A subscription handler collecting ResultReady events."""

    def __init__(self) -> None:
        self.items: list = []

    def event_notification(self, event) -> None:
        self.items.append(event)


async def _subscribe(client, ns, node, publish_ms: float = 0):
    etype = await client.nodes.base_event_type.get_child(f"{ns}:ResultReadyEventType")
    events = Events()
    sub = await client.create_subscription(publish_ms, events)
    await sub.subscribe_events(node, etype)
    return events


async def _inspect(plc_server, *args, **kw):
    return await asyncio.to_thread(plc_server.inspect, *args, **kw)


async def test_results_arrive_as_events_and_variables_in_order(plc_server, pki, jpeg_bytes):
    client = await opcua_client(plc_server.opcua_url, pki)
    try:
        ns, system = await vision_system(client)
        stations = await system.get_child(f"{ns}:ResultManagement")
        cam1, cam2 = [await stations.get_child(f"{ns}:Station{i}") for i in (1, 2)]
        on_cam1, on_cam2, on_all = [await _subscribe(client, ns, n) for n in (cam1, cam2, system)]
        assert (await (await cam1.get_child(f"{ns}:CameraId")).read_value()) == "cam1"
        answers = []
        for i in range(5):
            r = await _inspect(plc_server, f"A-{i}", camera="cam1", jpeg=jpeg_bytes)
            assert r.status_code == 200, r.text
            answers.append(r.json())
        await asyncio.to_thread(wait_for, lambda: len(on_cam1.items) == 5, 10, "5 events")
        assert [e.PartId for e in on_cam1.items] == [f"A-{i}" for i in range(5)]
        for e, a in zip(on_cam1.items, answers):
            assert (e.Verdict, e.Label, e.Model, e.ModelVersion) == (a["verdict"], a["label"], "tiny", "1")
            assert e.Score == pytest.approx(a["score"], abs=1e-5)
            assert (e.ResultCode, e.ResultState, e.Station, e.CameraId) == (
                1 if a["verdict"] == "OK" else 2, 1, "Station1", "cam1")
            assert 0 < e.TotalDuration
        assert len({e.ResultId for e in on_cam1.items}) == 5
        assert [e.Sequence for e in on_cam1.items] == list(range(on_cam1.items[0].Sequence,
                                                                 on_cam1.items[0].Sequence + 5))
        await asyncio.to_thread(wait_for, lambda: len(on_all.items) == 5, 10, "VisionSystem events")
        assert on_cam2.items == []
        last = on_cam1.items[-1]
        for name in ("ResultId", "PartId", "Verdict", "Label", "Score", "ResultCode", "Sequence"):
            assert await read(stations, ns, "Station1", "LastResult", name) == getattr(last, name)
        assert await read(stations, ns, "Station1", "ResultCount") == last.Sequence
        start, end = [await read(stations, ns, "Station1", "LastResult", "ProcessingTimes", n)
                      for n in ("StartTime", "EndTime")]
        assert start <= end and last.Time == end
        assert await read(stations, ns, "Station1", "LastResult", "ProcessingTimes",
                          "TotalDuration") == pytest.approx(last.TotalDuration)
        assert await read(stations, ns, "Station2", "LastResult", "ResultId") == ""
    finally:
        await client.disconnect()


async def test_a_late_frame_is_no_decision_aborted(plc_server, pki, jpeg_bytes):
    client = await opcua_client(plc_server.opcua_url, pki, policy="Aes128Sha256RsaOaep")
    try:
        ns, system = await vision_system(client)
        station = await system.get_child([f"{ns}:ResultManagement", f"{ns}:Station2"])
        events = await _subscribe(client, ns, station)
        r = await _inspect(plc_server, "L-1", camera="cam2", jpeg=jpeg_bytes, deadline_ms=0.001)
        assert r.status_code in (200, 504)
        await asyncio.to_thread(wait_for, lambda: events.items, 10, "the event")
        e = events.items[0]
        assert (e.PartId, e.ResultCode, e.ResultState, e.Verdict, e.Reason) == ("L-1", 3, 3, "LATE", 1)
        assert e.Severity == 800
    finally:
        await client.disconnect()


async def test_the_state_machine_and_status_when_serving(plc_server, pki):
    client = await opcua_client(plc_server.opcua_url, pki)
    try:
        ns, system = await vision_system(client)
        assert (await read(system, ns, "VisionStateMachine", "CurrentState")).Text == "Operational"
        assert (await read(system, ns, "VisionStateMachine", "AutomaticModeStateMachine",
                           "CurrentState")).Text == "Ready"
        assert await read(system, ns, "Status", "Ready") is True
        assert await read(system, ns, "Status", "Fault") is False
        assert await read(system, ns, "RecipeManagement", "Recipes") == ["tiny:1"]
        first = await read(system, ns, "Status", "HeartbeatCount")
        await asyncio.sleep(1.6)  # the default heartbeat period is 500 ms
        assert await read(system, ns, "Status", "HeartbeatCount") >= first + 2
    finally:
        await client.disconnect()


async def test_anonymous_and_bad_passwords_are_refused(plc_server, pki):
    from asyncua.ua.uaerrors import UaError

    for kw in ({"user": None}, {"password": "wrong"}, {"user": "intruder", "password": PASSWORD}):
        with pytest.raises((UaError, asyncio.TimeoutError, OSError)):
            client = await opcua_client(plc_server.opcua_url, pki, **kw)
            await client.disconnect()
    with pytest.raises((UaError, asyncio.TimeoutError, OSError)):  # no unsecured endpoint
        client = await opcua_client(plc_server.opcua_url, pki, policy="None")
        await client.disconnect()
    log = plc_server.server.log()
    assert log.count("refused user 'intruder'") == 1 and log.count("refused user 'plc'") == 1


async def test_clients_cannot_write_results_or_status(plc_server, pki):
    from asyncua.ua.uaerrors import BadNotWritable, BadUserAccessDenied

    client = await opcua_client(plc_server.opcua_url, pki)
    try:
        ns, system = await vision_system(client)
        for path in (("Status", "Ready"), ("ResultManagement", "Station1", "LastResult", "PartId")):
            node = await system.get_child([f"{ns}:{p}" for p in path])
            value = await node.read_value()
            with pytest.raises((BadUserAccessDenied, BadNotWritable)):
                await node.write_value(value)
    finally:
        await client.disconnect()


def test_a_new_connection_past_the_limit_replaces_the_oldest_silent_one(plc_server):
    port = int(plc_server.opcua_url.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CLIENTS)]
    try:
        time.sleep(0.3)  # every one of them accepted and holding its slot
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        socks[0].settimeout(5)
        assert socks[0].recv(64) == b""  # closed by the server without a word
        for s in socks[1:]:  # the others are still open (a half hello: no answer yet)
            s.sendall(b"HEL")
            s.settimeout(0.3)
            with pytest.raises(socket.timeout):
                s.recv(64)
    finally:
        for s in socks:
            s.close()


async def test_idle_sockets_do_not_lock_out_a_real_client(plc_server, pki):
    """Every slot taken by sockets that send nothing (or a hello and then nothing): a real
    client still connects, logs in and reads within seconds, and a second one too, while the
    first one's session keeps its slot."""
    port = int(plc_server.opcua_url.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(MAX_CLIENTS)]
    socks[-1].sendall(b"HEL")
    clients = []
    try:
        await asyncio.sleep(0.3)
        for _ in range(2):
            start = time.monotonic()
            client = await opcua_client(plc_server.opcua_url, pki)
            clients.append(client)
            ns, system = await vision_system(client)
            assert await read(system, ns, "Status", "Ready") is True
            assert time.monotonic() - start < 5
        ns, system = await vision_system(clients[0])  # the first one was not pushed out
        assert await read(system, ns, "Status", "Ready") is True
    finally:
        for client in clients:
            await client.disconnect()
        for s in socks:
            s.close()


async def test_a_session_on_a_channel_without_security_is_refused(plc_server, pki, monkeypatch):
    """A client that skips its own endpoint check and opens its channel with security None,
    though None is not offered: no session (so no password sent and no browse)."""
    from asyncua import Client
    from asyncua.ua.uaerrors import BadSecurityPolicyRejected

    # asyncua's client refuses by itself once it has the server's endpoints; this one does not
    monkeypatch.setattr(Client, "find_endpoint", staticmethod(lambda endpoints, mode, uri: endpoints[0]))
    client = Client(plc_server.opcua_url, timeout=10)
    client.set_user(USER)
    client.set_password(PASSWORD)
    with pytest.raises(BadSecurityPolicyRejected):
        await client.connect()
    await client.disconnect()
    assert "which is not offered (--opcua-security)" in plc_server.server.log()
    endpoints = await Client(plc_server.opcua_url).connect_and_get_server_endpoints()
    assert endpoints  # discovery still answers on such a channel


async def test_the_server_certificate_is_made_once_and_kept_private(plc_server):
    from asyncua import Client
    from cryptography import x509

    folder = plc_server.data_dir / "opcua"
    cert = (folder / "server-cert.der").read_bytes()
    assert stat.S_IMODE((folder / "server-key.pem").stat().st_mode) == 0o600
    endpoints = await Client(plc_server.opcua_url).connect_and_get_server_endpoints()
    policies = {e.SecurityPolicyUri.rsplit("#", 1)[1] for e in endpoints}
    assert policies == {"Basic256Sha256", "Aes128_Sha256_RsaOaep"}
    assert all(e.ServerCertificate == cert for e in endpoints)
    san = x509.load_der_x509_certificate(cert).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert any(u.endswith(":visionserve") for u in san.get_values_for_type(x509.UniformResourceIdentifier))
    assert all(not e.UserIdentityTokens or all(t.TokenType != 0 for t in e.UserIdentityTokens)
               for e in endpoints)  # 0 = anonymous: not offered


def test_plc_sim_end_to_end_on_both_protocols(plc_server, tmp_path):
    out = tmp_path / "sim.json"
    proc = subprocess.run(
        [sys.executable, "-m", "visionserve", "plc-sim", "--modbus", f"127.0.0.1:{plc_server.modbus_port}",
         "--opcua", plc_server.opcua_url, "--user", USER, "--password-file", str(plc_server.password_file),
         "--cert-dir", str(tmp_path / "sim-pki"), "--url", plc_server.server.url, "--model", "tiny",
         "--camera", "cam1", "--station", "1", "--rate", "20", "--count", "30",
         "--images", "gen:64x48:n=3", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=str(REPO), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rep = json.loads(out.read_text())
    assert rep["line"]["answered_200"] == 30
    for name in ("modbus", "opcua"):
        p = rep["protocols"][name]
        assert (p["results"], p["missing"], p["in_order"]) == (30, 0, True), p
        assert p["rejects"] == p["codes"]["NG"] + p["codes"]["no decision"]
        assert p["seen_ms"]["n"] == 30 and p["heartbeat_toggles"] >= 1
    assert "sent -> seen on the PLC side" in proc.stdout


# --- readiness and drain ---------------------------------------------------------------------


def test_state_and_ready_follow_start_up_and_drain(tiny_repo, tmp_path, jpeg_bytes):
    s = start_plc_server(tiny_repo, tmp_path, "--drain-timeout-s", "20", opcua=True, wait=False,
                         hooks=("hold-load",))
    try:
        from plc_support import wait_listening

        wait_listening(int(s.opcua_url.rsplit(":", 1)[1]))  # (Modbus starts first)
        plc = Plc(s.modbus_port)
        plc.reset()

        async def state() -> tuple[str, bool, bool]:
            client = await opcua_client(s.opcua_url, tmp_path / "pki")
            try:
                ns, system = await vision_system(client)
                return ((await read(system, ns, "VisionStateMachine", "CurrentState")).Text,
                        await read(system, ns, "Status", "Ready"), Status.READY in plc.status())
            finally:
                await client.disconnect()

        assert asyncio.run(state()) == ("Preoperational", False, False)  # models still loading
        s.unhook("hold-load")
        s.server.wait_ready()
        wait_for(lambda: Status.READY in plc.status(), 10, "Ready")
        assert asyncio.run(state()) == ("Operational", True, True)
        s.hook("slow", "3")  # the next frame takes 3 s: the drain has to wait for it
        answer: dict = {}
        sender = threading.Thread(target=lambda: answer.setdefault("r", s.inspect("7001", jpeg=jpeg_bytes,
                                                                                  deadline_ms=30_000)))
        sender.start()
        wait_for(lambda: Status.BUSY in plc.status(), 10, "Busy")
        s.server.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: Status.READY not in plc.status(), 10, "Ready to drop on drain")
        assert asyncio.run(state()) == ("Halted", False, False)
        regs = plc.take()  # the frame in flight is still answered, and published
        assert regs[8] << 16 | regs[9] == 7001
        sender.join(30)
        assert answer["r"].status_code == 200
        assert s.server.proc.wait(30) == 0
        plc.close()
    finally:
        s.server.stop()


async def test_a_plc_activates_a_stations_recipe(tmp_path, pki):
    """RecipeManagement with a recipes file: the recipes, what each station runs, and the
    ActivateRecipe method, which switches as POST /v1/stations/{s}/recipe does; a switch over
    HTTP shows on the PLC side too."""
    import httpx
    from asyncua import ua
    from tests.tools.recipe_repo import RECIPES, versioned_tiny

    repo = tmp_path / "repo"
    versioned_tiny(repo / "tiny")
    (repo / "recipes.toml").write_text(RECIPES)
    s = start_plc_server(repo, tmp_path, "--plc-stations", "cam1", opcua=True, modbus=False)
    client = await opcua_client(s.opcua_url, pki)
    try:
        ns, system = await vision_system(client)
        assert await read(system, ns, "RecipeManagement", "Recipes") == \
            ["housing-black", "housing-grey", "housing-white"]
        assert await read(system, ns, "RecipeManagement", "Stations") == ["st1", "st2"]
        assert await read(system, ns, "RecipeManagement", "ActiveRecipes") == ["housing-black", ""]
        manager = await system.get_child(f"{ns}:RecipeManagement")
        activate = await manager.get_child(f"{ns}:ActivateRecipe")
        answer = json.loads(await manager.call_method(activate, "st1", "housing-white"))
        assert (answer["station"], answer["recipe"], answer["version"]) == ("st1", "housing-white", 2)
        assert httpx.get(s.server.url + "/v1/stations/st1").json()["recipe"] == "housing-white"
        assert await read(system, ns, "RecipeManagement", "ActiveRecipes") == ["housing-white", ""]
        for args, status in ((("st1", "nope"), "BadNotFound"), (("st9", "housing-white"), "BadNotFound"),
                             (("st2", "housing-black"), "BadInvalidState")):  # st1's verdict differs
            with pytest.raises(ua.UaStatusCodeError, match=status):
                await manager.call_method(activate, *args)
        assert httpx.post(s.server.url + "/v1/stations/st2/recipe",
                          json={"recipe": "housing-white"}).status_code == 200

        async def both_white():
            return await read(system, ns, "RecipeManagement", "ActiveRecipes") == \
                ["housing-white", "housing-white"]

        for _ in range(100):
            if await both_white():
                break
            await asyncio.sleep(0.05)
        assert await both_white()
        assert "switched from recipe housing-black to housing-white by opcua" in s.server.log()
    finally:
        await client.disconnect()
        s.server.stop()


# --- the README's walkthrough ----------------------------------------------------------------


def test_the_readme_plc_walkthrough_works_as_written(tmp_path, jpeg_bytes):
    """The commands of the README's "Talking to the PLC", run as written by bash in a checkout
    with its .venv (the suite's) and a fresh home folder: the password file is made, the server
    starts on it, each plc-sim connects, prints a line per result and a summary on Ctrl-C, with
    no warning. Only the ports are this test's own, and the pip line is not run (offline: the
    suite's venv has the extra)."""
    import os
    import re
    from pathlib import Path

    import httpx
    from conftest import free_port

    venv = Path(sys.prefix)
    if not (venv / "bin" / "visionserve").exists():
        pytest.skip("the suite does not run from a venv with the visionserve command")
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Talking to the PLC"):]
    section = section[:section.index("\n## ")]
    commands = [c.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                for c in block.replace("\\\n", " ").splitlines() if c.strip()]
    install, password, serve, sim_modbus, sim_opcua = commands
    assert install.startswith(".venv/bin/pip install -e '.[plc]' -c requirements/constraints.txt")

    home, checkout = tmp_path / "home", tmp_path / "checkout"
    home.mkdir()
    checkout.mkdir()
    (checkout / ".venv").symlink_to(venv)
    (checkout / "models").symlink_to(REPO / "models")
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO))
    ports = {":5020": f":{free_port()}", ":4840": f":{free_port()}"}
    http_port = free_port()

    def here(command: str) -> str:
        for theirs, ours in ports.items():
            command = command.replace(theirs, ours)
        return command

    def start(command: str, name: str) -> tuple[subprocess.Popen, Path]:
        out = tmp_path / f"{name}.out"
        with open(out, "wb") as f:
            proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=checkout, env=env,
                                    stdout=f, stderr=subprocess.STDOUT)
        return proc, out

    subprocess.run(["bash", "-c", password], cwd=checkout, env=env, check=True)
    pw = home / ".config" / "visionserve" / "plc.pw"
    assert pw.read_text().strip() and stat.S_IMODE(pw.stat().st_mode) == 0o600
    server, server_out = start(here(serve) + f" --http-port {http_port} --grpc-port -1", "serve")
    sims: list[tuple[subprocess.Popen, Path]] = []
    try:
        url = f"http://127.0.0.1:{http_port}"

        def ready() -> bool:
            assert server.poll() is None, server_out.read_text()
            try:
                return httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 120, "the server to be ready")
        sims = [start(here(sim_modbus), "sim-modbus"), start(here(sim_opcua), "sim-opcua")]
        for proc, out in sims:
            wait_for(lambda: proc.poll() is None and "connected to" in out.read_text()
                     or proc.poll() is not None, 60, "plc-sim to connect")
            assert proc.poll() is None, out.read_text()
        r = httpx.post(url + "/v1/models/defect-classifier/inspect", content=jpeg_bytes,
                       headers={"Content-Type": "image/jpeg", "X-Part-Id": "4242"}, timeout=30)
        assert r.status_code in (200, 504), r.text
        for name, (proc, out) in zip(("modbus", "opcua"), sims):
            wait_for(lambda: f"{name}: part 4242 " in out.read_text(), 20, f"the {name} result line")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(30) == 0, out.read_text()
            text = out.read_text()
            assert f"{name}: 1 results" in text, text  # the summary
            assert "WARNING" not in text and "Traceback" not in text, text
    finally:
        for proc, _ in sims:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
