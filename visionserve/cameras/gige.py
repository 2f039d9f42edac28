"""``gige://DEVICE``: GigE Vision and USB3 Vision cameras through Aravis (docs/cameras.md).

``DEVICE`` is what Aravis calls the camera (its device id, ``Vendor-Model-Serial``), its serial
number, or, for GigE Vision, its IP address. Aravis (the open GenICam library) is reached through
its GObject-introspection bindings (Debian: ``gir1.2-aravis-0.8`` with ``python3-gi``).

Opening connects, sets the GenICam features from the camera's settings (``pixel_format``,
``roi``, ``exposure_us``, ``gain_db``, ``frame_rate``, the trigger), negotiates the GigE packet
size, sizes the stream socket's receive buffer to a frame, and starts acquisition into
``buffers`` frame buffers.
A grab then:

* ``software``: executes TriggerSoftware (TriggerMode On, FrameStart) and waits for that frame;
  when none has come by half the grab's timeout the camera is triggered once more (a frame lost
  on the wire must not cost the part its verdict while there is time for another);
* ``hardware``: takes the camera's frames in the order they came (each is a part);
* ``free``: takes the newest frame (older ones are counted as ``skipped``).

A buffer that is not complete (missing packets, frame timeout) is a :class:`CameraFault`
``incomplete``, never a frame. No grab waits past its timeout.

Threads: every call into Aravis for one connection that talks to the camera (connect, features,
trigger, stop, release) runs on that connection's own thread, one call at a time; the camera
thread of the service waits for it at most until the grab's deadline. A camera that vanished
makes Aravis block for seconds per register access (5 tries of 500 ms), so a trigger that does
not return in time marks the connection lost and the grab a ``disconnected`` fault at once; the
release of a lost connection finishes on its own thread while the service opens a new one.
Frames are taken from the stream's queue on the calling thread (the queue is Aravis's thread-safe
one). Opening a camera that is not there answers in a fraction of a second: the camera's last
address is asked first with a GigE Vision discovery packet, and only a silent or different
camera costs Aravis's full discovery (about a second).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import queue
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, TypeVar

from ..errors import ConfigError
from ..extras import install_hint
from .pixels import from_buffer, get_format
from .source import CameraFault, Grabbed, own_settings, register

log = logging.getLogger(__name__)

T = TypeVar("T")

#: What a camera's settings may say besides the common ones (docs/cameras.md).
KNOWN_SETTINGS = ("pixel_format", "roi", "exposure_us", "gain_db", "frame_rate",
                  "trigger_source", "buffers", "packet_size", "packet_delay_ns")
#: GigE Vision's control port, and the discovery command and its acknowledgement.
GVCP_PORT = 3956
_DISCOVERY_CMD, _DISCOVERY_ACK = 0x0002, 0x0003
#: A software trigger is repeated only when at least this much of the grab's time is left.
RETRIGGER_MIN_S = 0.05
#: How long a camera's last known address is given to answer a discovery packet when opening.
PROBE_S = 0.25
#: The least receive buffer a GigE stream's socket asks for (bytes).
SOCKET_BUFFER_MIN = 1 << 20
#: The longest an open may take (a camera that vanishes while it is configured makes Aravis wait
#: 2.5 s per register access); past it the open is a ``disconnected`` fault.
OPEN_TIMEOUT_S = 20.0
#: How long a normal close waits for the camera to be released (stop, give up control).
RELEASE_WAIT_S = 5.0
_INSTALL = ("gige:// cameras need Aravis 0.8 (Debian, Ubuntu: apt-get install gir1.2-aravis-0.8) "
            f"and its Python bindings: {install_hint('cameras')}; docs/cameras.md, \"GigE "
            "Vision and USB3 Vision\"")

_DISCOVERY_LOCK = threading.Lock()  # Aravis's device list is one per process


def aravis() -> tuple[ModuleType, ModuleType]:
    """Aravis 0.8 and GLib through GObject introspection, or a ConfigError that says what to
    install."""
    try:
        import gi

        gi.require_version("Aravis", "0.8")
        from gi.repository import Aravis, GLib
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"{_INSTALL}; here: {exc}") from None
    return Aravis, GLib


def available() -> str | None:
    """None when gige:// cameras can be opened here, else why not (with what to install)."""
    try:
        aravis()
    except ConfigError as exc:
        return exc.message
    return None


@dataclass(frozen=True)
class GigeSettings:
    """A GigE/USB3 camera's own settings, checked when the camera is configured."""

    trigger: str = "software"
    rate_hz: float | None = None
    pixel_format: str | None = None
    roi: tuple[int, int, int, int] | None = None
    exposure_us: float | None = None
    gain_db: float | None = None
    frame_rate: float | None = None
    trigger_source: str = "Line0"
    buffers: int = 4
    packet_size: int | None = None
    packet_delay_ns: int | None = None

    @classmethod
    def of(cls, name: str, settings: Mapping[str, Any]) -> GigeSettings:
        own = own_settings(name, "gige", settings, KNOWN_SETTINGS)
        try:
            roi = own.get("roi")
            out = cls(
                trigger=str(settings.get("trigger") or "software"),
                rate_hz=_opt(float, settings.get("rate_hz")),
                pixel_format=_opt(str, own.get("pixel_format")),
                roi=None if roi is None else _roi(roi),
                exposure_us=_opt(float, own.get("exposure_us")),
                gain_db=_opt(float, own.get("gain_db")),
                frame_rate=_opt(float, own.get("frame_rate")),
                trigger_source=str(own.get("trigger_source", "Line0")),
                buffers=int(own.get("buffers", 4)),
                packet_size=_opt(int, own.get("packet_size")),
                packet_delay_ns=_opt(int, own.get("packet_delay_ns")))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"camera {name}: bad gige setting: {exc}") from None
        if out.trigger not in ("software", "hardware", "free"):
            raise ConfigError(f"camera {name}: trigger {out.trigger!r}; use software, hardware "
                              "or free")
        if out.pixel_format is not None:
            try:
                get_format(out.pixel_format)
            except CameraFault as exc:
                raise ConfigError(f"camera {name}: {exc.message}") from None
        if not 2 <= out.buffers <= 64:
            raise ConfigError(f"camera {name}: buffers is 2..64 frame buffers, not {out.buffers}")
        if out.exposure_us is not None and out.exposure_us <= 0:
            raise ConfigError(f"camera {name}: exposure_us must be above 0")
        if out.frame_rate is not None and out.frame_rate <= 0:
            raise ConfigError(f"camera {name}: frame_rate must be above 0")
        if out.packet_size is not None and not 576 <= out.packet_size <= 16384:
            raise ConfigError(f"camera {name}: packet_size is 576..16384 bytes (9000 with jumbo "
                              "frames)")
        if out.packet_delay_ns is not None and out.packet_delay_ns < 0:
            raise ConfigError(f"camera {name}: packet_delay_ns must be 0 or more")
        return out


def _opt(kind: Callable[[Any], T], value: Any) -> T | None:
    return None if value is None else kind(value)


def _roi(value: Any) -> tuple[int, int, int, int]:
    x, y, w, h = (int(v) for v in value)
    if x < 0 or y < 0 or w <= 0 or h <= 0:
        raise ValueError(f"roi [x, y, width, height] = {list(value)}: offsets 0 or more, sizes "
                         "above 0")
    return x, y, w, h


@dataclass(frozen=True)
class Applied:
    """What the camera took, read back after configuring it (cameras round to their steps)."""

    pixel_format: str
    roi: tuple[int, int, int, int]
    exposure_us: float | None
    gain_db: float | None
    frame_rate: float | None
    trigger: str
    packet_size: int | None
    #: the stream socket's receive buffer, as the kernel reports it (it caps the asked size at
    #: net.core.rmem_max, docs/cameras.md); None where there is no such socket (USB3 Vision)
    socket_buffer: int | None = None


@dataclass(frozen=True)
class Identity:
    """Who answered a GigE Vision discovery packet."""

    address: str
    manufacturer: str
    model: str
    serial: str


def _size_stream_socket(port: int, size: int) -> int | None:
    """Give this process's UDP socket bound to ``port`` (a GigE stream's) a receive buffer of
    ``size`` bytes now, and return what the kernel reports for it; None if no such socket.

    Aravis sizes the socket only when the first packet of a frame arrives, so the first frame
    after an open comes in as a burst into the system's default buffer (net.core.rmem_default,
    208 KiB unless raised), which overflows on a frame larger than that: the frame arrives
    incomplete. Sized before acquisition starts, the first frame is received like every
    other."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed meanwhile, or not a socket after all
            continue
        with sock:
            try:
                if (sock.family != socket.AF_INET or sock.type != socket.SOCK_DGRAM
                        or sock.getsockname()[1] != port):
                    continue
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
                return int(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
            except OSError:
                continue
    return None


def probe(address: str, timeout_s: float = PROBE_S) -> Identity | None:
    """Ask the GigE Vision camera at ``address`` who it is (a unicast DISCOVERY_CMD on its
    control port); None when nothing answers within ``timeout_s``."""
    req_id = random.randint(1, 0xFFFF)
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.sendto(struct.pack(">BBHHH", 0x42, 0x01, _DISCOVERY_CMD, 0, req_id),
                        (address, GVCP_PORT))
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                data = sock.recv(1024)
                if len(data) < 8 + 248:
                    continue
                _status, ack, _length, ack_id = struct.unpack(">HHHH", data[:8])
                if ack == _DISCOVERY_ACK and ack_id == req_id:
                    return _identity(address, data[8:])
        except OSError:  # timeout, unreachable, refused (an ICMP answer on loopback)
            return None
    return None


def _identity(address: str, body: bytes) -> Identity:
    def text(at: int, size: int) -> str:
        return body[at:at + size].split(b"\0", 1)[0].decode("ascii", "replace").strip()

    return Identity(address=address, manufacturer=text(72, 32), model=text(104, 32),
                    serial=text(216, 16))


def _of_this_host(address: str) -> bool:
    """Whether ``address`` is one of this host's own (loopback, or an interface's): a simulator
    or a camera in a container on the vision PC itself."""
    if ipaddress.ip_address(address).is_loopback:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((address, 0))  # only an address of this host can be bound
        except OSError:
            return False
    return True


def _is_address(device: str) -> bool:
    try:
        ipaddress.IPv4Address(device)
    except ValueError:
        return False
    return True


class _Worker:
    """One daemon thread that runs a connection's Aravis calls in order. Daemon: a release that
    Aravis keeps retrying on a vanished camera must not hold the server's exit."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))
        return fut

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(exc)


class _Link:
    """One connection to the camera: the Aravis camera and stream, made and released on the
    connection's own thread."""

    def __init__(self, source_name: str, glib_error: type[Exception]) -> None:
        self.worker = _Worker(f"gige-{source_name}")
        self.glib_error = glib_error  # GLib.Error: what Aravis raises
        self.camera: Any = None  # Aravis.Camera (GObject introspection: no static type)
        self.stream: Any = None  # Aravis.Stream
        self.lost: str | None = None
        self.format = ""
        self.format_code = 0
        self.applied: Applied | None = None
        self.label = ""  # vendor, model, serial: for the log

    def call(self, fn: Callable[[], T], timeout_s: float | None) -> T:
        """``fn()`` on the connection's thread; a CameraFault ``disconnected`` (and the
        connection marked lost) when it does not return within ``timeout_s``."""
        if self.lost is not None:
            raise CameraFault(self.lost, "disconnected")
        fut = self.worker.submit(fn)
        try:
            return fut.result(timeout=timeout_s)
        except FutureTimeout:
            self.lost = (f"the camera did not answer within {timeout_s:.3g} s (disconnected, "
                         "or its network is down)")
            raise CameraFault(self.lost, "disconnected") from None

    def trigger(self) -> None:
        self.camera.software_trigger()

    def release(self, wait_s: float) -> None:
        """Stop acquisition and let the camera go, on the connection's thread; waits up to
        ``wait_s`` (0 for a lost camera, whose release Aravis may retry for seconds)."""
        def job() -> None:
            camera, self.camera, self.stream = self.camera, None, None
            if camera is not None and self.lost is None:
                try:
                    camera.stop_acquisition()
                    if camera.is_gv_device():
                        # said, not left to the object's end: a traceback may still hold it
                        camera.get_device().leave_control()
                except self.glib_error as exc:  # it went away meanwhile: release it anyway
                    log.debug("release: %s", exc)

        fut = self.worker.submit(job)
        self.worker.stop()
        if wait_s > 0:
            try:
                fut.result(timeout=wait_s)
            except FutureTimeout:
                log.warning("camera release still running after %.1f s; it finishes in the "
                            "background", wait_s)


class GigeSource:
    """A GigE Vision or USB3 Vision camera through Aravis (see the module's docstring)."""

    def __init__(self, name: str, uri: str, settings: Mapping[str, Any]) -> None:
        self.name = name
        self.device = uri.split("://", 1)[1].strip("/") if "://" in uri else ""
        if not self.device:
            raise ConfigError(f"camera {name}: gige:// needs a device: gige://SERIAL, "
                              "gige://ADDRESS or gige://VENDOR-MODEL-SERIAL")
        self.settings = GigeSettings.of(name, settings)
        self._aravis, self._glib = aravis()
        self._link: _Link | None = None
        # where the camera was last found, and its serial: a reopen asks there first
        self._known: Identity | None = None
        self._counts = {"frames": 0, "drops": 0, "incomplete": 0, "skipped": 0,
                        "retriggers": 0, "resends": 0, "missing_packets": 0, "underruns": 0}
        self._stream_base = {"resends": 0, "missing_packets": 0, "underruns": 0}

    def describe(self) -> str:
        return f"gige://{self.device}"

    @property
    def applied(self) -> Applied | None:
        """The features as the camera took them at the last open."""
        return self._link.applied if self._link is not None else None

    def stats(self) -> dict[str, int]:
        """``drops`` counts frames the camera sent that were no frame here: incomplete, late
        answers to an earlier trigger, and frames lost for want of a free buffer (underruns)."""
        counts = dict(self._counts)
        counts["drops"] += counts["underruns"]
        return counts

    # --- open / close ---------------------------------------------------------------------

    def open(self) -> None:
        self.close()
        link = _Link(self.name, self._glib.Error)
        try:
            target, address = self._locate(link)
            link.call(lambda: self._connect(link, target, address), OPEN_TIMEOUT_S)
        except CameraFault as exc:
            # a camera that answers is released before the next open (it takes one controller)
            link.release(0 if exc.reason == "disconnected" else RELEASE_WAIT_S)
            raise _bare(exc) from None
        except BaseException:
            link.release(0)
            raise
        self._link = link
        log.info("camera %s: %s open (%s): %s", self.name, self.describe(), link.label,
                 link.applied)

    def close(self) -> None:
        link, self._link = self._link, None
        if link is None:
            return
        self._fold_stream_counts()
        known = self._known
        if link.lost is None and known is not None and probe(known.address) is None:
            # gone without a word (a free-running camera's grabs only time out): Aravis would
            # spend seconds on each goodbye to it
            link.lost = f"camera {self.device} does not answer at {known.address}"
        link.release(0 if link.lost is not None else RELEASE_WAIT_S)

    def _locate(self, link: _Link) -> tuple[str, str | None]:
        """What to give Aravis to open the camera (an address, or its device id), and its
        address when known; CameraFault ``not_found`` when it is not there."""
        if _is_address(self.device):
            if probe(self.device) is None:
                raise CameraFault(f"camera {self.device} not found: nothing answers at that "
                                  "address", "not_found")
            return self.device, self.device
        known = self._known
        if known is not None:
            found = probe(known.address)
            if found is not None and found.serial == known.serial:
                return known.address, known.address
        return link.call(self._discover, OPEN_TIMEOUT_S)

    def _discover(self) -> tuple[str, str | None]:
        Aravis = self._aravis
        with _DISCOVERY_LOCK:
            Aravis.update_device_list()
            for i in range(Aravis.get_n_devices()):
                names = (Aravis.get_device_id(i), Aravis.get_device_serial_nbr(i),
                         Aravis.get_device_address(i), Aravis.get_device_physical_id(i))
                if self.device in names:
                    address = Aravis.get_device_address(i)
                    return Aravis.get_device_id(i), address if _is_address(address) else None
        raise CameraFault(f"camera {self.device} not found: no GigE Vision or USB3 Vision camera "
                          "with that id, serial or address answers (cabling, power, the "
                          "camera's IP subnet; docs/cameras.md)", "not_found")

    def _connect(self, link: _Link, target: str, address: str | None) -> None:
        """On the link's thread: open, configure, start acquiring."""
        Aravis, GLib = self._aravis, self._glib
        try:
            camera = Aravis.Camera.new(target)
        except GLib.Error as exc:
            raise CameraFault(f"camera {self.device} not found: {exc.message}",
                              "not_found") from None
        link.camera = camera
        packet_size = None
        try:
            if camera.is_gv_device():
                if address is not None and _of_this_host(address):
                    # Aravis's packet socket (used with CAP_NET_RAW) listens on the camera's
                    # interface, and misses a camera of this host: its packets come over lo
                    camera.gv_set_stream_options(Aravis.GvStreamOption.PACKET_SOCKET_DISABLED)
                packet_size = self._packet_size(camera)
                if self.settings.packet_delay_ns is not None:
                    camera.gv_set_packet_delay(self.settings.packet_delay_ns)
            applied = link.applied = self._configure(camera, packet_size)
            link.format = camera.get_pixel_format_as_string()
            link.format_code = camera.get_pixel_format()
            get_format(link.format)  # a format the server converts, or a config fault
            stream = camera.create_stream(None, None)
            payload = camera.get_payload()
            if isinstance(stream, Aravis.GvStream):
                # a frame's packets come in a burst: the socket must hold a whole frame, with
                # the kernel's overhead per packet (Aravis's "auto", the payload, loses packets
                # of small frames); the kernel caps it at net.core.rmem_max (docs/cameras.md)
                wanted = max(2 * payload, SOCKET_BUFFER_MIN)
                stream.set_property("socket-buffer", Aravis.GvStreamSocketBuffer.FIXED)
                stream.set_property("socket-buffer-size", wanted)
                link.applied = replace(applied, socket_buffer=_size_stream_socket(
                    stream.get_port(), wanted))
            for _ in range(self.settings.buffers):
                stream.push_buffer(Aravis.Buffer.new_allocate(payload))
            link.stream = stream
            camera.start_acquisition()
        except GLib.Error as exc:
            raise CameraFault(f"camera {self.device}: {exc.message}", _reason(exc)) from None
        found = Identity(address or "", camera.get_vendor_name(), camera.get_model_name(),
                         camera.get_device_serial_number())
        link.label = f"{found.manufacturer} {found.model}, serial {found.serial}, at {target}"
        if address is not None:
            self._known = found

    def _packet_size(self, camera: Any) -> int:
        """The GigE packet size: the setting, or the largest the path takes (Aravis's test
        packets; jumbo frames need MTU 9000 on the NIC, docs/cameras.md)."""
        if self.settings.packet_size is not None:
            camera.gv_set_packet_size(self.settings.packet_size)
        else:
            try:
                camera.gv_auto_packet_size()
            except self._glib.Error as exc:
                log.warning("camera %s: packet size negotiation failed (%s); keeping %d bytes",
                            self.name, exc.message, camera.gv_get_packet_size())
        return int(camera.gv_get_packet_size())

    def _configure(self, camera: Any, packet_size: int | None) -> Applied:
        """Set the features the settings name, in the order cameras need (the format before the
        region, the region before the rates), and read back what the camera took."""
        Aravis, s = self._aravis, self.settings
        camera.stop_acquisition()  # a camera left acquiring refuses format and region changes
        if s.pixel_format is not None:
            offered = camera.dup_available_pixel_formats_as_strings()
            if s.pixel_format not in offered:
                raise CameraFault(f"camera {self.device} does not offer pixel format "
                                  f"{s.pixel_format!r}; it offers {', '.join(offered)}", "config")
            camera.set_pixel_format_from_string(s.pixel_format)
        if s.roi is not None:
            x, y, w, h = s.roi
            wmax, hmax = camera.get_width_bounds().max, camera.get_height_bounds().max
            if x + w > wmax or y + h > hmax:
                raise CameraFault(f"camera {self.device}: roi {list(s.roi)} exceeds the sensor "
                                  f"({wmax}x{hmax})", "config")
            camera.set_region(x, y, w, h)
        if s.exposure_us is not None:
            if camera.is_exposure_auto_available():
                camera.set_exposure_time_auto(Aravis.Auto.OFF)
            camera.set_exposure_time(s.exposure_us)
        if s.gain_db is not None:
            if camera.is_gain_auto_available():
                camera.set_gain_auto(Aravis.Auto.OFF)
            camera.set_gain(s.gain_db)
        rate = s.frame_rate if s.frame_rate is not None else (
            s.rate_hz if s.trigger == "free" else None)
        if rate is not None:
            if not camera.is_frame_rate_available():
                raise CameraFault(f"camera {self.device} has no settable frame rate "
                                  "(AcquisitionFrameRate)", "config")
            # before the trigger: Aravis switches FrameStart triggering off to set a rate
            camera.set_frame_rate(rate)
        if s.trigger == "software":
            if not camera.is_software_trigger_supported():
                raise CameraFault(f"camera {self.device} has no software trigger; use trigger = "
                                  "\"hardware\" or \"free\"", "config")
            camera.set_trigger("Software")
        elif s.trigger == "hardware":
            sources = camera.dup_available_trigger_sources()
            if s.trigger_source not in sources:
                raise CameraFault(f"camera {self.device} has no trigger source "
                                  f"{s.trigger_source!r}; it has {', '.join(sources)}", "config")
            camera.set_trigger(s.trigger_source)
        else:
            camera.clear_triggers()
        camera.set_acquisition_mode(Aravis.AcquisitionMode.CONTINUOUS)
        region = camera.get_region()
        return Applied(
            pixel_format=camera.get_pixel_format_as_string(),
            roi=(region.x, region.y, region.width, region.height),
            exposure_us=camera.get_exposure_time() if camera.is_exposure_time_available() else None,
            gain_db=camera.get_gain() if camera.is_gain_available() else None,
            frame_rate=camera.get_frame_rate() if camera.is_frame_rate_available() else None,
            trigger=s.trigger, packet_size=packet_size)

    # --- grab -----------------------------------------------------------------------------

    def grab(self, timeout_s: float) -> Grabbed:
        try:
            return self._grab(timeout_s)
        except CameraFault as exc:
            raise _bare(exc) from None

    def _grab(self, timeout_s: float) -> Grabbed:
        link = self._link
        if link is None:
            raise CameraFault(f"camera {self.name} is not open", "disconnected")
        if link.lost is not None:
            raise CameraFault(link.lost, "disconnected")
        deadline = time.monotonic() + max(0.0, timeout_s)
        if self.settings.trigger == "software":
            buffer = self._triggered(link, deadline)
        elif self.settings.trigger == "free":
            buffer = self._newest(link, deadline)
        else:
            buffer = self._pop(link, deadline)
        if buffer is None:
            self._update_stream_counts(link)
            raise CameraFault(f"camera {self.name}: no frame within {timeout_s:.3g} s", "timeout")
        try:
            return self._frame(link, buffer)
        finally:
            link.stream.push_buffer(buffer)
            self._update_stream_counts(link)

    def _triggered(self, link: _Link, deadline: float) -> Any:
        """Trigger and wait for that frame; trigger once more at half time if none came."""
        self._recycle_waiting(link)
        start = time.monotonic()
        retry_at = start + (deadline - start) / 2
        for attempt in range(2):
            link.call(link.trigger, max(0.0, deadline - time.monotonic()))
            buffer = self._pop(link, retry_at if attempt == 0 else deadline)
            if buffer is not None:
                return buffer
            if deadline - time.monotonic() < RETRIGGER_MIN_S:
                break
            if attempt == 0:
                self._counts["retriggers"] += 1
                log.info("camera %s: no frame %.0f ms after a software trigger; triggering again",
                         self.name, 1000 * (time.monotonic() - start))
        return None

    def _recycle_waiting(self, link: _Link) -> None:
        """Hand back frames already queued (late answers to an earlier trigger): counted, so
        every frame the camera sent is accounted for."""
        while (buffer := link.stream.try_pop_buffer()) is not None:
            self._counts["drops"] += 1
            link.stream.push_buffer(buffer)

    def _newest(self, link: _Link, deadline: float) -> Any:
        buffer = link.stream.try_pop_buffer()
        if buffer is None:
            return self._pop(link, deadline)
        while (newer := link.stream.try_pop_buffer()) is not None:
            self._counts["skipped"] += 1
            link.stream.push_buffer(buffer)
            buffer = newer
        return buffer

    @staticmethod
    def _pop(link: _Link, until: float) -> Any:
        left_us = int(1e6 * (until - time.monotonic()))
        return link.stream.timeout_pop_buffer(max(0, left_us)) if left_us > 0 else (
            link.stream.try_pop_buffer())

    def _frame(self, link: _Link, buffer: Any) -> Grabbed:
        Aravis = self._aravis
        status = buffer.get_status()
        if status != Aravis.BufferStatus.SUCCESS:
            self._counts["drops"] += 1
            self._counts["incomplete"] += 1
            raise CameraFault(f"camera {self.name}: incomplete frame (lost packets): "
                              f"{status.value_nick}", "incomplete")
        if buffer.get_payload_type() != Aravis.BufferPayloadType.IMAGE:
            self._counts["drops"] += 1
            raise CameraFault(f"camera {self.name}: the camera sent a non-image payload "
                              f"({buffer.get_payload_type().value_nick})", "error")
        if buffer.get_image_pixel_format() != link.format_code:
            self._counts["drops"] += 1
            raise CameraFault(f"camera {self.name}: a frame in pixel format "
                              f"0x{buffer.get_image_pixel_format():08x}, not the {link.format} "
                              "it was set to", "error")
        try:
            # get_data copies the buffer's bytes: the array outlives the buffer's reuse
            pixels = from_buffer(buffer.get_data(), link.format, buffer.get_image_width(),
                                 buffer.get_image_height())
        except CameraFault:
            self._counts["drops"] += 1
            raise
        self._counts["frames"] += 1
        stamp = buffer.get_timestamp()
        return Grabbed(pixels=pixels, pixel_format=link.format,
                       camera_time=stamp / 1e9 if stamp else None,
                       frame_id=int(buffer.get_frame_id()))

    def _update_stream_counts(self, link: _Link) -> None:
        stream = link.stream
        if stream is None:
            return
        now = {"underruns": stream.get_info_uint64_by_name("n_underruns")}
        if isinstance(stream, self._aravis.GvStream):  # packets are GigE Vision's
            now["resends"] = stream.get_info_uint64_by_name("n_resent_packets")
            now["missing_packets"] = stream.get_info_uint64_by_name("n_missing_packets")
        for key, value in now.items():
            self._counts[key] = self._stream_base[key] + int(value)

    def _fold_stream_counts(self) -> None:
        """A new stream counts from 0: keep what the closed one counted."""
        self._stream_base = {k: self._counts[k] for k in self._stream_base}


def _bare(exc: CameraFault) -> CameraFault:
    """``exc`` without its traceback and context: their frames hold Aravis objects, and the end
    of one whose camera vanished (Aravis says goodbye to it, seconds of retries) would come in
    whichever thread drops the fault last, the event loop's included. Their end belongs on the
    connection's thread (:meth:`_Link.release`)."""
    exc.__context__ = exc.__cause__ = None
    return exc.with_traceback(None)


def _reason(exc: Any) -> str:
    """A CameraFault reason for an Aravis error: a timeout is a camera that stopped answering."""
    return "disconnected" if "timeout" in str(exc.message).lower() else "config"


def _open(name: str, uri: str, settings: Mapping[str, Any]) -> GigeSource:
    return GigeSource(name, uri, settings)


register("gige", _open)
