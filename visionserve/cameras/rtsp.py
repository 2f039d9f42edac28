"""``rtsp://HOST[:PORT]/PATH``: IP cameras, through OpenCV's FFmpeg backend (docs/cameras.md).

The stream is pulled over TCP (``transport = "tcp"``, the default: no frame lost to a dropped
UDP packet; ``"udp"`` where a camera offers nothing else), with FFmpeg's input buffering off, so
a frame is decoded as soon as it arrives. The camera's user and password come in the settings
(``user``, ``password``: the service's credentials file or environment, never the URI): they go
into the URL handed to FFmpeg only, never into :meth:`RtspSource.describe`, a log line or a
fault's message.

**The newest frame at trigger time.** An RTSP camera streams whether anyone looks or not, and a
stream read only at trigger time hands out the frame that waited longest in the socket, seconds
old. So a reader thread of the source decodes the stream all the time, and a grab takes the
first frame that *arrives after* the grab was called (waiting for it, within its timeout): never
one buffered from before the trigger. Frames nobody asked for are decoded (H.264 needs each) but
not converted to pixels. Free-running (``trigger = "free"``, ``rate_hz``) each tick takes the
frame that arrives next in the same way, so no frame is handed out twice. An RTSP camera has no
trigger input: ``trigger = "hardware"`` is a ConfigError.

Faults: a camera that does not answer, refuses the stream or the credentials is a CameraFault
at ``open`` within ``open_timeout_s`` (what went wrong is asked of the camera itself with a
plain RTSP DESCRIBE, without and with the credentials, Basic or Digest: nothing listens, no such
stream, no or a wrong user or password); a stream that
ends or delivers nothing for ``read_timeout_s`` ends the reader, and every grab from then on is
a ``disconnected`` fault (the camera service closes and reopens the source); a grab that gets no
frame within its timeout is a ``timeout`` fault. ``close`` tells the reader to stop and waits for
it at most :data:`CLOSE_WAIT_S` (a reader stuck in a stalled read lets go of the stream itself,
within ``read_timeout_s``; the process waits for such readers when it exits).

Counters (:meth:`RtspSource.stats`): ``frames`` handed out; ``decoded``, every frame the stream
delivered; ``drops``, the times the stream broke off while open (the frames in flight then are
lost); ``reconnects``, opens after the first. A frame replaced by a newer one before any grab
wanted it is no drop: nobody waited for it.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import hashlib
import logging
import os
import re
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import cv2
import numpy as np

from ..errors import ConfigError
from .source import CameraFault, Grabbed, own_settings, redact, register

log = logging.getLogger(__name__)

#: What a camera's settings may say besides the common ones (docs/cameras.md).
KNOWN_SETTINGS = ("transport", "open_timeout_s", "read_timeout_s")
#: How long ``close`` waits for the reader thread.
CLOSE_WAIT_S = 0.5
DEFAULT_PORT = 554
#: OpenCV reads FFmpeg's options from this variable when a capture opens
_OPTIONS_ENV = "OPENCV_FFMPEG_CAPTURE_OPTIONS"


_STALLED = "no frame for {:g} s (the stream stalled, or the camera went away)"


class _OptionsGate:
    """The environment is one per process: captures that open with the same FFmpeg options
    (every camera of one transport) open at once; one with other options waits until those
    are open (an open may take ``open_timeout_s``)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._options: str | None = None
        self._before: str | None = None  # the variable as it was before the opens
        self._opening = 0

    @contextlib.contextmanager
    def use(self, options: str) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._opening == 0 or self._options == options)
            if self._opening == 0:
                self._options = options
                self._before = os.environ.get(_OPTIONS_ENV)
                os.environ[_OPTIONS_ENV] = options
            self._opening += 1
        try:
            yield
        finally:
            with self._cond:
                self._opening -= 1
                if self._opening == 0:
                    if self._before is None:
                        os.environ.pop(_OPTIONS_ENV, None)
                    else:
                        os.environ[_OPTIONS_ENV] = self._before
                    self._options = None
                    self._cond.notify_all()


_GATE = _OptionsGate()


@dataclass(frozen=True)
class RtspSettings:
    """An RTSP camera's own settings, and its credentials."""

    trigger: str = "software"
    transport: str = "tcp"
    open_timeout_s: float = 5.0
    read_timeout_s: float = 2.0
    user: str | None = None
    password: str | None = None

    @classmethod
    def of(cls, name: str, settings: Mapping[str, Any]) -> RtspSettings:
        own = own_settings(name, "rtsp", settings, KNOWN_SETTINGS)
        try:
            out = cls(trigger=str(settings.get("trigger") or "software"),
                      transport=str(own.get("transport", "tcp")),
                      open_timeout_s=float(own.get("open_timeout_s", 5.0)),
                      read_timeout_s=float(own.get("read_timeout_s", 2.0)),
                      user=None if settings.get("user") is None else str(settings["user"]),
                      password=(None if settings.get("password") is None
                                else str(settings["password"])))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"camera {name}: bad rtsp setting: {exc}") from None
        if out.trigger == "hardware":
            raise ConfigError(f"camera {name}: an RTSP camera has no trigger input to wire; use "
                              "trigger = \"software\" (a trigger call takes the next frame of "
                              "the stream) or \"free\" with rate_hz")
        if out.trigger not in ("software", "free"):
            raise ConfigError(f"camera {name}: trigger {out.trigger!r}; use software or free")
        if out.transport not in ("tcp", "udp"):
            raise ConfigError(f"camera {name}: transport {out.transport!r}; use \"tcp\" or "
                              "\"udp\"")
        if not (0 < out.open_timeout_s <= 60 and 0 < out.read_timeout_s <= 60):
            raise ConfigError(f"camera {name}: open_timeout_s and read_timeout_s are above 0 "
                              "and at most 60 s")
        if out.password is not None and out.user is None:
            raise ConfigError(f"camera {name}: a password without a user")
        return out


@dataclass(frozen=True)
class _Decoded:
    """A frame the reader converted for a grab: its BGR pixels and when it arrived."""

    bgr: np.ndarray
    arrived: float


class _Reader:
    """One connection: the capture and the thread that decodes it (see the module's
    docstring). Only its own thread touches the capture."""

    def __init__(self, name: str, capture: cv2.VideoCapture, counts: dict[str, int],
                 read_timeout_s: float) -> None:
        self.capture = capture
        self.counts = counts
        self.read_timeout_s = read_timeout_s
        self.cond = threading.Condition()  # an RLock: take() calls lose() holding it
        self.wanted_since: float | None = None  # a grab waits for a frame arriving after this
        self.latest: _Decoded | None = None
        self.last_arrival = time.monotonic()
        self.lost: str | None = None
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name=f"rtsp-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stopping:
                began = time.monotonic()
                ok = self.capture.grab()
                arrived = time.monotonic()
                if arrived - began >= self.read_timeout_s:
                    # FFmpeg's read timed out; a frame it gives then is OpenCV's drain of the
                    # decoder, from before the stall: never one to hand out
                    self.lose(_STALLED.format(self.read_timeout_s))
                    return
                if not ok:
                    self.lose("the stream ended")
                    return
                self.counts["decoded"] += 1
                with self.cond:
                    self.last_arrival = arrived
                    since = self.wanted_since
                if since is None or arrived < since:
                    continue  # nobody waits for this one: decoded, not converted
                ok, bgr = self.capture.retrieve()
                if not ok or bgr is None:
                    self.lose("a decoded frame could not be converted")
                    return
                with self.cond:
                    self.latest = _Decoded(bgr, arrived)
                    self.cond.notify_all()
        except cv2.error as exc:
            self.lose(f"OpenCV: {exc}")
        finally:
            self.capture.release()

    def lose(self, why: str) -> None:
        """The stream is gone (counted once, unless it was being closed), and the thread
        ends."""
        with self.cond:
            if self.lost is None:
                self.lost = why
                if not self.stopping:
                    self.counts["drops"] += 1
            self.stopping = True
            self.cond.notify_all()

    def take(self, timeout_s: float) -> _Decoded | str | None:
        """The first frame that arrives from now on; the reason the stream is lost; or None
        when none came within ``timeout_s``. A stream that delivered nothing for
        ``read_timeout_s`` is lost (FFmpeg's own read gives up only after a few of those)."""
        start = time.monotonic()
        deadline = start + max(0.0, timeout_s)
        with self.cond:
            self.wanted_since = start
            try:
                while True:
                    if self.lost is not None:
                        return self.lost
                    got = self.latest
                    if got is not None and got.arrived >= start:
                        self.latest = None
                        return got
                    now = time.monotonic()
                    stalled_at = self.last_arrival + self.read_timeout_s
                    if now >= stalled_at:
                        self.lose(_STALLED.format(self.read_timeout_s))
                        continue
                    if now >= deadline:
                        return None
                    self.cond.wait(min(deadline, stalled_at) - now)
            finally:
                self.wanted_since = None

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self.thread.join(timeout=CLOSE_WAIT_S)
        if self.thread.is_alive():  # in a stalled read: it ends by read_timeout_s
            _ENDING.add(self)


#: readers told to stop but still in a read: the process waits for them at exit (a thread that
#: comes back from FFmpeg's code while the interpreter ends can abort the process)
_ENDING: weakref.WeakSet[_Reader] = weakref.WeakSet()


@atexit.register
def _wait_for_readers() -> None:
    for reader in list(_ENDING):
        reader.thread.join(timeout=reader.read_timeout_s + 1.0)


class RtspSource:
    """An IP camera's RTSP stream (see the module's docstring)."""

    def __init__(self, name: str, uri: str, settings: Mapping[str, Any]) -> None:
        self.name = name
        self.settings = RtspSettings.of(name, settings)
        try:
            parts = urlsplit(uri)
            parts.port  # noqa: B018 - a bad port raises here
        except ValueError as exc:
            raise ConfigError(f"camera {name}: {redact(uri)!r} is not an RTSP URL: "
                              f"{exc}") from None
        if parts.scheme != "rtsp" or not parts.hostname:
            raise ConfigError(f"camera {name}: {redact(uri)!r}: expected rtsp://HOST[:PORT]/PATH")
        if parts.username is not None or parts.password is not None:
            raise ConfigError(f"camera {name}: no user or password in the URI "
                              f"({redact(uri)}): give them in --camera-credentials or the "
                              "environment (docs/cameras.md, Credentials)")
        self._parts = parts
        self.host = parts.hostname
        self.port = parts.port or DEFAULT_PORT
        self._reader: _Reader | None = None
        self._opens = 0
        self._counts = {"frames": 0, "decoded": 0, "drops": 0, "reconnects": 0}

    def describe(self) -> str:
        return urlunsplit(self._parts)

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def _url(self) -> str:
        """The URL FFmpeg opens: with the credentials in it. Never logged nor shown."""
        s, parts = self.settings, self._parts
        if s.user is None:
            return urlunsplit(parts)
        auth = quote(s.user, safe="")
        if s.password is not None:
            auth += ":" + quote(s.password, safe="")
        return urlunsplit(parts._replace(netloc=f"{auth}@{parts.netloc}"))

    # --- open / close -----------------------------------------------------------------------

    def open(self) -> None:
        self.close()
        s = self.settings
        # fflags nobuffer: the packets FFmpeg reads to learn the stream are not handed out
        # later as frames (a second of them, stale by the time they are decoded)
        options = f"rtsp_transport;{s.transport}|fflags;nobuffer|flags;low_delay"
        params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(s.open_timeout_s * 1000),
                  cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(s.read_timeout_s * 1000)]
        with _GATE.use(options):
            capture = cv2.VideoCapture(self._url(), cv2.CAP_FFMPEG, params)
        if not capture.isOpened():
            capture.release()
            raise self._why_not_opened()
        log.info("camera %s: %s open (%dx%d, %.3g frames/s, %s)", self.name, self.describe(),
                 int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)),
                 int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT)), capture.get(cv2.CAP_PROP_FPS),
                 s.transport)
        if self._opens:
            self._counts["reconnects"] += 1
        self._opens += 1
        self._reader = _Reader(self.name, capture, self._counts, s.read_timeout_s)

    def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.stop()

    def _why_not_opened(self) -> CameraFault:
        """Why the stream did not open, as a fault: asked of the camera with a DESCRIBE, first
        without credentials, then (when it asks for them) with the ones configured."""
        where, url, s = self.describe(), urlunsplit(self._parts), self.settings
        wait = min(s.open_timeout_s, 2.0)
        answer = describe(self.host, self.port, url, wait)
        if isinstance(answer, OSError):
            if isinstance(answer, ConnectionRefusedError):
                return CameraFault(f"{where}: nothing listens at {self.host}:{self.port} "
                                   "(camera off, wrong address or port)", "not_found")
            return CameraFault(f"{where}: {self.host}:{self.port} does not answer "
                               f"({answer.strerror or type(answer).__name__})", "not_found")
        if answer is not None and answer.status == 401:
            if s.user is None:
                return CameraFault(f"{where}: the camera asks for a user and password; give "
                                   "them in --camera-credentials or VISIONSERVE_CAMERA_<NAME>_"
                                   "USER/_PASSWORD (docs/cameras.md)", "config")
            header = authorization(answer.challenge, s.user, s.password or "", url)
            answer = describe(self.host, self.port, url, wait, header) if header else None
            if isinstance(answer, OSError):
                return CameraFault(f"{where}: the camera closed the connection: {answer}",
                                   "disconnected")
            if answer is not None and answer.status == 401:
                return CameraFault(f"{where}: the camera refused the user or password "
                                   "configured for it (401 Unauthorized)", "config")
        if answer is not None and answer.status == 404:
            return CameraFault(f"{where}: the camera has no stream at that path (404)",
                               "not_found")
        if answer is not None and answer.status != 200:
            return CameraFault(f"{where}: the camera answered RTSP status {answer.status}",
                               "error")
        return CameraFault(f"{where}: the stream could not be opened within "
                           f"{s.open_timeout_s:g} s (no video track, or a codec FFmpeg cannot "
                           "decode)", "error")

    # --- grab -------------------------------------------------------------------------------

    def grab(self, timeout_s: float) -> Grabbed:
        reader = self._reader
        if reader is None:
            raise CameraFault(f"camera {self.name} is not open", "disconnected")
        got = reader.take(timeout_s)
        if isinstance(got, str):
            raise CameraFault(f"{self.describe()}: disconnected: {got}", "disconnected")
        if got is None:
            raise CameraFault(f"{self.describe()}: no frame within {timeout_s:.3g} s",
                              "timeout")
        self._counts["frames"] += 1
        return Grabbed(pixels=got.bgr, pixel_format="BGR8")


_STATUS = re.compile(rb"^RTSP/\d\.\d (\d{3})")
_CHALLENGE = re.compile(rb"^WWW-Authenticate:[ \t]*(.+?)\r?$", re.IGNORECASE | re.MULTILINE)
_PARAM = re.compile(r'(\w+)=(?:"([^"]*)"|([^\s,]+))')


@dataclass(frozen=True)
class Answer:
    """A camera's answer to DESCRIBE: its status, and its first authentication challenge."""

    status: int
    challenge: str | None


def describe(host: str, port: int, url: str, timeout_s: float,
             auth: str | None = None) -> Answer | OSError | None:
    """The camera's answer to an RTSP DESCRIBE of ``url`` (with the ``Authorization`` header
    ``auth``); the OSError when it cannot be reached; None when it answers something else than
    RTSP."""
    header = f"Authorization: {auth}\r\n" if auth else ""
    request = (f"DESCRIBE {url} RTSP/1.0\r\nCSeq: 1\r\nAccept: application/sdp\r\n{header}"
               "User-Agent: visionserve\r\n\r\n").encode()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                head += chunk
    except OSError as exc:
        return exc
    status = _STATUS.match(head)
    if status is None:
        return None
    challenge = _CHALLENGE.search(head.split(b"\r\n\r\n", 1)[0])
    return Answer(int(status.group(1)),
                  challenge.group(1).decode("latin-1").strip() if challenge else None)


def authorization(challenge: str | None, user: str, password: str, url: str) -> str | None:
    """The ``Authorization`` header that answers a camera's Basic or Digest (MD5) challenge to
    DESCRIBE ``url``; None for a challenge of another kind."""
    if challenge is None:
        return None
    scheme, _, rest = challenge.partition(" ")
    if scheme.lower() == "basic":
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    if scheme.lower() != "digest":
        return None
    params = {m.group(1).lower(): m.group(2) if m.group(2) is not None else m.group(3)
              for m in _PARAM.finditer(rest)}
    if params.get("algorithm", "MD5").upper() != "MD5" or "nonce" not in params:
        return None
    realm, nonce = params.get("realm", ""), params["nonce"]

    def md5(text: str) -> str:
        return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()

    ha1, ha2 = md5(f"{user}:{realm}:{password}"), md5(f"DESCRIBE:{url}")
    header = f'Digest username="{user}", realm="{realm}", nonce="{nonce}", uri="{url}"'
    if "auth" in params.get("qop", "").replace(" ", "").split(","):
        cnonce = secrets.token_hex(8)
        response = md5(f"{ha1}:{nonce}:00000001:{cnonce}:auth:{ha2}")
        header += f', qop=auth, nc=00000001, cnonce="{cnonce}"'
    else:
        response = md5(f"{ha1}:{nonce}:{ha2}")
    if "opaque" in params:
        header += f', opaque="{params["opaque"]}"'
    return header + f', response="{response}"'


def _open(name: str, uri: str, settings: Mapping[str, Any]) -> RtspSource:
    return RtspSource(name, uri, settings)


register("rtsp", _open)
