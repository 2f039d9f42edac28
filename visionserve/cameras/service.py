"""The cameras of the serving process: each in its own thread, triggered into inspections.

Each camera (``[camera.NAME]`` of the recipes file, ``--camera NAME=URI``) has one thread that
owns its :class:`~visionserve.cameras.source.Source`: it opens it, grabs from it, and reopens a
camera that went down, waiting 0.5 s, then twice as long each time, up to 5 s. Nothing else
touches a source.

:meth:`CameraService.trigger` is the one way a trigger becomes a verdict, whoever triggers: the
HTTP route (``POST /v1/cameras/{name}/trigger``, ``/v1/stations/{s}/trigger``) awaits it; the PLC
(:meth:`CameraService.take`) is answered as soon as the grabs started, and hears the verdict by
its result path. It grabs from each camera of the trigger at once, turns each grab into a raw frame
(:func:`to_frame`) and submits it through the data plane as an inspect request does (no JPEG
round trip), with the part id, the camera's name and the camera's timestamp of the frame as its
origin (:class:`~visionserve.dataplane.Origin`): the part's record, the live feed and the PLC
result path get them. A camera that gives no frame is a fault: its answer says why, the PLC hears
"no decision", and it is counted; never an OK without a frame. A part seen by several cameras is
NG when any camera's verdict is, and no decision when any camera gave none; the PLC gets that
one result for the part (:class:`~visionserve.dataplane.PartResult`, on the PLC station named
like the station), not one per camera, while each camera's frame goes to the records and the
live feed as its own.

A PLC station (``--plc-stations``) triggers camera S when S is a camera of the server, else each
camera of station S of the recipes file; a trigger without a part id names the part ``S-<n>``
(n counting from 1 per PLC station since start).

Free-running cameras (``trigger = "free"``, ``rate_hz``) and hardware-triggered ones (the frame's
arrival is the trigger) are grabbed by their thread without a call, each frame inspected with a
generated part id (``NAME-<n>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
import queue
import re
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .. import imaging
from ..config import ServerSettings
from ..dataplane import (
    MAX_PART_ID,
    Cameras,
    DataPlane,
    Origin,
    PartResult,
    PartResults,
    Route,
    inspect_answer,
)
from ..errors import (
    ConfigError,
    Conflict,
    DeadlineExceeded,
    InvalidInput,
    NotFound,
    Unavailable,
    VisionServeError,
    http_status,
)
from ..recipes import CameraSpec
from . import metrics, pixels
from .source import ENCODED, CameraFault, Grabbed, Source, open_source

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

log = logging.getLogger(__name__)

#: reconnecting a camera that is down: the first wait, and the longest
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 5.0
#: triggered grabs that time out one after another before the camera is taken for gone and
#: reopened
TIMEOUTS_BEFORE_REOPEN = 3
#: frames of a free-running camera inspected at once; the thread waits for room before grabbing
FREE_INFLIGHT = 4


class Plane(DataPlane, Protocol):
    """The data plane as the cameras use it: the engine, in the serving process."""

    #: the cameras while they run, for the engine's ``trigger`` and ``camera_states``
    camera_service: Cameras | None
    #: where a station trigger's one result per part goes (the PLC result bus), when anywhere
    part_results: PartResults | None

    def refuse(self, name: str, version: str | int | None, n: int, origin: tuple | None,
               exc: VisionServeError) -> None: ...


# --- frames -------------------------------------------------------------------------------------

def to_frame(grabbed: Grabbed, max_pixels: int = imaging.DEFAULT_MAX_PIXELS,
             max_value: int | None = None) -> imaging.Frame:
    """The frame the engine inspects from what the camera sent: a file's bytes as they are
    (decoded in the executor, like an inspect request's), pixels as a raw frame (RGB, grey for
    a mono format, a Bayer format's 8-bit mosaic with its pattern, demosaiced where the frame is
    prepared for the model; :func:`.pixels.to_frame`, deeper formats scaled by ``max_value``,
    the model's ``[input] raw_max_value``, else their format's maximum). Runs in the camera's
    thread.
    CameraFault for a pixel format that is not supported or pixels that are not its frame."""
    if grabbed.pixel_format == ENCODED:
        if grabbed.encoded is None:
            raise CameraFault("the source gave an encoded frame without its bytes", "error")
        try:
            return imaging.encoded_frame(grabbed.encoded, max_pixels=max_pixels)
        except VisionServeError as exc:
            raise CameraFault(f"the camera's frame is unusable: {exc.message}",
                              "incomplete") from None
    if grabbed.pixels is None:
        raise CameraFault(f"the source gave a {grabbed.pixel_format} frame without pixels",
                          "error")
    try:
        return pixels.to_frame(grabbed.pixels, grabbed.pixel_format, max_value=max_value,
                               max_pixels=max_pixels)
    except VisionServeError as exc:
        raise CameraFault(f"the camera's frame is unusable: {exc.message}", "incomplete") from None


# --- credentials --------------------------------------------------------------------------------

def _env_name(camera: str) -> str:
    return "VISIONSERVE_CAMERA_" + re.sub(r"[^A-Za-z0-9]", "_", camera).upper()


def credentials(settings: ServerSettings, names: list[str],
                environ: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """camera -> {"user", "password"} from ``--camera-credentials`` (a TOML file of
    ``[NAME] user = ..., password = ...``, readable by its owner only), else the environment
    (``VISIONSERVE_CAMERA_<NAME>_USER`` / ``_PASSWORD``; NAME upper case, other characters as
    ``_``). ConfigError for a file that others may read, or that cannot be read."""
    environ = os.environ if environ is None else environ
    out: dict[str, dict[str, str]] = {}
    path: Path | None = settings.camera_credentials
    if path is not None:
        try:
            mode = path.stat().st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise ConfigError(f"camera credentials {path}: others may read it (mode "
                                  f"{stat.S_IMODE(mode):04o}); chmod 600 it")
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"camera credentials {path}: cannot be read: {exc}") from None
        for name, entry in data.items():
            if not isinstance(entry, dict) or set(entry) - {"user", "password"}:
                raise ConfigError(f"camera credentials {path}: [{name}] holds user and password "
                                  "only")
            out[name] = {k: str(v) for k, v in entry.items()}
    for name in names:
        prefix = _env_name(name)
        found = {k: environ[f"{prefix}_{k.upper()}"] for k in ("user", "password")
                 if f"{prefix}_{k.upper()}" in environ}
        if found and name not in out:
            out[name] = found
    return out


# --- one camera ---------------------------------------------------------------------------------

@dataclass
class Shot:
    """A frame of a camera, ready to inspect: when it was asked for and when it came."""

    frame: imaging.Frame
    grabbed: Grabbed
    asked: float
    got: float


class Camera:
    """One camera and its thread (see the module's docstring)."""

    def __init__(self, name: str, spec: CameraSpec, source: Source, max_pixels: int) -> None:
        self.name = name
        self.spec = spec
        self.source = source
        self.max_pixels = max_pixels
        self.state = "starting"
        self.last_error = ""
        self.faults: Counter[str] = Counter()
        self.frames = 0
        self.inflight = 0  # free-running frames being inspected
        # the counters above are changed by the camera's thread and the event loop
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future,
                                                float] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        # set by a trigger for the camera while it is down (and by stop): reconnect now
        self._poke = threading.Event()
        self._backoff = BACKOFF_FIRST_S
        self._thread: threading.Thread | None = None
        self._up = metrics.UP.labels(name)
        self._up.set(0)
        #: frames that come by themselves (free-running, hardware trigger): each Shot goes here,
        #: from the camera's thread; grabbing waits while ``may_grab`` says no (not serving yet)
        self.on_frame: Callable[[Shot], None] | None = None
        self.may_grab: Callable[[], bool] = lambda: True
        #: the ``[input] raw_max_value`` of the model its frames go to now (None: the format's)
        self.max_value: Callable[[], int | None] = lambda: None

    @property
    def triggered(self) -> bool:
        """Triggered by a call (software): else its frames come by themselves."""
        return self.spec.trigger == "software"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"camera-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        self._requests.put(None)
        if self._thread is not None:
            self._thread.join(timeout=self.spec.timeout_s + BACKOFF_MAX_S)

    def grab(self) -> asyncio.Future:
        """A future of the next frame (a :class:`Shot`), or of the CameraFault why there is none:
        at once when the camera is down."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if self.state != "up":
            self._poke.set()  # the line wants it: the next reconnect comes sooner
            fut.set_exception(CameraFault(
                f"camera {self.name} is down: {self.last_error or 'not connected yet'}",
                "disconnected"))
            return fut
        self._requests.put((loop, fut, time.monotonic()))
        return fut

    def add_inflight(self, n: int) -> None:
        with self._lock:
            self.inflight += n

    def view(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source.describe(), "trigger": self.spec.trigger,
                "state": self.state, "last_error": self.last_error, "frames": self.frames,
                "faults": dict(self.faults.copy()), "source_stats": self.source.stats()}

    def fault(self, exc: CameraFault) -> None:
        """Count a fault (from the camera's thread or the event loop)."""
        with self._lock:
            self.faults[exc.reason] += 1
        metrics.FAULTS.labels(self.name, exc.reason).inc()
        self.last_error = exc.message

    # --- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        self._backoff = BACKOFF_FIRST_S
        while not self._stop.is_set():
            try:
                self.source.open()
            except CameraFault as exc:
                self._down(exc)
                self._pause()
                continue
            except Exception as exc:  # a source's bug must not end the thread
                log.exception("camera %s: open failed", self.name)
                self._down(CameraFault(f"open failed: {exc}", "error"))
                self._pause()
                continue
            if self.state != "up":
                log.info("camera %s: up (%s)", self.name, self.source.describe())
            self.state, self.last_error = "up", ""
            self._up.set(1)
            try:
                self._serve()
            finally:
                with contextlib.suppress(Exception):
                    self.source.close()
            if self.state == "down":  # gone while grabbing: reopened after the backoff too
                self._pause()
        self._fail_waiting(CameraFault(f"camera {self.name} stopped", "disconnected"))
        self._up.set(0)

    def _pause(self) -> None:
        """Wait before the next open: the backoff (0.5 s, doubled each time, at most 5 s; back to
        0.5 s after a frame), cut short by a trigger that wants the camera, but at least 0.5 s
        after the last try."""
        began = time.monotonic()
        self._poke.wait(self._backoff)
        self._poke.clear()
        rest = BACKOFF_FIRST_S - (time.monotonic() - began)
        if rest > 0:
            self._stop.wait(rest)
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    def _down(self, exc: CameraFault) -> None:
        if self.state != "down" or exc.message != self.last_error:
            log.warning("camera %s: down: %s; reconnecting", self.name, exc.message)
        self.state = "down"
        self._up.set(0)
        self.fault(exc)
        self._fail_waiting(exc)

    def _fail_waiting(self, exc: CameraFault) -> None:
        while True:
            try:
                item = self._requests.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                _settle(item[0], item[1], exc)

    def _serve(self) -> None:
        """Grab while the camera is up; returns when it is gone (to be reopened) or stopping."""
        timeouts = 0
        period = 1.0 / self.spec.rate_hz if self.spec.rate_hz else 0.0
        next_at = time.monotonic()
        while not self._stop.is_set():
            request = None
            if self.triggered:
                try:
                    request = self._requests.get(timeout=0.1)
                except queue.Empty:
                    continue
                if request is None:
                    return
                asked = request[2]
            else:
                if self.inflight >= FREE_INFLIGHT or not self.may_grab():
                    self._stop.wait(0.001 if self.inflight else 0.05)
                    continue
                if period:
                    now = time.monotonic()
                    if now < next_at:
                        self._stop.wait(next_at - now)
                        continue
                    next_at = max(next_at + period, now)
                asked = time.monotonic()
            try:
                grabbed = self.source.grab(self.spec.timeout_s)
                shot = Shot(to_frame(grabbed, self.max_pixels, self.max_value()), grabbed,
                            asked, time.monotonic())
            except CameraFault as exc:
                # a camera that triggers itself may well send nothing for a while (no part, no
                # file); one asked for a frame that times out again and again is taken for gone
                timeouts = timeouts + 1 if exc.reason == "timeout" and request is not None else 0
                gone = exc.reason in ("disconnected", "not_found") \
                    or timeouts >= TIMEOUTS_BEFORE_REOPEN
                if request is not None:
                    _settle(request[0], request[1], exc)
                elif exc.reason != "timeout":  # free-running: no new frame is no fault
                    self.fault(exc)
                if gone:
                    self._down(exc)
                    return
                continue
            except Exception as exc:  # a source's bug: a fault, then reopened
                log.exception("camera %s: grab failed", self.name)
                fault = CameraFault(f"grab failed: {exc}", "error")
                if request is not None:
                    _settle(request[0], request[1], fault)
                self._down(fault)
                return
            timeouts, self._backoff = 0, BACKOFF_FIRST_S
            if request is not None:
                _settle(request[0], request[1], shot)
            elif self.on_frame is not None:
                self.on_frame(shot)


def _settle(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any) -> None:
    """Resolve ``fut`` on its loop from the camera's thread (a Shot, or a CameraFault)."""
    def settle() -> None:
        if fut.done():
            return
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)

    with contextlib.suppress(RuntimeError):  # the loop closed (shutdown): nobody waits
        loop.call_soon_threadsafe(settle)


#: one camera's answer to a trigger: HTTP status, its JSON, the task's (label, index, score)
Inspected = tuple[int, dict, tuple[str, int, float] | None]


# --- the service --------------------------------------------------------------------------------

class CameraService:
    """Every camera of the serving process, and the triggers (see the module's docstring)."""

    def __init__(self, plane: Plane, cameras: dict[str, Camera]) -> None:
        self.plane = plane
        self.cameras = cameras
        self._loop: asyncio.AbstractEventLoop | None = None
        self._free_ids = itertools.count(1)
        #: PLC station -> the numbers of the parts its triggers without a part id name
        self._plc_parts: dict[str, itertools.count] = {}
        self._tasks: set[asyncio.Task] = set()

    @classmethod
    def build(cls, plane: Plane, settings: ServerSettings) -> CameraService:
        """The cameras of the recipes file and ``--camera`` (in ``plane.recipes.sources``), built
        but not opened; ConfigError for a bad source, setting or model."""
        specs = dict(plane.recipes.sources)
        secrets = credentials(settings, sorted(specs))
        cameras = {}
        for name, spec in sorted(specs.items()):
            if spec.model is not None and spec.model not in plane.entries:
                raise ConfigError(f"camera {name}: model {spec.model!r} is not in the repository "
                                  f"(models: {sorted(plane.entries)})")
            source = open_source(name, spec.source,
                                 {**spec.source_settings(), **secrets.get(name, {})})
            cameras[name] = Camera(name, spec, source, settings.max_image_pixels)
        return cls(plane, cameras)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        metrics.SOURCE_COUNTERS.read = self._source_stats
        for camera in self.cameras.values():
            camera.max_value = functools.partial(self._raw_max_value, camera)
            if not camera.triggered:
                camera.on_frame = functools.partial(self._free_frame, camera)
                camera.may_grab = lambda: self.plane.ready
            camera.start()
            log.info("camera %s: %s, trigger %s", camera.name, camera.source.describe(),
                     camera.spec.trigger)

    async def stop(self) -> None:
        metrics.SOURCE_COUNTERS.read = None
        await asyncio.gather(*(asyncio.to_thread(c.stop) for c in self.cameras.values()))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def states(self) -> list[dict]:
        return [c.view() for c in self.cameras.values()]

    def _source_stats(self) -> dict[str, dict[str, int]]:
        return {c.name: c.source.stats() for c in self.cameras.values()}

    # --- triggers -----------------------------------------------------------------------------

    async def trigger(self, target: str, part_id: str | None, station: bool
                      ) -> tuple[int, dict]:
        """Grab from camera ``target`` (``station``: from each camera of station ``target``) and
        inspect: (HTTP status, answer). The answer is the inspect JSON of the part, with
        ``cameras``: each camera's own answer by name. 200 with a verdict (OK, NG); 503 when a
        camera gave no frame (verdict ERROR, ``fault`` says why), or the answer's own error
        status (504 LATE, ...). A station's part runs to its end (its one PLC result) even when
        the caller stops waiting."""
        cameras, routes = self._check(target, station)
        answer = self._answer(target if station else None, part_id, cameras, routes)
        if not station:
            return await answer
        return await asyncio.shield(self._spawn(answer))

    def take(self, plc_station: str, part_id: str | None) -> dict:
        """A PLC's trigger of its station ``plc_station``: the grabs started (camera
        ``plc_station``, else each camera of station ``plc_station``), the inspection running;
        returns ``{"station", "part_id", "cameras"}`` at once. The verdict reaches the PLC by its
        result path. NotFound when no camera is the station's, Conflict for a camera that is not
        triggered by a call or a station without a recipe, InvalidInput for a bad part id."""
        if part_id is not None and not 0 < len(part_id) <= MAX_PART_ID:
            raise InvalidInput(f"a part id of {len(part_id)} characters; 1 to {MAX_PART_ID}")
        if plc_station == "*":
            raise NotFound("no camera for PLC station * (every other camera): trigger a camera "
                           "or a station by its own PLC station")
        if plc_station in self.cameras:
            station = False
        elif plc_station in self.plane.recipes.stations:
            station = True
        else:
            raise NotFound(f"no camera for PLC station {plc_station!r}: it names no camera of "
                           "the server ([camera.NAME], --camera) and no station of the recipes "
                           "file")
        cameras, routes = self._check(plc_station, station)
        if part_id is None:
            numbers = self._plc_parts.setdefault(plc_station, itertools.count(1))
            part_id = f"{plc_station}-{next(numbers)}"
        self._spawn(self._answer(plc_station if station else None, part_id, cameras, routes))
        return {"station": plc_station, "part_id": part_id, "cameras": [c.name for c in cameras]}

    def _check(self, target: str, station: bool) -> tuple[list[Camera], list[Route]]:
        """The cameras of a trigger and where their frames go; raises what refuses it."""
        cameras = self._of_station(target) if station else [self._camera(target)]
        for camera in cameras:
            if not camera.triggered:
                raise Conflict(f"camera {camera.name} has trigger {camera.spec.trigger!r}: its "
                               "frames are inspected as they come, not on a trigger call")
        return cameras, [self._route(c) for c in cameras]  # a station without a recipe: 409

    def _answer(self, station: str | None, part_id: str | None, cameras: list[Camera],
                routes: list[Route]) -> Coroutine[Any, Any, tuple[int, dict]]:
        """The grabs asked for now, in the order of the triggers; the coroutine that inspects
        them and answers for the part (a station's part: its one PLC result too)."""
        asked = time.monotonic()
        grabs = [c.grab() for c in cameras]

        async def answer() -> tuple[int, dict]:
            answers = await asyncio.gather(*(
                self._inspect(c, r, part_id, g, part_frame=station is not None)
                for c, r, g in zip(cameras, routes, grabs)))
            status, body = _part(station, part_id, routes, cameras,
                                 [(s, a) for s, a, _ in answers], asked)
            sink = self.plane.part_results
            if station is not None and sink is not None:
                sink.publish_part(_part_result(station, part_id, cameras, routes[0], answers,
                                               status, body, asked))
            return status, body

        return answer()

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run ``work`` as a task of the service: kept until done, cancelled on stop."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _raw_max_value(self, camera: Camera) -> int | None:
        """(the camera's thread) the raw_max_value of the model the camera's frames go to now;
        None where none is set or the frames go nowhere yet (the trigger says why)."""
        try:
            entry = self.plane.entries.get(self._route(camera).model)
        except VisionServeError:
            return None
        return entry.config.input.raw_max_value if entry is not None else None

    def _camera(self, name: str) -> Camera:
        camera = self.cameras.get(name)
        if camera is None:
            raise NotFound(f"unknown camera {name!r}; cameras: {sorted(self.cameras)}")
        return camera

    def _of_station(self, station: str) -> list[Camera]:
        book = self.plane.recipes
        if station not in book.stations:
            raise NotFound(f"unknown station {station!r}; stations: {sorted(book.stations)}")
        cameras = [self.cameras[c] for c, s in sorted(book.cameras.items())
                   if s == station and c in self.cameras]
        if not cameras:
            raise NotFound(f"station {station!r} has no camera the server acquires from (its "
                           "cameras = [...] name none of [camera.NAME] / --camera)")
        return cameras

    def _route(self, camera: Camera) -> Route:
        """Where the camera's frames go: its station's recipe, else its own model, else the one
        model served."""
        spec = camera.spec
        station = self.plane.recipes.cameras.get(camera.name)
        if station is not None:  # 409 while the station runs no recipe, as its inspect URL
            return self.plane.route(None, None, station, None)
        if spec.model is not None:
            return Route(spec.model, "" if spec.version is None else str(spec.version))
        if len(self.plane.entries) == 1:
            return Route(next(iter(self.plane.entries)), "")
        raise Conflict(f"camera {camera.name} belongs to no station and names no model, and the "
                       f"server serves {len(self.plane.entries)} models: give [camera."
                       f"{camera.name}] model = \"...\", or list it in a station's cameras")

    async def _inspect(self, camera: Camera, route: Route, part_id: str | None,
                       grab: asyncio.Future, part_frame: bool = False) -> Inspected:
        """One camera's answer to a trigger: (HTTP status, its inspect JSON or its fault, the
        task's (label, index, score) of a verdict). ``part_frame``: the frame is one of a
        station's part, whose one PLC result the part's answer gives."""
        origin = Origin(part_id, camera.name, route.station, route.recipe, part_frame=part_frame)
        base = {"part_id": part_id, "camera_id": camera.name, "model": route.model,
                **({} if route.station is None
                   else {"station": route.station, "recipe": route.recipe})}
        try:
            shot: Shot = await grab
        except CameraFault as exc:
            camera.fault(exc)
            fault = Unavailable(f"camera {camera.name}: {exc.message}")
            with contextlib.suppress(VisionServeError):  # PLC, records, live feed: no decision
                self.plane.refuse(route.model, route.version or None, 1, origin, fault)
            return 503, {**base, "verdict": "ERROR", "fault": exc.reason,
                         "error": fault.message}, None
        metrics.TRIGGER_TO_FRAME.labels(camera.name).observe(shot.got - shot.asked)
        camera.frames += 1
        metrics.FRAMES.labels(camera.name).inc()
        camera_fields = {k: v for k, v in (("frame_id", shot.grabbed.frame_id),
                                           ("camera_time", shot.grabbed.camera_time))
                         if v is not None}
        origin = origin._replace(camera_time=shot.grabbed.camera_time,  # into the record
                                 camera_frame=shot.grabbed.frame_id)
        try:
            served, (r,) = await self.plane.infer(route.model, route.version or None,
                                                  [shot.frame], arrival=shot.got, origin=origin)
        except DeadlineExceeded as exc:
            late = None if exc.late_ms is None else round(exc.late_ms, 3)
            return 504, {**base, **camera_fields, "verdict": "LATE", "error": exc.message,
                         "deadline_met": False, "late_ms": late}, None
        except VisionServeError as exc:
            if not exc.counted:
                self.plane.count_error(route.model, exc)
            return http_status(exc), {**base, **camera_fields, "verdict": "ERROR",
                                      "error": exc.message}, None
        metrics.FRAME_TO_VERDICT.labels(camera.name).observe(time.monotonic() - shot.got)
        answer = inspect_answer(served, r, shot.frame, shot.got, part_id=part_id,
                                camera_id=camera.name, station=route.station, recipe=route.recipe)
        answer.update(camera_fields)
        answer["timing"]["grab_ms"] = round((shot.got - shot.asked) * 1000, 3)
        assert served.task is not None  # every served version has its task
        return 200, answer, served.task.summary(r.result)

    # --- free-running and hardware-triggered cameras -------------------------------------------

    def _free_frame(self, camera: Camera, shot: Shot) -> None:
        """A frame that came by itself (camera thread): inspected on the loop."""
        loop = self._loop
        if loop is None:
            return
        camera.add_inflight(1)
        try:
            loop.call_soon_threadsafe(self._inspect_free, camera, shot)
        except RuntimeError:  # the loop closed: shutting down
            camera.add_inflight(-1)

    def _inspect_free(self, camera: Camera, shot: Shot) -> None:
        frame_id = shot.grabbed.frame_id
        part_id = f"{camera.name}-{next(self._free_ids) if frame_id is None else frame_id}"

        async def run() -> None:
            try:
                route = self._route(camera)
                done: asyncio.Future = asyncio.get_running_loop().create_future()
                done.set_result(shot)
                status, answer, _ = await self._inspect(camera, route, part_id, done)
                if status != 200:
                    log.debug("camera %s: part %s: %s", camera.name, part_id, answer.get("error"))
            except VisionServeError as exc:  # no route (a station without a recipe)
                camera.fault(CameraFault(exc.message, "config"))
            finally:
                camera.add_inflight(-1)

        self._spawn(run())


def _part_result(station: str, part_id: str | None, cameras: list[Camera], route: Route,
                 answers: list[Inspected], status: int, body: dict, asked: float) -> PartResult:
    """The part's one PLC result from its cameras' answers (:func:`_part`'s ``body``): the
    label and score of the first NG camera, else of the first; no label without a verdict."""
    verdict = body["verdict"]
    decided = [(a, s) for _, a, s in answers if s is not None]
    pick = next((d for d in decided if d[0]["verdict"] == "NG"), decided[0] if decided else None)
    label, index, score = pick[1] if pick is not None and verdict in ("OK", "NG") \
        else ("", -1, math.nan)
    timings = [a.get("timing", {}) for _, a, _ in answers]
    version = next((a["version"] for _, a, _ in answers if a.get("version")), "")
    return PartResult(
        station, part_id, tuple(c.name for c in cameras), route.model, str(version), verdict,
        status, label, index, score, max(t.get("queue_ms", 0.0) for t in timings),
        max(t.get("compute_ms", 0.0) for t in timings), asked,
        "" if verdict in ("OK", "NG") else str(body.get("error", "")))


def _part(station: str | None, part_id: str | None, routes: list[Route], cameras: list[Camera],
          answers: list[tuple[int, dict]], asked: float) -> tuple[int, dict]:
    """The part's answer from its cameras' (see :meth:`CameraService.trigger`)."""
    verdicts = [a["verdict"] for _, a in answers]
    undecided = [(s, a) for s, a in answers if a["verdict"] not in ("OK", "NG")]
    if undecided:
        verdict = "ERROR" if any(a["verdict"] == "ERROR" for _, a in undecided) else "LATE"
        status = next(s for s, a in undecided if a["verdict"] == verdict)
    else:
        verdict, status = ("NG" if "NG" in verdicts else "OK"), 200
    by_camera = {c.name: a for c, (_, a) in zip(cameras, answers)}
    total_ms = round((time.monotonic() - asked) * 1000, 3)
    if station is None:  # one camera: its own answer, and the same under cameras
        (_, answer), = answers
        body = {**answer, "cameras": by_camera}
    else:
        route = routes[0]
        body = {"part_id": part_id, "station": station, "recipe": route.recipe,
                "model": route.model, "verdict": verdict, "cameras": by_camera}
    body["verdict"] = verdict
    body.setdefault("timing", {})
    body["timing"] = {**body["timing"], "trigger_ms": total_ms}
    if verdict not in ("OK", "NG"):
        body.setdefault("error", "; ".join(a["error"] for _, a in undecided if "error" in a))
    return status, body


@contextlib.asynccontextmanager
async def cameras_running(engine: Plane, settings: ServerSettings) -> AsyncIterator[int]:
    """Run the cameras of ``engine`` while the server serves (its ``camera_service``); yields an
    exit code: 2 for a bad camera setting (logged), else 0."""
    if not engine.recipes.sources:
        yield 0
        return
    try:
        service = CameraService.build(engine, settings)
    except VisionServeError as exc:
        log.error("%s", exc.message)
        yield 2
        return
    service.start()
    engine.camera_service = service
    try:
        yield 0
    finally:
        engine.camera_service = None
        await service.stop()
