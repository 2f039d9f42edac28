"""The data plane's interface: what every front end (HTTP, gRPC, the inspect route) calls.

Two objects implement :class:`DataPlane`: the engine (:class:`visionserve.engine.Engine`, in the
serving process: batchers, runners, the model instances) and its proxy in a front-end process
(:class:`visionserve.frontends.remote.RemoteEngine`, which forwards to the engine over a socket
pair and shared memory). A front end gets one of them and cannot tell which: it translates its
wire format into these calls and the answers back, and knows nothing else of the server.

A served model version is seen through :class:`ServedModel`, whichever side holds it: the
engine's ``Served`` (with its batcher and runners) and :class:`ModelView`, the form a front-end
process is sent. Its ``task`` renders answers (:mod:`visionserve.tasks`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .errors import Conflict, NotFound, Unavailable, VisionServeError
from .recipes import Assignments, Recipe
from .repository import ModelEntry, parse_version

if TYPE_CHECKING:
    from .config import ModelConfig
    from .execution.results import FrameResult
    from .imaging import Frame
    from .livefeed import LiveFeed
    from .tasks import Task


#: a part id longer than this is a mistake (the PLC's and the records' fields are short)
MAX_PART_ID = 128


class Origin(NamedTuple):
    """Where a request's frames come from, for the taps of every answer (the PLC result bus, the
    records, the live feed): what the front ends and the cameras say of them, each None when not
    known. A tap may also be given a plain, shorter tuple (the fields in this order)."""

    part_id: str | None = None
    camera: str | None = None  #: the camera's name (``X-Camera-Id``, ``[camera.NAME]``)
    station: str | None = None
    recipe: str | None = None  #: the recipe the route decided under
    #: the camera's timestamp of the frame (seconds, its clock as the source reports it): set by
    #: the server's own cameras, None for pushed frames
    camera_time: float | None = None
    #: the camera's own id of the frame (a GigE Vision block id), where the source gives one
    camera_frame: int | None = None
    #: one camera's frame of a station's part (a station trigger): the PLC hears the part's one
    #: result (:class:`PartResults`), not this frame's; the records and the live feed see it
    part_frame: bool = False


@dataclass(frozen=True, slots=True)
class PartResult:
    """A station's part, seen by each of its cameras, as one result for the PLC: NG when any
    camera's verdict is, no decision when any camera gave none (a station trigger)."""

    station: str  #: the station (recipes file): the PLC station of the same name gets it
    part_id: str | None
    cameras: tuple[str, ...]
    model: str
    version: str
    verdict: str  #: OK, NG, LATE or ERROR
    status: int  #: the part's HTTP status: 200 verdict, 504 late, 503 a camera gave no frame...
    label: str  #: the deciding camera's (the first NG one, else the first): for the registers
    label_index: int  #: -1 without a verdict
    score: float  #: NaN without a verdict
    queue_ms: float  #: the longest of the cameras'
    compute_ms: float
    asked: float  #: monotonic time of the trigger: the part's total time counts from it
    message: str = ""  #: why no decision


class PartResults(Protocol):
    """Where a station's part result goes (the PLC result bus, while PLC servers run)."""

    def publish_part(self, part: PartResult) -> None: ...


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)


@dataclass
class ModelStats:
    """Counters in the shape of the OIP / Triton statistics extension."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batch: dict[int, tuple[Duration, Duration, Duration]] = field(default_factory=dict)


class ServedModel(Protocol):
    """A served model version, as the front ends see it: what the OIP and inspect answers need."""

    entry: ModelEntry
    version: int
    config: ModelConfig
    backend_info: dict[str, str]
    stats: ModelStats

    @property
    def name(self) -> str: ...

    @property
    def ready(self) -> bool: ...

    @property
    def task(self) -> Task | None: ...


@dataclass
class ModelView:
    """A served version without its batcher and runners: what the engine sends a front-end
    process, and what that process answers from (``ready`` and ``stats`` as last heard)."""

    entry: ModelEntry
    version: int
    config: ModelConfig
    backend_info: dict[str, str]
    task: Task | None = None
    ready: bool = False
    stats: ModelStats = field(default_factory=ModelStats)

    @property
    def name(self) -> str:
        return self.entry.name

    @classmethod
    def of(cls, served: ServedModel) -> ModelView:
        return cls(served.entry, served.version, served.config, served.backend_info, served.task)


class DataPlane(Protocol):
    """One interface for every front end; see the module's docstring."""

    #: the repository's models by name, and the served versions by (name, version)
    entries: dict[str, ModelEntry]
    served: dict[tuple[str, int], Any]
    #: the stations' recipes (recipes.toml), replaced whole by a switch
    recipes: Assignments
    @property
    def feed(self) -> LiveFeed:
        """Every answer as it happens, for the console (GET /v1/live)."""
        ...

    @property
    def live(self) -> bool: ...

    @property
    def ready(self) -> bool: ...

    @property
    def draining(self) -> bool: ...

    def entry(self, name: str) -> ModelEntry:
        """The repository's model ``name`` (404 when there is none)."""
        ...

    def get(self, name: str, version: str | int | None = None) -> ServedModel:
        """The version a request names (404 unknown model or version, 503 not loaded yet)."""
        ...

    def model_ready(self, name: str, version: str | int | None = None) -> bool: ...

    def select(self, name: str = "", version: str | int | None = None) -> list[ServedModel]: ...

    def precheck(self, name: str, version: str | int | None, n: int, *,
                 deadline_ms: float | None, priority: int | None, arrival: float,
                 origin: Origin | None = None) -> None:
        """Raise now what admitting ``n`` frames would raise (503 overloaded, draining, bad
        deadline or priority), from a request's head, before its body is read."""
        ...

    async def infer(self, name: str, version: str | int | None, frames: list[Frame], *,
                    deadline_ms: float | None = None, priority: int | None = None,
                    arrival: float | None = None, origin: Origin | None = None
                    ) -> tuple[ServedModel, list[FrameResult]]:
        """Answers for ``frames`` in order; a VisionServeError for the whole request."""
        ...

    def count_error(self, model: str, exc: VisionServeError, frames: int = 0) -> None:
        """Count a request a front end answered with ``exc`` before the data plane saw it."""
        ...

    async def verdict(self, name: str, changes: Mapping | None = None,
                      caller: Mapping | None = None) -> dict:
        """Model ``name``'s ``[verdict]`` settings; with ``changes``, set those first (validated,
        written to its model.toml, in force from the next batch; ``caller`` goes to the audit
        line)."""
        ...

    async def preview_verdict(self, name: str, changes: Mapping) -> dict:
        """What ``changes`` of model ``name``'s ``[verdict]`` would make of its last answered
        frames: validated as :meth:`verdict` validates them, nothing changed."""
        ...

    def recipe_for(self, station: str | None, camera: str | None
                   ) -> tuple[str | None, Recipe | None]: ...

    def route(self, name: str | None, version: str | int | None, station: str | None,
              camera: str | None) -> Route: ...

    async def switch_recipe(self, station: str, recipe_id: str,
                            caller: Mapping | None = None) -> dict:
        """Make ``station`` run recipe ``recipe_id`` (see :mod:`visionserve.recipes`)."""
        ...

    async def statistics(self, name: str = "", version: str | int | None = None
                         ) -> Sequence[ServedModel]: ...

    async def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        """The repository's models: ``{"name", "version", "state", "reason"}`` rows (Triton's
        index; ``ready``: only the READY ones)."""
        ...

    async def load_model(self, name: str, parameters: Mapping | None = None,
                         caller: Mapping | None = None) -> dict:
        """Load model ``name`` (again) from the repository, as one swap; returns what changed and
        ``switched_at``, the ``time.monotonic()`` of the switch (``caller``: for the audit)."""
        ...

    async def unload_model(self, name: str, parameters: Mapping | None = None,
                           caller: Mapping | None = None) -> dict:
        """Unload every version of model ``name`` (``parameters["force"]``: even in use;
        ``caller``: for the audit)."""
        ...

    async def reload_model(self, name: str, action: str,
                           default_version: int | None = None) -> dict:
        """Serve what model ``name``'s folder selects now, as :meth:`load_model`'s swap, after
        the server changed the folder itself (``action``: ``promote``, ``rollback``); also with
        ``--model-control-mode poll``. ``default_version``: set in model.toml first where the
        file names one. Not audited: the caller audits its change."""
        ...

    async def trigger(self, target: str, part_id: str | None, station: bool = False
                      ) -> tuple[int, dict]:
        """Acquire a frame from camera ``target`` (with ``station``: from each camera of station
        ``target``) and inspect it: (HTTP status, the answer). 404 for an unknown camera or
        station; a camera that gives no frame is a fault in the answer, never an OK."""
        ...

    async def camera_states(self) -> list[dict]:
        """Each camera the server acquires from: its state (up, down), last error, counters."""
        ...

    async def capture_recent(self, record_id: int) -> str | None:
        """Capture the frame of record ``record_id`` (written without an image) from the recent
        frames the engine keeps (``--capture-recent``): where its image is, or None."""
        ...

    async def metrics_text(self) -> bytes: ...

    async def drain(self, timeout_s: float) -> bool: ...

    async def close(self) -> None: ...


class Cameras(Protocol):
    """The cameras of the serving process (:class:`visionserve.cameras.service.CameraService`),
    as the engine holds them: what :meth:`DataPlane.trigger` and ``camera_states`` call, and
    the PLC's triggers (``take``)."""

    async def trigger(self, target: str, part_id: str | None, station: bool
                      ) -> tuple[int, dict]: ...

    def take(self, plc_station: str, part_id: str | None) -> dict: ...

    def states(self) -> list[dict]: ...


def inspect_answer(served: ServedModel, r: FrameResult, frame: Frame, arrival: float, *,
                   part_id: str | None, camera_id: str | None, station: str | None,
                   recipe: str | None) -> dict[str, Any]:
    """The inspect JSON of one answered frame (``POST .../inspect``, a camera's trigger)."""
    task = served.task
    assert task is not None  # every served version has its task (made when it loads)
    return {
        "part_id": part_id,
        "camera_id": camera_id,
        "model": served.name,
        "version": str(served.version),
        "verdict": r.verdict,
        **task.inspect_fields(r.result),  # what the model's task says of the frame
        # the pixels boxes, masks and regions are in: the file's stored ones (EXIF ignored)
        **({"frame": {"width": frame.width, "height": frame.height}} if task.geometry else {}),
        **({} if station is None else {"station": station, "recipe": recipe}),
        "batch_size": r.batch_size,
        "deadline_met": r.deadline_met,
        "timing": {"queue_ms": round(r.queue_ms, 3), "compute_ms": round(r.compute_ms, 3),
                   "total_ms": round((time.monotonic() - arrival) * 1000, 3)},
    }


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes (:meth:`ModelLookup.route`): the model and version ("" = default),
    and the station and recipe it is decided under when it is a station's frame."""

    model: str
    version: str
    station: str | None = None
    recipe: str | None = None


class ModelLookup:
    """Finding a served version by name and version, the same answers (and errors) on both sides
    of :class:`DataPlane`. Needs ``entries``, ``served`` and ``ready``."""

    entries: dict[str, ModelEntry]
    served: dict[tuple[str, int], Any]
    recipes: Assignments

    if TYPE_CHECKING:  # the users' own read-only property
        @property
        def ready(self) -> bool: ...

    def entry(self, name: str) -> ModelEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise NotFound(f"unknown model {name!r}; served: {sorted(self.entries)}") from None

    def get(self, name: str, version: str | int | None = None) -> Any:
        entry = self.entry(name)
        v = parse_version(entry, version)
        served = self.served.get((name, v))
        if served is None:
            raise Unavailable(f"model {name} version {v} is not loaded (not yet, or unloaded: "
                              "POST /v2/repository/index says which)", retry_after_s=1.0)
        return served

    def recipe_for(self, station: str | None, camera: str | None
                   ) -> tuple[str | None, Recipe | None]:
        """(station, the recipe it runs) of a frame from ``station`` or ``camera``; (None, None)
        for a frame of no station. 404 for an unknown station."""
        book = self.recipes
        name = book.station_of(station, camera)
        return name, book.recipe_of(name)

    def route(self, name: str | None, version: str | int | None, station: str | None,
              camera: str | None) -> Route:
        """Where a request goes: a frame of a station (named, or by its camera) to the model and
        version of the recipe that station runs now; a request that names another model or
        version is a 409 (``name`` None: the station's own URL, which needs a recipe). Any other
        request to the model and version it names."""
        station, recipe = self.recipe_for(station, camera)
        wanted = "" if version is None else str(version)
        if recipe is None:
            if name is None:
                raise Conflict(f"station {station!r} runs no recipe: switch one in first "
                               f"(POST /v1/stations/{station}/recipe)")
            return Route(name, wanted, station, None)
        version_of_recipe = "" if recipe.version is None else str(recipe.version)
        if name not in (None, recipe.model) or wanted not in ("", version_of_recipe):
            raise Conflict(
                f"station {station!r} runs recipe {recipe.id!r}: model {recipe.model} version "
                f"{version_of_recipe or 'default'}, not {name} {wanted}; send its frames to "
                f"/v1/stations/{station}/inspect, or name no version")
        return Route(recipe.model, version_of_recipe, station, recipe.id)

    def model_ready(self, name: str, version: str | int | None = None) -> bool:
        try:
            s = self.get(name, version)
        except Unavailable:
            return False
        return self.ready and s.ready

    def select(self, name: str = "", version: str | int | None = None) -> list:
        """The versions a statistics request names: all models, all versions of one, or one."""
        if not name:
            return list(self.served.values())
        if version:
            return [self.get(name, version)]
        entry = self.entry(name)
        return [s for (n, _), s in self.served.items() if n == entry.name]
