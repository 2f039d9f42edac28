"""The data plane in the serving process: the engine every front end calls (see
:class:`visionserve.dataplane.DataPlane`, which it implements). No wire formats here.

``Engine.start()`` scans the model repository, loads and warms up every model version on the
device (in worker threads, so the loop stays responsive and ``/v2/health/live`` answers), then
reports ready. ``submit()`` is the one way frames go in: checks, admission, one batcher queue per
model, and the answer counted and recorded once, from the frames' futures (no task per request);
``infer()`` awaits it for the front ends of this process, the hub of the front-end processes
calls it directly. ``drain()`` is the shutdown path: readiness goes false first, queued work
finishes.

The served versions change while it serves (``load_model``, ``unload_model``, the repository
poll: ``--model-control-mode``), always as a swap: the new versions load and warm up beside the
old ones, then one assignment of ``served`` switches traffic (a request resolves its version
once, at admission, and stays on it), then the old versions drain (their batchers answer what
they hold) and are released. A load that fails or does not fit changes nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pydantic import ValidationError

from . import imaging, metrics, recipes, tasks, verdicts
from .backends import base as backends
from .backends import checks
from .batching import Batcher, CostModel
from .config import BatchingSpec, ModelConfig, ServerSettings
from .dataplane import Duration, ModelLookup, ModelStats
from .errors import (
    ConfigError,
    Conflict,
    InvalidInput,
    NotFound,
    Unavailable,
    VisionServeError,
    describe_validation,
)
from .execution import Executor, InProcess, choose
from .execution.results import BatchRecord, FrameResult, device_fault, padded_size
from .imaging import Frame
from .latency import LatencyWindow
from .repository import ModelEntry, folder_of, load_entry, model_folders, scan, signature
from .threads import run_lowered, switching_fast

if TYPE_CHECKING:
    from .execution.reservation import GpuReservation

log = logging.getLogger(__name__)

#: Python's thread switch interval while a version loads: the load's pure-Python deserialising
#: hands the interpreter back to the serving threads within this.
LOAD_SWITCH_INTERVAL_S = 0.00005
#: one line per change of a model's [verdict], with old and new values and the caller
audit = logging.getLogger("visionserve.audit")

MAX_DEADLINE_MS = 3_600_000.0
#: a model that answered a frame this recently (or has frames queued or running) is in use: its
#: unload is refused unless forced
IN_USE_S = 30.0
#: load parameters (Triton's) that ask for a model other than the repository's: not supported
_OVERRIDES = ("config", "file:")


def _file_stamp(path: Path) -> tuple[int, int]:
    """(size, modification time) of a version's model file: a changed file is a new model."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns


_load_ids = itertools.count(1)


@dataclass
class Served:
    """One loaded model version."""

    entry: ModelEntry
    version: int
    config: ModelConfig
    batcher: Batcher
    runners: list[Executor]
    stats: ModelStats = field(default_factory=ModelStats)
    backend_info: dict[str, str] = field(default_factory=dict)
    series: metrics.ModelSeries = field(init=False)  # made in __post_init__
    #: what the outputs mean: the front ends have it render answers (bound to the model at load)
    task: tasks.Task | None = None
    #: the model file's (size, modification time) when it was loaded
    source: tuple[int, int] = (0, 0)
    #: this load of it, for the GPU reservation's streams (a version reloaded is another load)
    load_id: int = 0

    def __post_init__(self) -> None:
        self.series = metrics.ModelSeries(self.entry.name)
        if self.task is None:
            self.task = tasks.create(self.config)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def ready(self) -> bool:
        return self.batcher.alive and all(r.healthy for r in self.runners)


def effective_config(config: ModelConfig, settings: ServerSettings) -> ModelConfig:
    """model.toml's batching, with the server's command-line overrides applied."""
    b = config.batching
    over = {k: v for k, v in {
        "max_batch_size": settings.max_batch_size,
        "max_queue_delay_ms": settings.max_queue_delay_ms,
        "max_queue_size": settings.max_queue_size,
        "takt_ms": settings.takt_ms,
    }.items() if v is not None}
    if not over:
        return config
    data = b.model_dump() | over
    mbs = data["max_batch_size"]
    data["preferred_batch_sizes"] = tuple(p for p in data["preferred_batch_sizes"]
                                          if p <= mbs) or (mbs,)
    try:
        batching = BatchingSpec.model_validate(data)
    except ValidationError as exc:
        # the server setting's own range is wider than model.toml's: name the option, not pydantic
        errs = "; ".join(describe_validation(exc, flag=True, got=True))
        raise ConfigError(f"server override does not fit model {config.name or 'config'}: "
                          f"{errs}") from None
    return config.model_copy(update={"batching": batching})


#: where a request's frames come from, as the front ends say it: (part id, camera id, station
#: id), each None when not sent
Origin = tuple


class ResultTap(Protocol):
    """What hears every frame's final answer (``Engine.tap``); called on the engine's loop."""

    def watch(self, served, pending: Sequence, origin: Origin | None) -> None: ...

    def refused(self, served, count: int, origin: Origin | None,
                exc: VisionServeError) -> None: ...


class _Tee:
    """Several taps as one."""

    def __init__(self, taps: tuple[ResultTap, ...]) -> None:
        self.taps = taps

    def watch(self, served, pending: Sequence, origin: Origin | None) -> None:
        for t in self.taps:
            t.watch(served, pending, origin)

    def refused(self, served, count: int, origin: Origin | None,
                exc: VisionServeError) -> None:
        for t in self.taps:
            t.refused(served, count, origin, exc)


class Engine(ModelLookup):
    def __init__(self, settings: ServerSettings, device: str = "cpu") -> None:
        self.settings = settings
        self.device = device
        self.entries: dict[str, ModelEntry] = {}
        self.served: dict[tuple[str, int], Served] = {}
        self._ready = False
        self._draining = False
        self.gpu: GpuReservation | None = None  # when the device is a GPU
        # the last second's answers, kept only when someone reads them (the guard's latency budget)
        self.latency: LatencyWindow | None = None
        # who hears every frame's final answer (verdict, LATE, error), whichever front end asked:
        # the PLC result bus (visionserve.plc.bus.ResultBus) while a PLC server runs, the
        # traceability records (visionserve.records) while they are on; see ``tap``
        self.results: ResultTap | None = None
        self._taps: list[ResultTap] = []
        # changes of the served models' settings ([verdict]): the front-end processes are sent
        # the models again when it moves; one lock per model serialises the changes
        self.generation = 0
        # one lock per model serialises its changes: [verdict] settings, loads, unloads
        self._locks: dict[str, asyncio.Lock] = {}
        # model -> versions loading beside the served ones now (the repository index says so)
        self._loading: dict[str, list[int]] = {}
        # model -> why it serves no version (unloaded, or its last load failed)
        self.reasons: dict[str, str] = {}
        # service -> why it holds readiness false (a PLC server process being restarted)
        self.unready: dict[str, str] = {}
        # model -> its folder's signature when last read (the repository poll compares it)
        self._signatures: dict[str, tuple] = {}
        self._poller: asyncio.Task | None = None
        #: called (on the loop) right after every swap, before any frame reaches a new version:
        #: the hub tells the front-end processes the served versions there
        self.on_change: list[Callable[[], None]] = []
        # the stations' recipes (recipes.toml): replaced whole by a switch; the front-end
        # processes are sent it with the models
        self.recipes = recipes.NO_RECIPES
        self._recipes_file: Path | None = None
        self._recipes_lock = asyncio.Lock()

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def live(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return self._ready and not self._draining and not self.unready \
            and all(s.ready for s in self.served.values())

    @property
    def draining(self) -> bool:
        return self._draining

    def scan(self) -> None:
        """Read the repository (fast, synchronous): bad model.toml files fail start-up here, and
        so does a recipes file whose recipes name what the repository does not hold."""
        root = Path(self.settings.models)
        # before the files are read: a change meanwhile is a change to the next poll
        self._signatures = {f.name: signature(f) for f in model_folders(root)}
        self.entries = scan(root)
        for entry in self.entries.values():  # bad command-line overrides fail here too, not at load
            effective_config(entry.config.model_copy(update={"name": entry.name}), self.settings)
        path = self.settings.recipes or Path(self.settings.models) / "recipes.toml"
        if self.settings.recipes is not None or path.is_file():
            book = recipes.load(path)
            for recipe in book.recipes.values():
                self._check_recipe(path, recipe)
            self._recipes_file, self.recipes = path, book

    def _check_recipe(self, path: Path, recipe: recipes.Recipe) -> None:
        where = f"recipes file {path}: recipe {recipe.id!r}"
        if recipe.model not in self.entries:
            raise ConfigError(f"{where} names model {recipe.model!r}, which the repository does "
                              f"not hold (models: {sorted(self.entries)})")
        entry = self.entries[recipe.model]
        if recipe.version is not None and recipe.version not in entry.versions:
            raise ConfigError(f"{where} names version {recipe.version} of {recipe.model}, which "
                              f"the repository does not hold (versions: {sorted(entry.versions)})")
        if recipe.verdict:
            try:
                verdicts.change(entry.path / "model.toml", recipe.verdict)
            except VisionServeError as exc:
                raise ConfigError(f"{where}: its verdict settings do not fit model "
                                  f"{recipe.model}: {exc.message}") from None

    async def _resume_recipes(self) -> None:
        """The verdict settings of the recipes the stations run (from the state file, else the
        recipes file) in force before the first frame; stations that share a model with
        different settings fail start-up."""
        wanted: dict[str, dict] = {}
        for station, rid in sorted(self.recipes.stations.items()):
            recipe = None if rid is None else self.recipes.recipes[rid]
            if recipe is None or not recipe.verdict:
                continue
            merged = wanted.setdefault(recipe.model, {})
            for key, value in recipe.verdict.items():
                if key in merged and merged[key] != value:
                    raise ConfigError(f"recipes file {self._recipes_file}: stations share model "
                                      f"{recipe.model} with different verdict settings ({key}); "
                                      f"station {station!r} runs recipe {rid!r}")
                merged[key] = value
        for model, values in wanted.items():
            now = verdicts.current(self.entries[model].config)
            if any(now.get(k) != v for k, v in values.items()):
                await self.verdict(model, values, {"client": "start-up (recipes)"})

    async def switch_recipe(self, station: str, recipe_id: str,
                            caller: Mapping | None = None) -> dict:
        """Make ``station`` run recipe ``recipe_id``: its version must be served (503 otherwise:
        load it first), its verdict settings are set on the model (as ``verdict`` does) unless
        another station's recipe on that model needs other values (409), then the station's
        frames are decided under it from the next admitted one. Kept in the state file."""
        t0 = time.monotonic()
        async with self._recipes_lock:
            book = self.recipes
            if station not in book.stations:
                raise NotFound(f"unknown station {station!r}; stations: {sorted(book.stations)}")
            recipe = book.recipes.get(recipe_id)
            if recipe is None:
                raise NotFound(f"unknown recipe {recipe_id!r}; recipes: {sorted(book.recipes)}")
            served = self.get(recipe.model, recipe.version)
            for other, rid in book.stations.items():
                theirs = None if other == station or rid is None else book.recipes[rid]
                if theirs is None or theirs.model != recipe.model:
                    continue
                clash = {k for k in set(theirs.verdict) | set(recipe.verdict)
                         if theirs.verdict.get(k) != recipe.verdict.get(k)}
                if clash:
                    raise Conflict(
                        f"station {other!r} runs recipe {theirs.id!r} on model {recipe.model} "
                        f"with other verdict settings ({', '.join(sorted(clash))}); two stations "
                        "share a model's verdict settings: switch that station first, or give "
                        "both recipes the same values")
            old = book.stations[station]
            if recipe.verdict:
                now = verdicts.current(self.entries[recipe.model].config)
                if any(now.get(k) != v for k, v in recipe.verdict.items()):
                    await self.verdict(recipe.model, recipe.verdict, caller)
            self.recipes = dataclasses.replace(book, stations={**book.stations,
                                                                station: recipe_id})
            self.generation += 1
            persisted = True
            if self._recipes_file is not None:
                try:
                    await asyncio.to_thread(recipes.write_state,
                                            recipes.state_path(self._recipes_file),
                                            self.recipes.stations)
                except ConfigError as exc:
                    persisted = False
                    log.warning("station %s runs recipe %s, but after a restart it would not: %s",
                                station, recipe_id, exc.message)
        ms = (time.monotonic() - t0) * 1000
        who = dict(caller or {})
        audit.info("station %s switched from recipe %s to %s by %s in %.1f ms", station, old,
                   recipe_id, _by(who), ms,
                   extra={"audit": {"action": "recipe", "station": station, "old": old,
                                    "new": recipe_id, "caller": who}})
        return {"station": station, **recipe.view(), "version": served.version,
                "previous": old, "changeover_ms": round(ms, 3), "persisted": persisted}

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
                self.reasons[e.name] = "unloaded (not in --load-model)"
        if self.device.startswith("cuda"):
            # budget: planned, checked free (else not ready, the reason logged), allocators capped
            from .execution.reservation import GpuReservation

            self.gpu = GpuReservation(self.settings.gpu_memory_budget, self.device,
                                      one_call=self.settings.gpu_prep_one_call,
                                      batch_processes=self.settings.gpu_batch_processes)
            await self.gpu.reserve([(e.name, effective_config(e.config, self.settings))
                                    for e in entries])
        for entry in entries:
            for version, path in sorted(entry.versions.items()):
                served = await self._load(entry, version, path, loop)
                self.served[(entry.name, version)] = served
                metrics.READY.labels(entry.name, str(version)).set(1)
        if self.gpu is not None:
            self.gpu.ready()  # allocator state marked: serving should add no device memory
        await self._resume_recipes()
        self._ready = True
        log.info("ready: %s on %s", ", ".join(f"{n}:{v}" for n, v in self.served), self.device)
        if self.settings.model_control_mode == "poll":
            self._poller = loop.create_task(self._poll(), name="repository-poll")

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
        self._draining = True
        log.info("draining: readiness false, finishing queued frames (up to %.1f s)", timeout)
        results = await asyncio.gather(*(s.batcher.drain(timeout) for s in self.served.values()))
        return all(results)

    async def close(self) -> None:
        self._draining = True
        if self._poller is not None:
            self._poller.cancel()
        for s in self.served.values():
            await self._release(s)
        if self.gpu is not None:
            await self.gpu.close()
        self._ready = False

    def tap(self, listener: ResultTap) -> None:
        """Hand every frame's final answer to ``listener`` from now on (its ``watch`` for admitted
        frames, ``refused`` for frames refused at admission), on the event loop: it must never
        wait. With none, an answer costs nothing more; with one, one call."""
        self._taps.append(listener)
        self._set_results()

    def untap(self, listener: ResultTap) -> None:
        if listener in self._taps:
            self._taps.remove(listener)
        self._set_results()

    def _set_results(self) -> None:
        taps = tuple(self._taps)
        self.results = None if not taps else taps[0] if len(taps) == 1 else _Tee(taps)

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

    # --- statistics and metrics for the front ends ----------------------------------------------

    async def statistics(self, name: str = "", version: str | int | None = None) -> list[Served]:
        """The selected versions with their current ``stats`` (async: a front end in another
        process fetches them from here)."""
        return self.select(name, version)

    def latency_p99(self):
        """Start keeping the last second's latencies; returns the function that reads their p99."""
        if self.latency is None:
            self.latency = LatencyWindow()
        return self.latency.p99

    def _waiting(self, name: str, what: str) -> int:
        return sum(getattr(s.batcher, what) for (n, _), s in list(self.served.items()) if n == name)

    async def metrics_text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest()

    # --- verdict settings ----------------------------------------------------------------------

    async def verdict(self, name: str, changes: Mapping | None = None,
                      caller: Mapping | None = None) -> dict:
        """Model ``name``'s ``[verdict]`` in force; with ``changes``, set those fields first:
        validated by the task's schema (InvalidInput names the field, nothing changes), written
        to its model.toml atomically, and in force for every served version from the next batch
        on (each task swaps its settings whole). Changes of one model run one at a time, so two
        racing requests each apply whole, in some order, and the file holds the last."""
        entry = self.entry(name)
        if changes is None:
            return verdicts.current(entry.config)
        async with self._lock(name):
            entry = self.entries[name]
            old = verdicts.current(entry.config)
            toml = entry.path / "model.toml"
            config, text = await asyncio.to_thread(verdicts.change, toml, changes)
            await asyncio.to_thread(verdicts.write_atomic, toml, text)
            self.entries[name] = dataclasses.replace(entry, config=config)
            section = getattr(config, verdicts.SECTION)
            for (n, _), served in list(self.served.items()):
                if n == name:
                    served.config = served.config.model_copy(
                        update={verdicts.SECTION: section})
                    assert served.task is not None
                    served.task.reconfigure(served.config)
            self.generation += 1
            new = verdicts.current(config)
        who = dict(caller or {})
        audit.info("verdict of model %s changed by %s: %s -> %s", name, _by(who),
                   json.dumps(old), json.dumps(new),
                   extra={"model": name, "audit": {"action": "verdict", "model": name,
                                                   "old": old, "new": new, "caller": who}})
        return new

    # --- the model repository: index, load, unload, poll -----------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _control(self, action: str) -> None:
        mode = self.settings.model_control_mode
        if mode != "explicit":
            why = ("the repository is polled: change its folder instead" if mode == "poll"
                   else "the models of the start are served until it stops")
            raise Conflict(f"model {action} is not allowed with --model-control-mode {mode} "
                           f"({why}); start the server with --model-control-mode explicit")
        if self._draining or not self._ready:
            raise Unavailable(f"model {action} refused: the server is "
                              f"{'shutting down' if self._draining else 'starting'}",
                              retry_after_s=1.0)

    async def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: a row per served (or loading) version, and one without a
        version for a model of the repository that serves none, with the reason."""
        try:
            names = set(self.entries) | {f.name for f in await asyncio.to_thread(
                model_folders, Path(self.settings.models))}
        except ConfigError:
            names = set(self.entries)
        rows = []
        for name in sorted(names):
            versions = sorted(v for n, v in self.served if n == name)
            for v in versions:
                ok = self._ready and self.served[(name, v)].ready
                rows.append({"name": name, "version": str(v),
                             "state": "READY" if ok else "UNAVAILABLE",
                             "reason": "" if ok else "not ready"})
            for v in self._loading.get(name, ()):
                rows.append({"name": name, "version": str(v), "state": "LOADING", "reason": ""})
            if not versions and name not in self._loading:
                rows.append({"name": name, "version": "", "state": "UNAVAILABLE",
                             "reason": self.reasons.get(name, "unloaded")})
        return [r for r in rows if r["state"] == "READY"] if ready else rows

    async def load_model(self, name: str, parameters: Mapping | None = None) -> dict:
        """Load model ``name`` from the repository, or load it again: the versions its
        model.toml and files select now, as one swap (see the module's docstring). A version
        whose file and effective config are unchanged is kept as it serves. InvalidInput for a
        model that does not load (the reason, and the old versions keep serving), Conflict for
        one that does not fit the GPU memory budget beside the old versions."""
        self._control("load")
        for key in parameters or {}:
            if key.startswith(_OVERRIDES):
                raise InvalidInput(f"load parameter {key!r} (a model given in the request) is not "
                                   "supported: change the model's folder in the repository, then "
                                   "load it")
        folder = folder_of(Path(self.settings.models), name)
        async with self._lock(name):
            return await self._swap(name, folder)

    async def unload_model(self, name: str, parameters: Mapping | None = None) -> dict:
        """Unload every version of model ``name``; its requests are answered 503 from then on.
        A model in use (frames queued or running, or answered in the last ``IN_USE_S`` s) is
        refused (Conflict) unless ``parameters["force"]`` is true."""
        self._control("unload")
        self.entry(name)
        force = (parameters or {}).get("force", False)
        if not isinstance(force, bool):
            raise InvalidInput(f"parameter force must be true or false, got {force!r}")
        async with self._lock(name):
            gone = [s for (n, _), s in self.served.items() if n == name]
            if gone and not force:
                busy = self._in_use(gone)
                if busy:
                    raise Conflict(f"model {name} is in use ({busy}): not unloaded. Unloading it "
                                   "stops its line: its requests get 503. Send parameters "
                                   '{"force": true} to unload it all the same')
            return await self._switch(name, None, gone, "unloaded" + (" (forced)" if force
                                                                       and gone else ""))

    def _in_use(self, served: list[Served]) -> str:
        """Why ``served`` counts as in use ('' when it does not)."""
        queued = sum(s.batcher.queue_depth + s.batcher.inflight for s in served)
        if queued:
            return f"{queued} frames or batches queued or running"
        last = max(s.stats.last_inference_ms for s in served) / 1000
        ago = time.time() - last
        return f"last frame answered {ago:.0f} s ago" if ago < IN_USE_S else ""

    async def _swap(self, name: str, folder: Path, sig: tuple | None = None) -> dict:
        """Read ``folder`` again and serve what it says (called under the model's lock)."""
        if sig is None:
            sig = await asyncio.to_thread(signature, folder)
        old = {v: s for (n, v), s in self.served.items() if n == name}
        try:
            entry = await asyncio.to_thread(load_entry, folder)
            config = effective_config(entry.config, self.settings)
            stamps = await asyncio.to_thread(lambda: {v: _file_stamp(p)
                                                      for v, p in entry.versions.items()})
        except (ConfigError, OSError) as exc:
            reason = exc.message if isinstance(exc, ConfigError) else str(exc)
            raise self._failed(name, sig, reason, sorted(old)) from None
        keep = {v: s for v, s in old.items()
                if v in entry.versions and s.config == config and s.source == stamps[v]}
        todo = sorted(v for v in entry.versions if v not in keep)
        if self.gpu is not None:
            self.gpu.check_beside(name, [(s.name, s.config, s.load_id)
                                         for s in self.served.values()], [config] * len(todo))
        new: dict[int, Served] = {}
        self._loading[name] = todo
        loop = asyncio.get_running_loop()
        try:
            for v in todo:
                new[v] = await self._load(entry, v, entry.versions[v], loop)
        except BaseException as exc:
            for s in new.values():
                await self._release(s)
            if not isinstance(exc, Exception):
                raise
            reason = exc.message if isinstance(exc, VisionServeError) else \
                f"{type(exc).__name__}: {exc}"
            raise self._failed(name, sig, reason, sorted(old)) from None
        finally:
            self._loading.pop(name, None)
        self._signatures[name] = sig
        gone = [s for v, s in old.items() if v not in keep]
        return await self._switch(name, entry, gone, "", {**keep, **new}, todo)

    def _failed(self, name: str, sig: tuple, reason: str, serving: list[int]) -> InvalidInput:
        """A load of model ``name`` failed (``reason``): logged, remembered (a poll tries again
        once its folder changes), and the error to answer."""
        self._signatures[name] = sig
        keeps = f"; version(s) {serving} keep serving" if serving else ""
        if not serving:
            self.reasons[name] = f"load failed: {reason}"
        log.error("model %s not loaded: %s%s", name, reason, keeps)
        return InvalidInput(f"model {name} not loaded: {reason}{keeps}")

    async def _switch(self, name: str, entry: ModelEntry | None, gone: list[Served],
                      reason: str, serving: Mapping[int, Served] | None = None,
                      loaded: Iterable[int] = ()) -> dict:
        """Serve ``serving`` as model ``name``'s versions from now on (none: ``reason`` says
        why), in one step; then drain and release ``gone``."""
        served = {k: s for k, s in self.served.items() if k[0] != name}
        served.update({(name, v): s for v, s in sorted((serving or {}).items())})
        # the switch: nothing is awaited from here to the assignment, so a request admitted
        # before it is on the old versions and one admitted after it on the new
        if entry is not None:
            self.entries[name] = entry
        if serving:
            self.reasons.pop(name, None)
        else:
            self.reasons[name] = reason
        self.served = served
        switched = time.monotonic()
        self.generation += 1
        for fn in self.on_change:
            fn()
        for v in serving or {}:
            metrics.READY.labels(name, str(v)).set(1)
        log.info("model %s: serving version(s) %s from now on (loaded %s, unloading %s)", name,
                 sorted(serving or ()), sorted(loaded), sorted(s.version for s in gone))
        t0 = time.monotonic()
        for s in gone:
            await self._release(s, self.settings.drain_timeout_s)
        if self.gpu is not None and (gone or loaded):
            # the gone versions' memory back to the budget; from here serving allocates nothing
            await self.gpu.settled([s.load_id for s in gone])
        if gone:
            log.info("model %s: version(s) %s drained and unloaded in %.2f s", name,
                     sorted(s.version for s in gone), time.monotonic() - t0)
        return {"model": name, "versions": [str(v) for v in sorted(serving or ())],
                "loaded": [str(v) for v in loaded],
                "unloaded": [str(s.version) for s in gone if (name, s.version) not in served],
                "switched_at": switched}

    async def _poll(self) -> None:
        """--model-control-mode poll: read the repository every repository_poll_secs."""
        while True:
            await asyncio.sleep(self.settings.repository_poll_secs)
            try:
                await self.poll_once()
            except Exception:
                log.exception("reading the model repository failed; trying again in %g s",
                              self.settings.repository_poll_secs)

    async def poll_once(self) -> None:
        """Swap each model whose folder changed since it was read (a new folder is loaded), and
        unload the models whose folder is gone. A failure is logged; the old versions serve."""
        root = Path(self.settings.models)
        try:
            folders = {f.name: f for f in await asyncio.to_thread(model_folders, root)}
        except ConfigError as exc:
            log.error("model repository poll: %s; the models keep serving", exc.message)
            return
        for name, folder in folders.items():
            sig = await asyncio.to_thread(signature, folder)
            if sig == self._signatures.get(name) or sig == ("unreadable",):
                continue
            log.info("model repository poll: model %s changed on disk; loading it", name)
            try:
                async with self._lock(name):
                    await self._swap(name, folder, sig)
            except VisionServeError as exc:
                log.error("model repository poll: %s", exc.message)
        for name in [n for n in self._signatures if n not in folders]:
            del self._signatures[name]
            gone = [s for (n, _), s in self.served.items() if n == name]
            if gone:
                log.warning("model repository poll: the folder of model %s is gone; unloading it "
                            "(its requests get 503)", name)
                async with self._lock(name):
                    await self._switch(name, None, gone, "unloaded (its folder was removed)")

    # --- inference ---------------------------------------------------------------------------

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
        request's VisionServeError (any other error: a bug, the front end answers 500).

        The answer is counted and recorded here, once, whoever waits for it. Cancelling the
        future drops the frames not yet run, uncounted (the one who cancelled answers, and
        counts, the request). An unknown model or version raises at once, uncounted: the front
        end that asked counts it as one it refused."""
        arrival = time.monotonic() if arrival is None else arrival
        served = self.get(name, version)
        answer = asyncio.get_running_loop().create_future()
        try:
            pending = self.admit(served, frames, deadline_ms, priority, arrival, origin)
        except VisionServeError as exc:
            self.count_error(name, exc, len(frames))
            # a refusal needs no traceback, and this one would keep the frames (this function's)
            # and the answer that holds it in a cycle until the collector runs; with
            # zero-copy mode the frames are arena space the front end cannot reuse
            answer.set_exception(exc.with_traceback(None))
            return answer
        except Exception:  # a bug: the front end answers 500
            self.count_error(name, "internal", len(frames))
            raise
        futures = [p.future for p in pending]
        done = futures[0] if len(futures) == 1 else asyncio.gather(*futures)

        def answered(f: asyncio.Future) -> None:
            # a gather whose frames were cancelled holds a CancelledError as its exception
            cancelled = f.cancelled() or isinstance(f.exception(), asyncio.CancelledError)
            exc = None if cancelled else f.exception()
            if cancelled or exc is not None:
                for other in futures:  # one frame failed: the request failed, drop the rest
                    other.cancel()
                served.batcher.wake()  # the queue lets them go now
            if answer.done():  # cancelled by the one waiting
                return
            if cancelled:
                answer.cancel()
            elif exc is not None:
                self.count_error(name, exc if isinstance(exc, VisionServeError) else "internal",
                                 len(futures))
                answer.set_exception(exc)
            else:
                results = [f.result()] if len(futures) == 1 else f.result()
                answer.set_result((served, self.finish(served, results, arrival)))

        def abandoned(a: asyncio.Future) -> None:
            if a.cancelled():
                done.cancel()
                # the queue lets the frames go now, not when it next forms a batch (with
                # zero-copy mode a frame held is arena space the front end cannot reuse)
                served.batcher.wake()

        done.add_done_callback(answered)
        answer.add_done_callback(abandoned)
        return answer

    def admit(self, served: Served, frames: list[Frame], deadline_ms: float | None,
              priority: int | None, arrival: float, origin: tuple | None = None) -> list:
        """``_admit``, and each frame's final answer to the taps when any listen (refused frames
        too: the PLC must hear "no decision"). ``origin``: (part id, camera id, station id), each
        optional (``Origin``)."""
        if self.results is None:
            return self._admit(served, frames, deadline_ms, priority, arrival)
        try:
            pending = self._admit(served, frames, deadline_ms, priority, arrival)
        except VisionServeError as exc:
            self.results.refused(served, len(frames), origin, exc)
            raise
        self.results.watch(served, pending, origin)
        return pending

    def precheck(self, name: str, version: str | int | None, n: int, *, deadline_ms: float | None,
                 priority: int | None, arrival: float, origin: tuple | None = None) -> None:
        """Admission from a request's head, before its body is read: raise (counted, and told to
        the PLC bus) what ``admit`` would raise for ``n`` frames now, the 503 of an overloaded
        model above all. Under overload most requests end here, so a refusal costs the server
        no body read, no image check and no copy; what passes is checked again by ``admit``."""
        served = self.get(name, version)
        try:
            self._check(served, n, deadline_ms, priority, arrival)
        except VisionServeError as exc:
            self.count_error(name, exc, n)
            if self.results is not None:
                self.results.refused(served, n, origin, exc)
            raise

    def _check(self, served: Served, n: int, deadline_ms: float | None, priority: int | None,
               arrival: float) -> tuple[float, int, float]:
        """(deadline, priority, predicted seconds to the answer) of ``n`` frames that may be
        queued now; raises a VisionServeError for a request that may not."""
        b = served.config.batching
        if self._draining:
            raise Unavailable.shutting_down()
        if not self._ready or not served.ready:
            raise Unavailable(f"model {served.name} is not ready")
        if not n:
            raise InvalidInput("the request holds no frame")
        if n > b.max_queue_size:
            raise InvalidInput(f"{n} frames in one request; at most {b.max_queue_size}")
        if deadline_ms is None:
            deadline_ms = b.takt_ms
        if not (0 < deadline_ms <= MAX_DEADLINE_MS):
            raise InvalidInput(f"deadline {deadline_ms!r} ms is out of range (0, "
                               f"{MAX_DEADLINE_MS:.0f}]")
        if priority is None:
            priority = b.priority_levels // 2
        if not (0 <= priority < b.priority_levels):
            raise InvalidInput(f"priority {priority!r} is out of range 0..{b.priority_levels - 1}")
        deadline = arrival + deadline_ms / 1000.0
        # 503 at once for a full queue, or for frames the load ahead would answer too late
        predicted = served.batcher.check_capacity(n, deadline=deadline, priority=priority)
        return deadline, priority, predicted

    def _admit(self, served: Served, frames: list[Frame], deadline_ms: float | None,
               priority: int | None, arrival: float) -> list:
        """Check the request and queue its frames; the answers come on the returned items'
        futures (``finish`` records them). Raises a VisionServeError for the whole request."""
        deadline, priority, predicted = self._check(served, len(frames), deadline_ms, priority,
                                                    arrival)
        batcher = served.batcher
        pending = []
        try:
            for f in frames:
                pending.append(batcher.submit(f, deadline=deadline, priority=priority,
                                              arrival=arrival, predicted=predicted))
        except BaseException:
            for p in pending:
                p.future.cancel()
            raise
        if self.latency is not None:
            self.latency.track(pending)  # answered and LATE frames alike, whichever front end waits
        return pending

    def finish(self, served: Served, results: list[FrameResult],
               arrival: float) -> list[FrameResult]:
        """Statistics and metrics of an answered request (each result is in time: a frame whose
        answer was ready after its deadline fails with DeadlineExceeded, see ``count_error``)."""
        now = time.monotonic()
        served.stats.success.add(now - arrival, len(results))
        served.stats.inference_count += len(results)
        served.stats.last_inference_ms = int(time.time() * 1000)
        m = served.series
        m.success.inc()
        for r in results:
            m.frames(r.verdict).inc()
            m.request_seconds.observe(r.total_ms / 1000)
        return list(results)

    def count_error(self, model: str, exc: VisionServeError | str, frames: int = 0) -> None:
        """Count a request answered with an error (``exc``, or its kind), once, wherever that was
        decided: here for what the engine answers (``frames``: the request's frames, which it was
        given), and for what a front end refused before the engine saw the request (``frames``
        0), also from a front-end process (the hub forwards it). A LATE answer's frames are
        deadline misses, whichever part of the server found the deadline passed."""
        kind = exc if isinstance(exc, str) else exc.kind
        if not isinstance(exc, str):
            exc.counted = True
        if model not in self.entries:
            model = metrics.UNKNOWN_MODEL
        metrics.REQUESTS.labels(model, kind).inc()
        if frames > 0:
            metrics.FRAMES.labels(model, metrics.FRAME_OUTCOMES.get(kind, "error")).inc(frames)
            if kind == "deadline":
                metrics.DEADLINE_MISSES.labels(model).inc(frames)

    # --- statistics (loop thread) ------------------------------------------------------------

    def _record_batch(self, served: Served, rec: BatchRecord) -> None:
        st = served.stats
        st.execution_count += 1
        for q in rec.queue_s:
            st.queue.add(q)
            served.series.queue_seconds.observe(q)
        st.compute_input.add(rec.prep_s, rec.size)
        st.compute_infer.add(rec.infer_s, rec.size)
        st.compute_output.add(rec.post_s, rec.size)
        bi, bf, bo = st.batch.setdefault(rec.size, (Duration(), Duration(), Duration()))
        bi.add(rec.prep_s)
        bf.add(rec.infer_s)
        bo.add(rec.post_s)
        # deadline passed during decode or compute (metrics: where the request is answered)
        if rec.late:
            st.fail.add(0.0, rec.late)
        m = served.series
        m.batch_size.observe(rec.size)
        m.compute_seconds.observe(rec.prep_s + rec.infer_s + rec.post_s)

    def _record_drop(self, served: Served, reason: str) -> None:
        if reason == "late":  # metrics: where its request is answered (count_error)
            served.stats.fail.add(0.0)


def _by(caller: dict) -> str:
    """Who an audit line names: the credential's identity and the client's address."""
    client = caller.get("client", "?")
    return f"{caller['operator']} from {client}" if caller.get("operator") else client
