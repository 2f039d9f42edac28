"""The Modbus TCP server of a real ``visionserve serve``, with real pymodbus clients on loopback:
results in order with their part ids from every front end, the acknowledge handshake, overflow
and Fault, the protocol's own errors for bad input, and the heartbeat stopping when the engine
hangs (docs/plc.md)."""

from __future__ import annotations

import os
import re
import signal
import socket
import struct
import threading
import time

import httpx
import numpy as np
import pytest
from conftest import wait_for
from plc_support import RESET, E, Plc, part_of, start_plc_server, wait_listening

from visionserve.plc.bus import Reason, ResultCode
from visionserve.plc.handshake import Fault, Status

pytest.importorskip("pymodbus")
pytestmark = pytest.mark.timeout(180)

LABELS = ["ok", "dent", "scratch"]
BUFFER = 8
MAX_CLIENTS = 4


@pytest.fixture(scope="module")
def plc_server(tiny_repo, tmp_path_factory):
    s = start_plc_server(tiny_repo, tmp_path_factory.mktemp("plc-modbus"),
                         "--plc-stations", "cam1,*", "--plc-buffer", str(BUFFER),
                         "--plc-heartbeat-ms", "100", "--plc-max-clients", str(MAX_CLIENTS))
    yield s
    s.server.stop()


@pytest.fixture
def plc(plc_server):
    p = Plc(plc_server.modbus_port, unit=2)  # station 2: "*", frames without a camera id
    p.reset()
    yield p
    p.control(0)
    p.close()


def _check(regs: list[int], answer: dict, part: int) -> None:
    assert part_of(regs) == part
    verdict = answer["verdict"]
    assert regs[3] == (ResultCode.OK if verdict == "OK" else ResultCode.NG)
    assert regs[4] == Reason.NONE
    assert regs[5] == LABELS.index(answer["label"])
    assert abs(regs[6] - answer["score"] * 1000) <= 1
    assert 0 < regs[7] <= answer["timing"]["total_ms"] * 10 + 5  # latency in 0.1 ms
    assert (Status.PASS if verdict == "OK" else Status.FAIL) in Status(regs[0])


def test_inspect_results_reach_the_plc_in_order_with_their_part_ids(plc_server, plc, jpeg_bytes):
    answers = []
    for i in range(6):
        r = plc_server.inspect(str(1000 + i), jpeg=jpeg_bytes)
        assert r.status_code == 200, r.text
        answers.append(r.json())
    results = [plc.take() for _ in answers]
    for i, (regs, answer) in enumerate(zip(results, answers)):
        _check(regs, answer, 1000 + i)
    ids = [r[2] for r in results]
    assert ids == list(range(ids[0], ids[0] + 6))  # the inspection id counts each result
    assert Status.RESULT_VALID not in plc.status()
    # the console's System page: the PLC connected, the station's last handshake
    def system_page() -> str | None:
        text = re.sub(r"\s+", "", httpx.get(plc_server.server.url + "/ui/system", timeout=10).text)
        return text if "<th" in text and "Lastacknowledged" in text else None

    page = wait_for(system_page, what="the handshake on the System page")
    assert "<td>modbus</td>" in page and "<td>OK</td>" in page, page



def test_cameras_go_to_their_own_station(plc_server, plc, jpeg_bytes):
    cam1 = Plc(plc_server.modbus_port, unit=1)
    try:
        cam1.reset()
        assert plc_server.inspect("77", camera="cam1", jpeg=jpeg_bytes).status_code == 200
        assert plc_server.inspect("78", camera="cam9", jpeg=jpeg_bytes).status_code == 200  # -> "*"
        assert part_of(cam1.take()) == 77
        assert part_of(plc.take()) == 78
        time.sleep(0.2)
        assert Status.RESULT_VALID not in cam1.status()
    finally:
        cam1.control(0)
        cam1.close()


def test_every_front_end_publishes_oip_http_grpc_and_streaming(plc_server, plc, jpeg_bytes):
    import httpx
    import tritonclient.grpc as grpcclient

    url = plc_server.server.url
    body = {"id": "ignored", "parameters": {"part_id": "2001"},
            "inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                        "data": [__import__("base64").b64encode(jpeg_bytes).decode()]}]}
    assert httpx.post(f"{url}/v2/models/tiny/infer", json=body, timeout=30).status_code == 200
    client = grpcclient.InferenceServerClient(plc_server.server.grpc_url)
    inp = grpcclient.InferInput("image", [1], "BYTES")
    inp.set_data_from_numpy(np.array([jpeg_bytes], dtype=object))
    client.infer("tiny", [inp], request_id="2002")  # the request id is the part id
    done = threading.Event()
    client.start_stream(callback=lambda result, error: done.set())
    client.async_stream_infer("tiny", [inp], request_id="2003")
    assert done.wait(30)
    client.stop_stream()
    client.close()
    assert [part_of(plc.take()) for _ in range(3)] == [2001, 2002, 2003]


def test_late_frames_are_no_decision(plc_server, plc, jpeg_bytes):
    r = plc_server.inspect("3001", jpeg=jpeg_bytes, deadline_ms=0.001)
    assert r.status_code in (200, 504)
    regs = plc.take()
    assert part_of(regs) == 3001
    assert (regs[3], regs[4]) == (ResultCode.NO_DECISION, Reason.LATE)
    status = Status(regs[0])
    assert Status.FAIL in status and Status.PASS not in status  # a PLC reading only Fail rejects
    assert regs[5] == 0xFFFF and regs[6] == 0


def test_a_plc_that_never_acknowledges_fills_the_buffer_and_raises_fault(plc_server, plc,
                                                                          jpeg_bytes):
    overflows = plc_server.metric('visionserve_plc_buffer_overflows_total{station="*"}')
    for i in range(BUFFER + 2):  # inference goes on while the PLC does not acknowledge
        assert plc_server.inspect(str(4000 + i), jpeg=jpeg_bytes).status_code == 200
    regs = wait_for(lambda: (r := plc.regs()) and Status.FAULT in Status(r[0]) and r, 10, "Fault")
    status = Status(regs[0])
    assert Status.OVERFLOW in status and Status.RESULT_VALID in status and Status.READY in status
    assert regs[1] == Fault.OVERFLOW
    assert (regs[11], regs[12]) == (BUFFER - 1, 2)  # waiting behind the presented one, dropped
    taken = [plc.take() for _ in range(BUFFER)]
    assert [part_of(r) for r in taken] == list(range(4000, 4000 + BUFFER))  # the oldest, in order
    first = taken[0][2]
    assert Status.FAULT in plc.status()  # results were lost: Fault stays until reset
    plc.control(E | RESET)
    plc.control(E)
    assert Status.FAULT not in plc.status()
    assert plc_server.inspect("4100", jpeg=jpeg_bytes).status_code == 200
    regs = plc.take()
    assert regs[2] == first + BUFFER + 2  # the dropped results' ids are a gap the PLC can see
    assert plc_server.metric('visionserve_plc_buffer_overflows_total{station="*"}') == overflows + 2


def test_writes_outside_the_map_get_the_protocols_errors(plc_server, plc):
    c = plc.client
    for rr, code in ((c.write_register(21, 1, device_id=2), 2),  # past the holding registers
                     (c.write_register(0, 0x40, device_id=2), 3),  # no such control bit
                     (c.write_coil(9, True, device_id=2), 2),
                     (c.read_input_registers(0, count=40, device_id=2), 2),
                     (c.read_input_registers(0, count=1, device_id=99), 0x0A)):  # no such station
        assert rr.isError() and rr.exception_code == code, rr
    assert Status.ENABLED in plc.status()  # nothing refused changed the station


def _mbap(tid: int, unit: int, pdu: bytes, proto: int = 0) -> bytes:
    return struct.pack(">HHHB", tid, proto, len(pdu) + 1, unit) + pdu


def _exchange(sock: socket.socket, frame: bytes) -> bytes:
    """The server's answer to ``frame``; b"" when it closed the connection instead."""
    try:
        sock.sendall(frame)
        return sock.recv(256)
    except ConnectionResetError:
        return b""


def test_malformed_frames_are_answered_or_cut_off_logged_once_per_client(plc_server, plc):
    log_before = plc_server.server.log().count("sent a malformed request")
    with socket.create_connection(("127.0.0.1", plc_server.modbus_port), timeout=5) as s:
        for tid in range(1, 6):  # an unknown function code: ILLEGAL FUNCTION, five times
            answer = _exchange(s, _mbap(tid, 2, b"\x63\x00\x00"))
            assert answer[7] == 0x63 | 0x80 and answer[8] == 1
        answer = _exchange(s, _mbap(9, 2, b"\x04\x00\x00\x00\x01"))  # still served
        assert answer[7] == 4
    with socket.create_connection(("127.0.0.1", plc_server.modbus_port), timeout=5) as s:
        assert _exchange(s, _mbap(1, 2, b"\x04\x00\x00\x00\x01", proto=0x1234)) == b""  # closed
    assert Status.ENABLED in plc.status()  # the server keeps serving everyone else
    wait_for(lambda: plc_server.server.log().count("sent a malformed request") == log_before + 2, 5,
             "one log line per misbehaving client")


def test_too_many_clients_are_refused_and_the_others_keep_being_served(plc_server, plc):
    wait_for(lambda: plc_server.metric('visionserve_plc_clients{protocol="modbus"}') == 1, 10,
             "earlier tests' connections to be gone")
    socks = []
    try:
        for tid in range(MAX_CLIENTS + 2):  # the test's own PLC holds one slot already
            s = socket.create_connection(("127.0.0.1", plc_server.modbus_port), timeout=5)
            socks.append((s, _exchange(s, _mbap(tid, 2, b"\x04\x00\x00\x00\x01"))))
        answered = [a for _, a in socks if a]
        assert len(answered) == MAX_CLIENTS - 1
        assert sum(not a for _, a in socks) == 3
        assert Status.ENABLED in plc.status()
    finally:
        for s, _ in socks:
            s.close()
    assert plc_server.server.log().count("refused a client from 127.0.0.1") == 1
    time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", plc_server.modbus_port), timeout=5) as s:
        assert _exchange(s, _mbap(1, 2, b"\x04\x00\x00\x00\x01"))  # slots are free again


def test_a_client_vanishing_mid_handshake_leaves_the_result_for_the_next(plc_server, plc,
                                                                         jpeg_bytes):
    assert plc_server.inspect("5001", jpeg=jpeg_bytes).status_code == 200
    wait_for(lambda: Status.RESULT_VALID in plc.status(), 10, "ResultValid")
    with socket.create_connection(("127.0.0.1", plc_server.modbus_port), timeout=5) as s:
        _exchange(s, _mbap(1, 2, b"\x04\x00\x00\x00\x10"))  # another client reads... and is gone
    plc.client.close()  # and so is ours, mid-handshake
    plc.client.connect()
    assert plc_server.inspect("5002", jpeg=jpeg_bytes).status_code == 200
    assert [part_of(plc.take()), part_of(plc.take())] == [5001, 5002]


# --- the heartbeat follows engine progress ---------------------------------------------------


def test_the_heartbeat_stops_when_the_engine_hangs(tiny_repo, tmp_path, jpeg_bytes):
    """The process and its PLC servers live on; the model call never returns: the watchdog stops
    the heartbeat, raises Fault and drops Ready on both protocols, and all comes back after."""
    s = start_plc_server(tiny_repo, tmp_path, "--plc-heartbeat-ms", "100",
                         "--plc-watchdog-ms", "500", opcua=True)
    plc = Plc(s.modbus_port, unit=1)
    try:
        plc.reset()
        assert plc.heartbeat_toggles(1.0) >= 4
        assert Status.READY in plc.status()
        s.hook("hang")
        answer: dict = {}
        sender = threading.Thread(target=lambda: answer.setdefault(
            "r", s.inspect("6001", jpeg=jpeg_bytes, deadline_ms=60_000)))
        sender.start()
        regs = wait_for(lambda: (r := plc.regs()) and Fault.STALLED & r[1] and r, 10, "a stall")
        assert Status.FAULT in Status(regs[0]) and Status.READY not in Status(regs[0])
        assert plc.heartbeat_toggles(1.0) == 0
        count = plc.regs()[13]
        _opcua_sees_the_stall(s, tmp_path)
        assert plc.regs()[13] == count  # the toggle counter stood still too
        assert s.metric("visionserve_plc_engine_stalled") == 1
        s.unhook("hang")
        sender.join(30)
        assert answer["r"].status_code == 200
        wait_for(lambda: Status.READY in plc.status(), 10, "Ready again")
        assert plc.heartbeat_toggles(1.0) >= 4
        assert plc.regs()[1] == 0 and part_of(plc.take()) == 6001
        assert "PLC watchdog" in s.server.log()
    finally:
        s.unhook("hang")
        plc.close()
        s.server.stop()


def _opcua_sees_the_stall(s, tmp_path) -> None:
    import asyncio

    from plc_support import opcua_client, read, vision_system

    async def check():
        client = await opcua_client(s.opcua_url, tmp_path / "client-pki")
        try:
            ns, system = await vision_system(client)
            assert (await read(system, ns, "VisionStateMachine", "CurrentState")).Text == "Error"
            assert await read(system, ns, "Status", "Fault") is True
            assert "stalled" in await read(system, ns, "Status", "FaultReason")
            beat = await read(system, ns, "Status", "Heartbeat")
            await asyncio.sleep(0.5)
            assert await read(system, ns, "Status", "Heartbeat") == beat
            assert await read(system, ns, "Status", "Ready") is False
        finally:
            await client.disconnect()

    asyncio.run(check())


def test_modbus_listens_before_the_models_are_ready(tiny_repo, tmp_path):
    s = start_plc_server(tiny_repo, tmp_path, wait=False, hooks=("hold-load",))
    try:
        wait_listening(s.modbus_port)
        plc = Plc(s.modbus_port)
        try:
            assert Status.READY not in plc.status()
            s.unhook("hold-load")
            s.server.wait_ready()
            wait_for(lambda: Status.READY in plc.status(), 10, "Ready")
        finally:
            plc.close()
    finally:
        s.server.stop()


def test_frames_through_front_end_processes_are_published_too(tiny_repo, tmp_path, jpeg_bytes):
    """--frontends: the front ends run in child processes; the engine (and the bus) in this one."""
    s = start_plc_server(tiny_repo, tmp_path, "--frontends", "1")
    plc = Plc(s.modbus_port)
    try:
        plc.reset()
        for part in ("8001", "8002"):
            assert s.inspect(part, jpeg=jpeg_bytes).status_code == 200
        assert [part_of(plc.take()), part_of(plc.take())] == [8001, 8002]
    finally:
        plc.close()
        s.server.stop()


def _children(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc)."""
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if int(ppid) == pid and state != "Z":
            out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_plc_servers_run_apart_judge_a_frozen_server_and_die_with_it(tiny_repo, tmp_path,
                                                                      jpeg_bytes):
    """Each protocol's server runs in a process of its own: it still answers the PLC while the
    serving process is frozen (SIGSTOP), stops the heartbeat and raises Fault because no probe
    of the engine comes, resumes after SIGCONT, and exits when the serving process is killed."""
    s = start_plc_server(tiny_repo, tmp_path, "--plc-heartbeat-ms", "100",
                         "--plc-watchdog-ms", "500", opcua=True)
    pid = s.server.proc.pid
    plc = Plc(s.modbus_port)
    try:
        plc.reset()
        kids = []
        for k in _children(pid):
            with open(f"/proc/{k}/cmdline", "rb") as f:
                if b"visionserve.plc.child" in f.read():
                    kids.append(k)
        assert len(kids) == 2  # Modbus and OPC UA
        assert s.inspect("9001", jpeg=jpeg_bytes).status_code == 200
        assert part_of(plc.take()) == 9001
        os.kill(pid, signal.SIGSTOP)
        try:
            regs = wait_for(lambda: (r := plc.regs()) and Fault.STALLED & r[1] and r, 10, "a stall")
            assert Status.READY not in Status(regs[0]) and Status.FAULT in Status(regs[0])
            assert plc.heartbeat_toggles(0.5) == 0
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: Status.READY in plc.status(), 10, "Ready again")
        assert plc.heartbeat_toggles(1.0) >= 4 and plc.regs()[1] == 0
        s.server.proc.kill()
        s.server.proc.wait()
        wait_for(lambda: not any(_alive(k) for k in kids), 10, "the PLC server processes to exit")
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", s.modbus_port), timeout=2).close()
    finally:
        plc.close()
        s.server.stop()


def test_idle_connections_make_room_for_the_real_plc_and_time_out(tiny_repo, tmp_path):
    """Every --plc-max-clients slot (the default 8) held by sockets that never send a byte: a
    real PLC still connects and reads and writes at once (the oldest silent socket gives way),
    and the silent ones are closed after --plc-idle-timeout-s while the polling PLC stays."""
    s = start_plc_server(tiny_repo, tmp_path, "--plc-idle-timeout-s", "3")
    idle = [socket.create_connection(("127.0.0.1", s.modbus_port), timeout=5) for _ in range(8)]
    plc = None
    try:
        time.sleep(0.3)  # every one of them accepted and holding its slot
        start = time.monotonic()
        plc = Plc(s.modbus_port)
        plc.reset()
        assert Status.ENABLED in plc.status()
        assert time.monotonic() - start < 5
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""  # the oldest silent one made room
        assert "closed to make room for a new client" in s.server.log()

        def all_closed() -> bool:
            assert Status.ENABLED in plc.status()  # the PLC polls: it keeps its slot
            for sock in idle[1:]:
                sock.setblocking(False)
                try:
                    if sock.recv(1) != b"":
                        return False
                except BlockingIOError:
                    return False
            return True

        wait_for(all_closed, 15, "the idle connections to be closed")
        assert "nothing sent for 3 s" in s.server.log()
        assert Status.ENABLED in plc.status()
    finally:
        for sock in idle:
            sock.close()
        if plc is not None:
            plc.close()
        s.server.stop()


def _plc_children(pid: int) -> list[int]:
    kids = []
    for k in _children(pid):
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"visionserve.plc.child" in f.read():
                kids.append(k)
    return kids


def test_a_killed_plc_server_process_is_reaped_and_started_again(tiny_repo, tmp_path, jpeg_bytes):
    """kill -9 of the Modbus server's process: the server reports not ready while it is down,
    reaps it (no zombie), starts it again, and the PLC reads and writes and gets results again;
    then the server is ready again."""
    import httpx

    s = start_plc_server(tiny_repo, tmp_path)
    ready_url = s.server.url + "/v2/health/ready"
    try:
        (kid,) = _plc_children(s.server.proc.pid)
        os.kill(kid, signal.SIGKILL)
        wait_for(lambda: httpx.get(ready_url, timeout=5).status_code == 503, 10, "not ready")
        wait_for(lambda: not os.path.exists(f"/proc/{kid}"), 10, "the dead process to be reaped")

        def plc_back() -> Plc | None:
            try:
                return Plc(s.modbus_port)
            except AssertionError:  # not listening yet
                return None

        plc = wait_for(plc_back, 30, "the Modbus server to listen again")
        try:
            plc.reset()
            assert Status.ENABLED in plc.status()
            wait_for(lambda: httpx.get(ready_url, timeout=5).status_code == 200, 30, "ready again")
            assert s.inspect("9101", jpeg=jpeg_bytes).status_code == 200
            assert part_of(plc.take()) == 9101
        finally:
            plc.close()
        assert [k for k in _plc_children(s.server.proc.pid) if k != kid]
        log = s.server.log()
        assert "starting the modbus PLC server process again" in log
        assert "the modbus PLC server is back" in log
    finally:
        s.server.stop()
