"""The data plane in the serving process: the engine every front end calls (see
:class:`visionserve.dataplane.DataPlane`, which it implements). No wire formats here.

``Engine.start()`` scans the model repository, loads and warms up every model version on the
device (in worker threads, so the loop stays responsive and ``/v2/health/live`` answers), then
reports ready. ``submit()`` is the one way frames go in; ``infer()`` awaits it for the front ends
of this process, the hub of the front-end processes calls it directly. ``drain()`` is the
shutdown path: readiness goes false first, queued work finishes.

The engine holds the served state the front ends see (``entries``, ``served``, ``recipes``),
builds and releases model versions (``_load``, ``_release``), and hands the rest to its parts:

- :mod:`visionserve.lifecycle`: what is served and every change to it (the repository scan,
  loads and unloads as swaps, the repository poll, verdict settings, the stations' recipes);
- :mod:`visionserve.admission`: a request's frames into the batcher and its answer back, the
  checks before, and the taps that hear every answer;
- :mod:`visionserve.enginestats`: the statistics and metrics of batches and requests.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from . import enginestats, imaging, metrics, recipes, tasks
from .admission import Admission, Gate, ResultTap
from .backends import base as backends
from .backends import checks
from .batching import Batcher, CostModel
from .config import ServerSettings
from .dataplane import Cameras, ModelLookup, PartResults
from .errors import ConfigError, NotFound, VisionServeError
from .execution import Executor, InProcess, choose
from .execution.results import FrameResult, device_fault, padded_size
from .imaging import Frame
from .lifecycle import Lifecycle
from .livefeed import LiveSource, LocalFeed
from .preview import Ring, judge_again
from .repository import ModelEntry
from .served import Served, effective_config
from .served import file_stamp as _file_stamp
from .threads import run_lowered, switching_fast

if TYPE_CHECKING:
    from .execution.reservation import GpuReservation

log = logging.getLogger(__name__)

#: Python's thread switch interval while a version loads: the load's pure-Python deserialising
#: hands the interpreter back to the serving threads within this.
LOAD_SWITCH_INTERVAL_S = 0.00005

_load_ids = itertools.count(1)


class Engine(ModelLookup):
    def __init__(self, settings: ServerSettings, device: str = "cpu") -> None:
        self.settings = settings
        self.device = device
        self.entries: dict[str, ModelEntry] = {}
        self.served: dict[tuple[str, int], Served] = {}
        # the stations' recipes (recipes.toml): replaced whole by a switch; the front-end
        # processes are sent it with the models
        self.recipes = recipes.NO_RECIPES
        # changes of the served models' settings ([verdict]), recipes and versions: the
        # front-end processes are sent the models again when it moves
        self.generation = 0
        #: called (on the loop) right after every swap, before any frame reaches a new version:
        #: the hub tells the front-end processes the served versions there
        self.on_change: list[Callable[[], None]] = []
        # service -> why it holds readiness false (a PLC server process being restarted)
        self.unready: dict[str, str] = {}
        self.gpu: GpuReservation | None = None  # when the device is a GPU
        self.gate = Gate()
        self.lifecycle = Lifecycle(self, load=self._load, release=self._release)
        self.admission = Admission(self.gate, self.count_error)
        # the live results (GET /v1/live): tapped in while a console listens; the hub feeds the
        # --frontends processes from the same source
        self.live_source = LiveSource(self, settings.max_live_streams)
        self.feed = LocalFeed(self.live_source)
        #: the last answered frames of each model, for the verdict preview (None: kept none)
        self.preview = Ring(settings.preview_frames) if settings.preview_frames else None
        if self.preview is not None:
            self.admission.tap(self.preview)
        #: the cameras the server acquires from (visionserve.cameras.service), while they run
        self.camera_service: Cameras | None = None
        #: where a station trigger's part result goes: the PLC result bus while PLC servers run
        self.part_results: PartResults | None = None
        #: captures a flagged record's frame from the recent ones in memory: the record writer's
        #: (visionserve.records.writer.Recorder.capture_recent) while it runs
        self.recent_capture: Callable[[int], str | None] | None = None

    # --- state, start and shutdown ------------------------------------------------------------

    @property
    def live(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return self.gate.started and not self.gate.draining and not self.unready \
            and all(s.ready for s in self.served.values())

    @property
    def draining(self) -> bool:
        return self.gate.draining

    @property
    def _ready(self) -> bool:
        """Serving (started, not closed): a version loaded now loads beside serving ones."""
        return self.gate.started

    def scan(self) -> None:
        """Read the repository (fast, synchronous): bad model.toml files fail start-up here, and
        so does a recipes file whose recipes name what the repository does not hold."""
        self.lifecycle.scan()

    async def start(self) -> None:
        if not self.entries:
            self.scan()
        imaging.configure_opencv(self.settings.max_image_pixels)
        loop = asyncio.get_running_loop()
        wanted = self.settings.startup_models()
        if wanted is not None and wanted - set(self.entries):
            raise ConfigError(f"--load-model names model(s) the repository does not hold: "
                              f"{sorted(wanted - set(self.entries))} (have {sorted(self.entries)})")
        entries = [e for e in self.entries.values() if wanted is None or e.name in wanted]
        for e in self.entries.values():
            if e not in entries:
                self.lifecycle.reasons[e.name] = "unloaded (not in --load-model)"
        if self.device.startswith("cuda"):
            # budget: planned, checked free (else not ready, the reason logged), allocators capped
            from .execution.reservation import GpuReservation

            self.gpu = GpuReservation(self.settings.gpu_memory_budget, self.device,
                                      one_call=self.settings.gpu_prep_one_call,
                                      batch_processes=self.settings.gpu_batch_processes or 0)
            await self.gpu.reserve([(e.name, effective_config(e.config, self.settings))
                                    for e in entries])
        for entry in entries:
            for version, path in sorted(entry.versions.items()):
                served = await self._load(entry, version, path, loop)
                self.served[(entry.name, version)] = served
                metrics.READY.labels(entry.name, str(version)).set(1)
        if self.gpu is not None:
            self.gpu.ready()  # allocator state marked: serving should add no device memory
        await self.lifecycle.resume_recipes()
        self.gate.started = True
        log.info("ready: %s on %s", ", ".join(f"{n}:{v}" for n, v in self.served), self.device)
        if self.settings.model_control_mode == "poll":
            self.lifecycle.start_polling()

    async def _load(self, entry: ModelEntry, version: int, path: Path,
                    loop: asyncio.AbstractEventLoop) -> Served:
        """Load, warm up and start one version; on failure what it loaded is released."""
        made: list[backends.Backend] = []
        try:
            with switching_fast(LOAD_SWITCH_INTERVAL_S):
                return await self._build(entry, version, path, loop, made)
        except BaseException:
            for backend in made:
                backend.close()
            raise

    async def _build(self, entry: ModelEntry, version: int, path: Path,
                     loop: asyncio.AbstractEventLoop, made: list[backends.Backend]) -> Served:
        config = effective_config(entry.config, self.settings)
        b = config.batching
        preferred = b.preferred_batch_sizes or (b.max_batch_size,)
        task = tasks.create(config)
        pad_to: tuple[int, ...] = ()
        cost: CostModel | None = None
        runners: list[Executor] = []
        load_id = next(_load_ids)
        device_before = self.gpu.device_bytes() if self.gpu else 0  # what this load takes
        nice = self.settings.worker_nice  # the model's threads below the event loop's priority
        for i in range(config.runtime.instances):
            backend = backends.create(config.runtime.backend)
            backend.isolated = self._ready and self.settings.isolated_loads  # beside serving ones
            made.append(backend)
            t0 = time.monotonic()
            load_config = self.gpu.instance_config(entry.name, config) if self.gpu else config
            await run_lowered(nice, backend.load, path, load_config, self.device)
            # the task checks the outputs the model file declares, and names those it reads
            backend.select_outputs(task.bind(checks.Subject(path), backend.outputs),
                                   on_device=task.on_device)
            if cost is None:  # padded up to a preferred size: static shapes, or on a GPU (auto)
                pad = b.pad_to_preferred == "always" or (b.pad_to_preferred == "auto" and (
                    self.device != "cpu" or backend.static_shapes))
                pad_to = preferred if pad else ()
                cost = CostModel(functools.partial(padded_size, preferred=pad_to))
            await run_lowered(nice, self._warmup, backend, preferred, cost, path, task)
            placement = await asyncio.to_thread(self.gpu.placement, backend, config, preferred,
                                                load_id, (entry.name, i), path, task) \
                if self.gpu else InProcess()
            log.info("%s:%d instance %d loaded and warmed up in %.1f s (%s)", entry.name, version,
                     i, time.monotonic() - t0, backend.describe())
            runners.append(choose(placement, name=f"{entry.name}:{version}#{i}", backend=backend,
                                  config=config, preferred=pad_to, cost=cost,
                                  on_batch=lambda r: None, task=task, nice=nice))
        # where this version's batches run, and why: once, for all its instances
        log.info("%s:%d executes %s", entry.name, version,
                 "; ".join(dict.fromkeys(r.describe() for r in runners)))

        async def execute(batch):
            # the instance with the fewest batches in flight (a batch a prep thread took is no
            # longer in its inbox, but still in flight); ties to the one that took fewer so far
            runner = min(runners, key=lambda r: (r.inflight, r.accepted))
            await runner.execute(batch)

        assert cost is not None  # made with the first instance (instances >= 1)
        if self.gpu is not None:
            self.gpu.measure(load_id, device_before)
        batcher = Batcher(name=f"{entry.name}:{version}", execute=execute,
                          max_batch_size=b.max_batch_size,
                          max_queue_delay_s=b.max_queue_delay_ms / 1000,
                          max_queue_size=b.max_queue_size, cost=cost,
                          max_inflight=sum(r.batches_in_flight for r in runners),
                          full_extra=sum(r.full_batches_extra for r in runners),
                          dispatch_when_idle=b.dispatch_when_idle)
        if batcher.full_extra:
            log.info("%s:%d batches in flight: %d, and %d more when full", entry.name, version,
                     batcher.max_inflight, batcher.full_extra)
        served = Served(entry, version, config, batcher, runners,
                        backend_info=runners[0].backend.describe(), task=task,
                        source=_file_stamp(path), load_id=load_id)
        for r in runners:
            r.on_batch = functools.partial(self._record_batch, served)
            # Thread.start waits until the new thread runs: on busy cores, not on the event loop
            await asyncio.to_thread(r.start, loop)
        batcher.on_drop = lambda item, reason: self._record_drop(served, reason)
        # read when scraped, so never stale (the queue also drains by batches taken, frames
        # dropped late and cancellations); all versions of the model, as the label has no version
        served.series.queue_depth.set_function(
            functools.partial(self._waiting, entry.name, "queue_depth"))
        metrics.INFLIGHT.labels(entry.name).set_function(
            functools.partial(self._waiting, entry.name, "inflight"))
        batcher.on_failure = \
            lambda exc: metrics.READY.labels(served.name, str(served.version)).set(0)
        batcher.start()
        return served

    @staticmethod
    def _warmup(backend: backends.Backend, preferred: tuple[int, ...], cost: CostModel,
                path: Path | None = None, task: tasks.Task | None = None) -> None:
        """Run every preferred size; a model that fails on the input model.toml describes, or
        answers in other shapes than its task needs, is a ConfigError naming the field (``path``:
        the model file) instead of a 500 on every frame."""
        cfg = backend.config
        subject = checks.Subject(path) if path is not None and cfg is not None else None
        try:
            backend.warmup(preferred)
            if cfg is None:
                return
            # seed the cost model with backend-only times, so early dispatch works from request one
            for bs in preferred:
                x = backend.example_input(bs)
                t0 = time.monotonic()
                out = backend.run(x)
                cost.observe(bs, time.monotonic() - t0)
                if subject is not None and task is not None:
                    task.check_warmup(subject, bs, out)
        except Exception as exc:
            # a device that fails or runs out of memory (torch, onnxruntime): no model.toml mismatch
            text = str(exc).lower()
            if subject is None or cfg is None or isinstance(exc, (VisionServeError, MemoryError)) \
                    or device_fault(exc) or "out of memory" in text or "failed to allocate" in text:
                raise
            raise checks.run_failed(subject, cfg, preferred, exc) from exc

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Readiness false, refuse new work, let queued and running frames finish."""
        timeout = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        self.gate.draining = True
        log.info("draining: readiness false, finishing queued frames (up to %.1f s)", timeout)
        results = await asyncio.gather(*(s.batcher.drain(timeout) for s in self.served.values()))
        return all(results)

    async def close(self) -> None:
        self.gate.draining = True
        self.live_source.close()
        self.lifecycle.stop_polling()
        for s in self.served.values():
            await self._release(s)
        if self.gpu is not None:
            await self.gpu.close()
        self.gate.started = False

    async def _release(self, served: Served, drain_s: float | None = None) -> None:
        """Stop a version: with ``drain_s``, its batcher first answers what it holds (up to that
        long); then what is left is answered 503, its runner threads stop and its backends are
        released."""
        if drain_s is None:
            await served.batcher.close()
        else:
            await served.batcher.drain(drain_s)
        for r in served.runners:
            await asyncio.to_thread(r.stop)
            # off the event loop: onnxruntime joins its session's threads as it frees it
            await asyncio.to_thread(r.backend.close)
        if self.served.get((served.name, served.version)) is not served:
            metrics.READY.labels(served.name, str(served.version)).set(0)

    # --- changes while serving: lifecycle.Lifecycle --------------------------------------------

    async def verdict(self, name: str, changes: Mapping | None = None,
                      caller: Mapping | None = None) -> dict:
        return await self.lifecycle.verdict(name, changes, caller)

    async def switch_recipe(self, station: str, recipe_id: str,
                            caller: Mapping | None = None) -> dict:
        return await self.lifecycle.switch_recipe(station, recipe_id, caller)

    async def preview_verdict(self, name: str, changes: Mapping) -> dict:
        """What ``changes`` of model ``name``'s ``[verdict]`` would make of its last answered
        frames (:mod:`.preview`), validated as a change is; nothing changes."""
        config = await self.lifecycle.trial_verdict(name, changes)
        if self.preview is None:
            return {"frames": 0, "changed": 0, "frames_changed": [], "unavailable": 0,
                    "why": "no frames are kept: --preview-frames is 0"}
        return await asyncio.to_thread(judge_again, self.preview.kept(name), config)

    async def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        return await self.lifecycle.repository_index(ready)

    async def load_model(self, name: str, parameters: Mapping | None = None,
                         caller: Mapping | None = None) -> dict:
        return await self.lifecycle.load_model(name, parameters, caller)

    async def unload_model(self, name: str, parameters: Mapping | None = None,
                           caller: Mapping | None = None) -> dict:
        return await self.lifecycle.unload_model(name, parameters, caller)

    async def reload_model(self, name: str, action: str,
                           default_version: int | None = None) -> dict:
        return await self.lifecycle.reload_model(name, action, default_version)

    # --- inference: admission.Admission ------------------------------------------------------

    async def infer(self, name: str, version: str | int | None, frames: list[Frame], *,
                    deadline_ms: float | None = None, priority: int | None = None,
                    arrival: float | None = None, origin: tuple | None = None
                    ) -> tuple[Served, list[FrameResult]]:
        """Answers for ``frames`` in order; raises a VisionServeError for the whole request."""
        answer = self.submit(name, version, frames, deadline_ms=deadline_ms, priority=priority,
                             arrival=arrival, origin=origin)
        try:
            return await answer
        except asyncio.CancelledError:
            answer.cancel()  # the client went away: its frames not yet run are dropped
            raise

    def submit(self, name: str, version: str | int | None, frames: list[Frame], *,
               deadline_ms: float | None = None, priority: int | None = None,
               arrival: float | None = None, origin: tuple | None = None) -> asyncio.Future:
        """Queue a request's frames: a future of ``(served, results in frame order)``, or of the
        request's VisionServeError (``Admission.submit``). An unknown model or version raises at
        once, uncounted: the front end that asked counts it as one it refused."""
        arrival = time.monotonic() if arrival is None else arrival
        return self.admission.submit(self.get(name, version), frames, deadline_ms, priority,
                                     arrival, origin)

    def precheck(self, name: str, version: str | int | None, n: int, *, deadline_ms: float | None,
                 priority: int | None, arrival: float, origin: tuple | None = None) -> None:
        """What admitting ``n`` frames would raise now, from a request's head
        (``Admission.precheck``)."""
        self.admission.precheck(self.get(name, version), n, deadline_ms, priority, arrival, origin)

    def refuse(self, name: str, version: str | int | None, n: int, origin: tuple | None,
               exc: VisionServeError) -> None:
        """Answer ``n`` frames that never came with ``exc`` (``Admission.refuse``)."""
        self.admission.refuse(self.get(name, version), n, origin, exc)

    # --- cameras: visionserve.cameras.service ------------------------------------------------

    async def trigger(self, target: str, part_id: str | None, station: bool = False
                      ) -> tuple[int, dict]:
        if self.camera_service is None:
            raise NotFound(f"unknown {'station' if station else 'camera'} {target!r}: the server "
                           "acquires from no camera ([camera.NAME] in the recipes file, --camera)")
        return await self.camera_service.trigger(target, part_id, station)

    async def camera_states(self) -> list[dict]:
        return [] if self.camera_service is None else self.camera_service.states()

    # --- records: a flag's frame, visionserve.records ----------------------------------------

    async def capture_recent(self, record_id: int) -> str | None:
        """Capture the frame of record ``record_id`` (written without an image) from the recent
        frames this process keeps: where its image is stored, or None (no longer kept, or the
        server keeps none)."""
        if self.recent_capture is None:
            return None
        return await asyncio.to_thread(self.recent_capture, record_id)

    def tap(self, listener: ResultTap) -> None:
        """Hand every frame's final answer to ``listener`` from now on (``Admission.tap``)."""
        self.admission.tap(listener)

    def untap(self, listener: ResultTap) -> None:
        self.admission.untap(listener)

    # --- statistics and metrics: enginestats -------------------------------------------------

    async def statistics(self, name: str = "", version: str | int | None = None) -> list[Served]:
        """The selected versions with their current ``stats`` (async: a front end in another
        process fetches them from here)."""
        return self.select(name, version)

    def latency_p99(self) -> Callable[[], float | None]:
        """Start keeping the last second's latencies; returns the function that reads their p99."""
        return self.admission.latency_p99()

    def count_error(self, model: str, exc: VisionServeError | str, frames: int = 0) -> None:
        """Count a request answered with an error, once (``enginestats.count_error``)."""
        enginestats.count_error(self.entries, model, exc, frames)

    async def metrics_text(self) -> bytes:
        return enginestats.metrics_text()

    # the runners' and batchers' callbacks (``_build``)
    _record_batch = staticmethod(enginestats.record_batch)
    _record_drop = staticmethod(enginestats.record_drop)

    def _waiting(self, name: str, what: str) -> int:
        return enginestats.waiting(self.served, name, what)
