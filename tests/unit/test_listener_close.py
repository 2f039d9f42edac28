"""The close of an HTTP listener at shutdown (``refuse_until_quiet``), on real loopback
sockets: what the kernel queued is answered 503, new connections are kept out before the close,
and nothing queued is reset by it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import subprocess
import sys

import pytest

from visionserve.http.connections import refuse_until_quiet, shut_the_door

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux socket filter")


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return sock


def _read_all(conn: socket.socket) -> bytes:
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    conn.close()
    return data


async def test_the_backlog_is_answered_503_and_the_port_then_refuses():
    listener = _listener()
    port = listener.getsockname()[1]
    queued = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
    for c in queued:  # nobody accepts them yet: they wait in the backlog
        c.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    closing = asyncio.create_task(refuse_until_quiet(listener))
    answers = await asyncio.gather(*(asyncio.to_thread(_read_all, c) for c in queued))
    for answer in answers:
        head = answer.split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 503") and b"retry-after: 1" in head, answer
        assert b"shutting down" in answer
    await asyncio.wait_for(closing, 10)
    assert listener.fileno() == -1
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10)


@linux
@pytest.mark.parametrize("family, host", [(socket.AF_INET, "127.0.0.1"),
                                          (socket.AF_INET6, "::1")])
def test_the_shut_door_keeps_new_connections_out_and_the_queued_ones_in(family, host):
    try:
        listener = socket.socket(family)
        listener.bind((host, 0))
    except OSError:
        pytest.skip(f"no {host} here")
    listener.listen(16)
    port = listener.getsockname()[1]
    before = socket.create_connection((host, port), timeout=10)
    before.sendall(b"queued")
    assert shut_the_door(listener)
    with pytest.raises(TimeoutError):  # its SYN is dropped: no handshake, nothing to reset
        socket.create_connection((host, port), timeout=0.3)
    conn, _ = listener.accept()  # the one the kernel accepted before is still there
    assert conn.recv(16) == b"queued"
    conn.sendall(b"answer")  # and the connection works both ways, the filter notwithstanding
    conn.close()
    assert _read_all(before) == b"answer"
    listener.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, port), timeout=10)


@pytest.fixture
def cert_and_key(tmp_path) -> tuple:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


async def test_over_tls_the_backlog_is_answered_over_tls(cert_and_key):
    cert, key = cert_and_key
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    client_tls = ssl.create_default_context(cafile=str(cert))
    listener = _listener()
    port = listener.getsockname()[1]

    def client() -> bytes:
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        with client_tls.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
            conn.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            with contextlib.suppress(ssl.SSLEOFError):  # the server closes without close_notify
                while chunk := conn.recv(65536):
                    data += chunk
            return data

    answer = asyncio.create_task(asyncio.to_thread(client))
    await asyncio.sleep(0.1)  # the client's connection waits in the backlog
    await asyncio.wait_for(refuse_until_quiet(listener, server_tls), 10)
    head = (await answer).split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 503") and b"retry-after: 1" in head, head
