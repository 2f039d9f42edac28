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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .errors import NotFound, Unavailable, VisionServeError
from .repository import ModelEntry, parse_version

if TYPE_CHECKING:
    from .config import ModelConfig
    from .imaging import Frame
    from .runner import FrameResult
    from .tasks import Task


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
                 origin: tuple | None = None) -> None:
        """Raise now what admitting ``n`` frames would raise (503 overloaded, draining, bad
        deadline or priority), from a request's head, before its body is read."""
        ...

    async def infer(self, name: str, version: str | int | None, frames: list[Frame], *,
                    deadline_ms: float | None = None, priority: int | None = None,
                    arrival: float | None = None, origin: tuple | None = None
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

    async def statistics(self, name: str = "", version: str | int | None = None
                         ) -> Sequence[ServedModel]: ...

    async def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        """The repository's models: ``{"name", "version", "state", "reason"}`` rows (Triton's
        index; ``ready``: only the READY ones)."""
        ...

    async def load_model(self, name: str, parameters: Mapping | None = None) -> dict:
        """Load model ``name`` (again) from the repository, as one swap; returns what changed and
        ``switched_at``, the ``time.monotonic()`` of the switch."""
        ...

    async def unload_model(self, name: str, parameters: Mapping | None = None) -> dict:
        """Unload every version of model ``name`` (``parameters["force"]``: even in use)."""
        ...

    async def metrics_text(self) -> bytes: ...

    async def drain(self, timeout_s: float) -> bool: ...

    async def close(self) -> None: ...


class ModelLookup:
    """Finding a served version by name and version, the same answers (and errors) on both sides
    of :class:`DataPlane`. Needs ``entries``, ``served`` and ``ready``."""

    entries: dict[str, ModelEntry]
    served: dict[tuple[str, int], Any]

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
