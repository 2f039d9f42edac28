"""What one refusal costs the server: server CPU per inspect request that its head refuses.

Sends ``--requests`` inspect requests one after another on one keep-alive connection, each with
a whole frame (``--images``, default a 640x480 JPEG as the overload benchmark sends) and a head
the server refuses (``X-Priority`` out of range: the same admission code as an overloaded
model's 503), and reads the CPU time of the server's process from /proc before and after (Linux).
Under overload most requests end this way, so this is the cost that a flood of refusals takes
from the frames that are served (docs/benchmarks.md, issue 14).

    visionserve serve --models models --http-port 8013 --grpc-port -1 &
    python loadtest/refusal_cost.py --port 8013 --pid $!
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from visionserve_tools.benchclient.images import load


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of ``pid`` so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--pid", type=int, required=True, help="the server's process id")
    ap.add_argument("--model", default="defect-classifier")
    ap.add_argument("--images", default="gen:640x480")
    ap.add_argument("--requests", type=int, default=3000)
    args = ap.parse_args(argv)
    frame = load(args.images)[0]
    head = (f"POST /v1/models/{args.model}/inspect HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: {frame.content_type}\r\nX-Priority: 999\r\n"
            f"Content-Length: {len(frame.data)}\r\n\r\n").encode()
    sock = socket.create_connection(("127.0.0.1", args.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def refused() -> bytes:
        sock.sendall(head + frame.data)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head_, body = answer.split(b"\r\n\r\n", 1)
        length = next(int(line.split(b":")[1]) for line in head_.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += sock.recv(65536)
        return head_.split(b"\r\n", 1)[0]

    status = refused()
    if not status.startswith(b"HTTP/1.1 400"):
        print(f"expected a refusal (400), got {status.decode()}", file=sys.stderr)
        return 1
    for _ in range(200):  # warm up
        refused()
    cpu0, t0 = process_cpu_s(args.pid), time.perf_counter()
    for _ in range(args.requests):
        refused()
    cpu1, t1 = process_cpu_s(args.pid), time.perf_counter()
    print(f"{args.requests} refusals of {len(frame.data)}-byte requests: server CPU "
          f"{(cpu1 - cpu0) / args.requests * 1000:.3f} ms each, round trip "
          f"{(t1 - t0) / args.requests * 1000:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
