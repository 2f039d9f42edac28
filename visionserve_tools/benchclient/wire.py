"""Wire clients for the generator: a raw asyncio HTTP/1.1 client and a grpc.aio OIP client.

No httpx/aiohttp on the hot path: a request is a few pre-built bytes written to a keep-alive
socket and a response is read by Content-Length, so the client costs tens of microseconds per
request and the generator measures the server, not itself.

Each call returns an :class:`Answer`: the outcome (one of :data:`OUTCOMES`) and what the server
said about the frame (verdict, label, score, batch size).
"""

from __future__ import annotations

import asyncio
import json
import re
import struct
from dataclasses import dataclass

# outcome codes (small ints: they travel in numpy arrays between processes)
(OK, LATE, LATE_ANSWER, REJECTED, HTTP_ERROR, CONN_ERROR, TIMEOUT, OVERFLOW, BAD_ANSWER,
 REJECTED_BARE) = range(10)
#: rejected: 503/429 (UNAVAILABLE/RESOURCE_EXHAUSTED) with Retry-After; rejected_no_retry_after:
#: without
OUTCOMES = ("ok", "late", "late_answer", "rejected", "http_error", "conn_error", "timeout",
            "generator_overflow", "bad_answer", "rejected_no_retry_after")
#: outcomes that count as a deadline miss (the part got no usable verdict in time): ``late`` is a
#: 504 / DEADLINE_EXCEEDED / verdict LATE, how visionserve answers every frame whose answer is not
#: ready by its deadline (dropped in the queue, or computed too late); ``late_answer`` is a 200
#: that says ``deadline_met: false``, which only other servers send
MISS_OUTCOMES = (LATE, LATE_ANSWER)
VERDICTS = {"OK": 0, "NG": 1, "LATE": 2}
PROTOCOLS = ("inspect", "oip", "grpc", "json")


@dataclass(slots=True)
class Answer:
    outcome: int
    verdict: int = -1
    label: str = ""
    score: float = float("nan")
    batch_size: int = 0
    detail: str = ""


class ProtocolError(Exception):
    pass


# --- HTTP/1.1 -------------------------------------------------------------------------------


class HttpConnection:
    """One keep-alive connection; one request at a time (no pipelining)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> HttpConnection:
        # asyncio sets TCP_NODELAY on TCP sockets itself
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port,
                                                                 limit=1 << 22)
        return self

    @property
    def closed(self) -> bool:
        return self.writer is None or self.writer.is_closing()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    async def request(self, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(head + body if len(body) < 16384 else head)
        if len(body) >= 16384:
            self.writer.write(body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            raise ProtocolError(f"bad status line {lines[0]!r}") from None
        headers = {}
        for line in lines[1:]:
            if line:
                k, _, v = line.partition(":")
                headers[k.strip().lower()] = v.strip()
        if "content-length" in headers:
            data = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            data = await self._chunked()
        else:
            data = b""
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers, data

    async def _chunked(self) -> bytes:
        assert self.reader is not None
        parts: list[bytes] = []
        while True:
            size = int((await self.reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await self.reader.readline()
                return b"".join(parts)
            parts.append(await self.reader.readexactly(size))
            await self.reader.readline()


def inspect_request(host: str, model: str, frame_data: bytes, content_type: str, part_id: str,
                    deadline_ms: float | None) -> tuple[bytes, bytes]:
    extra = f"X-Deadline-Ms: {deadline_ms:g}\r\n" if deadline_ms else ""
    head = (f"POST /v1/models/{model}/inspect HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(frame_data)}\r\n"
            f"X-Part-Id: {part_id}\r\n{extra}\r\n").encode()
    return head, frame_data


def json_request(host: str, model: str, frame_data: bytes, part_id: str,
                 deadline_ms: float | None) -> tuple[bytes, bytes]:
    """The inspect URL with a JSON body (base64 image), for servers that only take JSON
    (LitServe)."""
    import base64

    body = json.dumps({"image": base64.b64encode(frame_data).decode(), "part_id": part_id,
                       "deadline_ms": deadline_ms}).encode()
    head = (f"POST /v1/models/{model}/inspect HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head, body


def oip_body(frame_data: bytes, deadline_ms: float | None) -> tuple[bytes, bytes]:
    """OIP v2 binary tensor extension: JSON header + one BYTES element (4-byte length + file)."""
    blob = struct.pack("<I", len(frame_data)) + frame_data
    req: dict = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1, 1],
                             "parameters": {"binary_data_size": len(blob)}}],
                 "outputs": [{"name": "verdict", "parameters": {"binary_data": False}},
                             {"name": "label", "parameters": {"binary_data": False}},
                             {"name": "scores", "parameters": {"binary_data": False}}]}
    if deadline_ms:
        req["parameters"] = {"timeout": int(deadline_ms * 1000)}
    header = json.dumps(req, separators=(",", ":")).encode()
    return header, blob


def oip_request(host: str, model: str, frame_data: bytes,
                deadline_ms: float | None) -> tuple[bytes, bytes]:
    header, blob = oip_body(frame_data, deadline_ms)
    body = header + blob
    head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(header)}\r\n\r\n").encode()
    return head, body


def parse_inspect(status: int, data: bytes, headers: dict[str, str] | None = None) -> Answer:
    if status == 200:
        try:
            d = json.loads(data)
            verdict = VERDICTS.get(d.get("verdict"), -1)
            ans = Answer(OK if d.get("deadline_met", True) else LATE_ANSWER, verdict,
                         d.get("label", ""), float(d.get("score", float("nan"))),
                         int(d.get("batch_size", 0) or 0))
        except (ValueError, TypeError, AttributeError):
            return Answer(BAD_ANSWER, detail=data[:200].decode("latin-1"))
        return ans
    return _status_answer(status, data, headers)


def parse_oip(status: int, headers: dict[str, str], data: bytes) -> Answer:
    if status != 200:
        return _status_answer(status, data, headers)
    n = headers.get("inference-header-content-length")
    try:
        d = json.loads(data[:int(n)] if n else data)
        out = {o["name"]: o.get("data") for o in d.get("outputs", [])}
        verdict = _first(out.get("verdict"))
        label = _first(out.get("label"))
        scores = out.get("scores") or []
        score = float(max(_flat(scores))) if scores else float("nan")
    except (ValueError, TypeError, KeyError):
        return Answer(BAD_ANSWER, detail=data[:200].decode("latin-1"))
    return Answer(OK, VERDICTS.get(verdict, -1), label or "", score)


def _first(v):
    while isinstance(v, list):
        v = v[0] if v else None
    return v


def _flat(v):
    if isinstance(v, list):
        for x in v:
            yield from _flat(x)
    else:
        yield v


def _status_answer(status: int, data: bytes, headers: dict[str, str] | None = None) -> Answer:
    """``headers`` (lower-case names) given: a refusal without Retry-After is told apart. A 504
    (the inspect API's says verdict LATE and how late) is a deadline miss, never an error."""
    text = data[:300].decode("utf-8", "replace")
    if status == 504 or b'"LATE"' in data[:400]:
        return Answer(LATE, VERDICTS["LATE"], detail=text)
    if status in (503, 429):
        return Answer(REJECTED if headers is None or "retry-after" in headers else REJECTED_BARE,
                      detail=text)
    return Answer(HTTP_ERROR, detail=f"{status} {text}")


_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?!\w)")


def error_reason(status: int, data: bytes) -> str:
    """``status`` and the error body's message (``{"error": ...}``, else its first bytes) with
    its free-standing numbers as ``N``, so that answers refused for one reason group together
    (``503 queue of model rn50 is full (N frames)``)."""
    try:
        message = json.loads(data).get("error")
    except (ValueError, AttributeError):
        message = None
    if not isinstance(message, str):
        message = data[:120].decode("utf-8", "replace")
    return f"{status} {_NUMBER.sub('N', ' '.join(message.split()))[:160]}".rstrip()


# --- gRPC (OIP v2, Triton's inference.GRPCInferenceService) ---------------------------------


def grpc_request(model: str, frame_data: bytes, deadline_ms: float | None):
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=model)
    inp = req.inputs.add()
    inp.name, inp.datatype = "image", "BYTES"
    inp.shape.extend([1, 1])
    for name in ("verdict", "label", "scores"):
        req.outputs.add().name = name
    if deadline_ms:
        req.parameters["timeout"].int64_param = int(deadline_ms * 1000)
    req.raw_input_contents.append(struct.pack("<I", len(frame_data)) + frame_data)
    return req


def parse_grpc(resp) -> Answer:
    try:
        raw = dict(zip((o.name for o in resp.outputs), resp.raw_output_contents))
        verdict = _bytes_first(raw.get("verdict")) if "verdict" in raw else None
        label = _bytes_first(raw.get("label")) if "label" in raw else ""
        score = float("nan")
        if "scores" in raw:
            import numpy as np

            score = float(np.frombuffer(raw["scores"], dtype="<f4").max())
    except (ValueError, struct.error) as exc:
        return Answer(BAD_ANSWER, detail=str(exc))
    return Answer(OK, VERDICTS.get(verdict or "", -1), label or "", score)


def _bytes_first(buf: bytes | None) -> str | None:
    if not buf or len(buf) < 4:
        return None
    (n,) = struct.unpack_from("<I", buf, 0)
    return buf[4:4 + n].decode("utf-8", "replace")


def grpc_error_answer(exc) -> Answer:
    import grpc

    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else exc
    text = f"{code.name if code else 'UNKNOWN'}: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Answer(LATE, VERDICTS["LATE"], detail=text)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        meta = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
        # unknown: benefit of doubt
        trailers = {k.lower() for k, _ in meta} if meta is not None else {"retry-after"}
        return Answer(REJECTED if "retry-after" in trailers else REJECTED_BARE, detail=text)
    return Answer(HTTP_ERROR, detail=text)
