"""A server that does no work: it reads each request and answers a fixed inspect verdict at once.

It measures the load generator's own ceiling (``visionserve bench`` against it at high
concurrency): any served figure near that ceiling says more about the generator than the server.

    .venv/bin/python loadtest/peers/null_server.py --port 8900
    .venv/bin/visionserve bench --url http://127.0.0.1:8900 --model null --concurrency 64 --processes 2
"""

from __future__ import annotations

import argparse
import asyncio
import json

ANSWER = json.dumps({"part_id": None, "model": "null", "verdict": "OK", "label": "ok", "score": 1.0,
                     "batch_size": 1, "deadline_met": True}).encode()
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:].strip())
            if length:
                await reader.readexactly(length)
            if head.startswith(b"GET /v2/health/ready"):
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            else:
                writer.write(RESPONSE)
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()


async def main(port: int) -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", port, limit=1 << 22)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=8900)
    a = p.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(main(a.port))
    except KeyboardInterrupt:
        pass
