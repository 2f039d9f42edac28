"""The served models' lifecycle: what the engine serves, and every change to it while it serves.

The repository is read at start (``scan``: bad model.toml files and recipes fail start-up there).
The served versions change while the engine serves (``load_model``, ``unload_model``, the
repository poll: ``--model-control-mode``), always as a swap: the new versions load and warm up
beside the old ones, then one assignment of ``served`` switches traffic (a request resolves its
version once, at admission, and stays on it), then the old versions drain (their batchers answer
what they hold) and are released. A load that fails or does not fit changes nothing. A model's
``[verdict]`` settings (``verdict``) and the recipe a station runs (``switch_recipe``) change in
place, for the next batch.

The engine builds and releases the versions (``load``, ``release``); this module decides when,
and keeps the repository's index: what loads now, and why a model serves no version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from . import metrics, recipes, verdicts
from .admission import Gate
from .audit import AuditTrail, Entry
from .config import ModelConfig, ServerSettings
from .errors import ConfigError, Conflict, InvalidInput, NotFound, Unavailable, VisionServeError
from .recipes import Assignments
from .repository import (
    ModelEntry,
    folder_of,
    load_entry,
    model_folders,
    scan,
    signature,
    with_default_version,
)
from .served import Served, effective_config, file_stamp

log = logging.getLogger(__name__)

#: a model that answered a frame this recently (or has frames queued or running) is in use: its
#: unload is refused unless forced
IN_USE_S = 30.0
#: load parameters (Triton's) that ask for a model other than the repository's: not supported
_OVERRIDES = ("config", "file:")


class Budget(Protocol):
    """The GPU memory budget as a swap sees it (``GpuReservation``)."""

    def check_beside(self, name: str, serving: Sequence[tuple[str, ModelConfig, int]],
                     adding: Sequence[ModelConfig]) -> None: ...

    async def settled(self, gone: list[int]) -> None: ...


class Models(Protocol):
    """What the lifecycle reads and changes of the engine: the served state the front ends see
    (:class:`visionserve.dataplane.DataPlane`'s ``entries``, ``served`` and ``recipes``), the
    settings generation the front-end processes follow, and the listeners of a swap."""

    entries: dict[str, ModelEntry]
    served: dict[tuple[str, int], Served]
    recipes: Assignments
    #: moves with every change of the served models' settings, recipes or versions
    generation: int

    @property
    def settings(self) -> ServerSettings: ...

    @property
    def gate(self) -> Gate: ...

    @property
    def gpu(self) -> Budget | None: ...

    @property
    def on_change(self) -> list[Callable[[], None]]: ...

    def entry(self, name: str) -> ModelEntry: ...

    def get(self, name: str, version: str | int | None = None) -> Served: ...


#: builds one version and starts it (``Engine._load``)
Load = Callable[[ModelEntry, int, Path, asyncio.AbstractEventLoop], Awaitable[Served]]


class Release(Protocol):
    """Stops one version (``Engine._release``); with ``drain_s``, its batcher first answers what
    it holds, up to that long."""

    def __call__(self, served: Served, drain_s: float | None = None) -> Awaitable[None]: ...


class Lifecycle:
    """Loads, swaps, unloads and polls the served models, and applies verdict and recipe changes
    (see the module's docstring), for ``models`` (the engine)."""

    def __init__(self, models: Models, load: Load, release: Release) -> None:
        self.models = models
        self.settings = models.settings
        self.gate = models.gate
        self.load = load
        self.release = release
        #: every change made for a caller (verdict rules, recipes, loads and unloads) is audited
        self.audit = AuditTrail.from_settings(self.settings)
        # one lock per model serialises its changes: [verdict] settings, loads, unloads
        self._locks: dict[str, asyncio.Lock] = {}
        # model -> versions loading beside the served ones now (the repository index says so)
        self._loading: dict[str, list[int]] = {}
        # model -> why it serves no version (unloaded, or its last load failed)
        self.reasons: dict[str, str] = {}
        # model -> its folder's signature when last read (the repository poll compares it)
        self._signatures: dict[str, tuple] = {}
        self._poller: asyncio.Task | None = None
        self._recipes_file: Path | None = None
        self._recipes_lock = asyncio.Lock()

    def start_polling(self) -> None:
        """--model-control-mode poll: read the repository from now on, until ``stop_polling``."""
        self._poller = asyncio.get_running_loop().create_task(self._poll(),
                                                              name="repository-poll")

    def stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    # --- the repository and the recipes at start -----------------------------------------------

    def scan(self) -> None:
        """Read the repository (fast, synchronous): bad model.toml files fail start-up here, and
        so does a recipes file whose recipes name what the repository does not hold."""
        root = Path(self.settings.models)
        # before the files are read: a change meanwhile is a change to the next poll
        self._signatures = {f.name: signature(f) for f in model_folders(root)}
        self.models.entries = scan(root)
        # bad command-line overrides fail here too, not at load
        for entry in self.models.entries.values():
            effective_config(entry.config.model_copy(update={"name": entry.name}), self.settings)
        path = self.settings.recipes or Path(self.settings.models) / "recipes.toml"
        if self.settings.recipes is not None or path.is_file():
            book = recipes.load(path)
            for recipe in book.recipes.values():
                self._check_recipe(path, recipe)
            self._recipes_file, self.models.recipes = path, book
        # the cameras of --camera NAME=URI beside the recipes file's
        self.models.recipes = recipes.with_cameras(self.models.recipes, self.settings.camera)

    def _check_recipe(self, path: Path, recipe: recipes.Recipe) -> None:
        where = f"recipes file {path}: recipe {recipe.id!r}"
        if recipe.model not in self.models.entries:
            raise ConfigError(f"{where} names model {recipe.model!r}, which the repository does "
                              f"not hold (models: {sorted(self.models.entries)})")
        entry = self.models.entries[recipe.model]
        if recipe.version is not None and recipe.version not in entry.versions:
            raise ConfigError(f"{where} names version {recipe.version} of {recipe.model}, which "
                              f"the repository does not hold (versions: {sorted(entry.versions)})")
        if recipe.verdict:
            try:
                verdicts.change(entry.path / "model.toml", recipe.verdict)
            except VisionServeError as exc:
                raise ConfigError(f"{where}: its verdict settings do not fit model "
                                  f"{recipe.model}: {exc.message}") from None

    async def resume_recipes(self) -> None:
        """The verdict settings of the recipes the stations run (from the state file, else the
        recipes file) in force before the first frame; stations that share a model with
        different settings fail start-up."""
        wanted: dict[str, dict] = {}
        for station, rid in sorted(self.models.recipes.stations.items()):
            recipe = None if rid is None else self.models.recipes.recipes[rid]
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
            now = verdicts.current(self.models.entries[model].config)
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
            book = self.models.recipes
            if station not in book.stations:
                raise NotFound(f"unknown station {station!r}; stations: {sorted(book.stations)}")
            recipe = book.recipes.get(recipe_id)
            if recipe is None:
                raise NotFound(f"unknown recipe {recipe_id!r}; recipes: {sorted(book.recipes)}")
            served = self.models.get(recipe.model, recipe.version)
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
                now = verdicts.current(self.models.entries[recipe.model].config)
                if any(now.get(k) != v for k, v in recipe.verdict.items()):
                    await self.verdict(recipe.model, recipe.verdict, caller)
            self.models.recipes = dataclasses.replace(book, stations={**book.stations,
                                                                       station: recipe_id})
            self.models.generation += 1
            persisted = True
            if self._recipes_file is not None:
                try:
                    await asyncio.to_thread(recipes.write_state,
                                            recipes.state_path(self._recipes_file),
                                            self.models.recipes.stations)
                except ConfigError as exc:
                    persisted = False
                    log.warning("station %s runs recipe %s, but after a restart it would not: %s",
                                station, recipe_id, exc.message)
        ms = (time.monotonic() - t0) * 1000
        change = Entry("recipe", "station", station, old, recipe_id, dict(caller or {}))
        await self.audit.arecord(change, "station %s switched from recipe %s to %s by %s in "
                                 "%.1f ms", station, old, recipe_id, change.by(), ms)
        return {"station": station, **recipe.view(), "version": served.version,
                "previous": old, "changeover_ms": round(ms, 3), "persisted": persisted}

    # --- verdict settings ----------------------------------------------------------------------

    async def verdict(self, name: str, changes: Mapping | None = None,
                      caller: Mapping | None = None) -> dict:
        """Model ``name``'s ``[verdict]`` in force; with ``changes``, set those fields first:
        validated by the task's schema (InvalidInput names the field, nothing changes), written
        to its model.toml atomically, and in force for every served version from the next batch
        on (each task swaps its settings whole). Changes of one model run one at a time, so two
        racing requests each apply whole, in some order, and the file holds the last."""
        entry = self.models.entry(name)
        if changes is None:
            return verdicts.current(entry.config)
        async with self._lock(name):
            entry = self.models.entries[name]
            old = verdicts.current(entry.config)
            toml = entry.path / "model.toml"
            config, text = await asyncio.to_thread(verdicts.change, toml, changes)
            await asyncio.to_thread(verdicts.write_atomic, toml, text)
            self.models.entries[name] = dataclasses.replace(entry, config=config)
            section = getattr(config, verdicts.SECTION)
            for (n, _), served in list(self.models.served.items()):
                if n == name:
                    served.config = served.config.model_copy(
                        update={verdicts.SECTION: section})
                    assert served.task is not None
                    served.task.reconfigure(served.config)
            self.models.generation += 1
            new = verdicts.current(config)
        change = Entry("verdict", "model", name, old, new, dict(caller or {}))
        await self.audit.arecord(change, "verdict of model %s changed by %s: %s -> %s", name,
                                 change.by(), json.dumps(old), json.dumps(new))
        return new

    async def trial_verdict(self, name: str, changes: Mapping) -> ModelConfig:
        """Model ``name``'s settings with ``changes`` of its ``[verdict]`` set, validated as
        :meth:`verdict` validates them (the same errors); nothing is written or changed (the
        verdict preview)."""
        entry = self.models.entry(name)
        config, _ = await asyncio.to_thread(verdicts.change, entry.path / "model.toml", changes)
        return config

    # --- the model repository: index, load, unload, poll -----------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _control(self, action: str, modes: tuple[str, ...] = ("explicit",)) -> None:
        mode = self.settings.model_control_mode
        if mode not in modes:
            why = ("the repository is polled: change its folder instead" if mode == "poll"
                   else "the models of the start are served until it stops")
            raise Conflict(f"model {action} is not allowed with --model-control-mode {mode} "
                           f"({why}); start the server with --model-control-mode "
                           f"{' or '.join(modes)}")
        if self.gate.draining or not self.gate.started:
            raise Unavailable(f"model {action} refused: the server is "
                              f"{'shutting down' if self.gate.draining else 'starting'}",
                              retry_after_s=1.0)

    async def repository_index(self, ready: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: a row per served (or loading) version, and one without a
        version for a model of the repository that serves none, with the reason."""
        try:
            names = set(self.models.entries) | {f.name for f in await asyncio.to_thread(
                model_folders, Path(self.settings.models))}
        except ConfigError:
            names = set(self.models.entries)
        rows = []
        for name in sorted(names):
            versions = sorted(v for n, v in self.models.served if n == name)
            for v in versions:
                ok = self.gate.started and self.models.served[(name, v)].ready
                rows.append({"name": name, "version": str(v),
                             "state": "READY" if ok else "UNAVAILABLE",
                             "reason": "" if ok else "not ready"})
            for v in self._loading.get(name, ()):
                rows.append({"name": name, "version": str(v), "state": "LOADING", "reason": ""})
            if not versions and name not in self._loading:
                rows.append({"name": name, "version": "", "state": "UNAVAILABLE",
                             "reason": self.reasons.get(name, "unloaded")})
        return [r for r in rows if r["state"] == "READY"] if ready else rows

    async def load_model(self, name: str, parameters: Mapping | None = None,
                         caller: Mapping | None = None) -> dict:
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
            before = self._versions(name)
            done = await self._swap(name, folder)
        await self._audit_versions("model-load", name, before, done, caller)
        return done

    async def reload_model(self, name: str, action: str,
                           default_version: int | None = None) -> dict:
        """Read model ``name``'s folder again and serve the versions it selects now, as
        :meth:`load_model`'s swap (the same refusals), for a change the server made to the
        folder itself (``action``, for the refusal: a promotion or a rollback): allowed with
        ``--model-control-mode explicit`` and ``poll`` (where the poll would find the change
        later). ``default_version``: where model.toml names a default version, set it to this
        one first (written back as it was if the swap fails). Not audited here: the caller
        keeps the entry of the change it made."""
        self._control(action, ("explicit", "poll"))
        folder = folder_of(Path(self.settings.models), name)
        toml = folder / "model.toml"
        async with self._lock(name):
            before = None
            if default_version is not None:
                text = await asyncio.to_thread(toml.read_text, encoding="utf-8")
                new = with_default_version(text, default_version)
                if new is not None:
                    await asyncio.to_thread(verdicts.write_atomic, toml, new)
                    before = text
            try:
                return await self._swap(name, folder)
            except BaseException:
                if before is not None:
                    await asyncio.to_thread(verdicts.write_atomic, toml, before)
                raise

    async def unload_model(self, name: str, parameters: Mapping | None = None,
                           caller: Mapping | None = None) -> dict:
        """Unload every version of model ``name``; its requests are answered 503 from then on.
        A model in use (frames queued or running, or answered in the last ``IN_USE_S`` s) is
        refused (Conflict) unless ``parameters["force"]`` is true."""
        self._control("unload")
        self.models.entry(name)
        force = (parameters or {}).get("force", False)
        if not isinstance(force, bool):
            raise InvalidInput(f"parameter force must be true or false, got {force!r}")
        async with self._lock(name):
            gone = [s for (n, _), s in self.models.served.items() if n == name]
            if gone and not force:
                busy = self._in_use(gone)
                if busy:
                    raise Conflict(f"model {name} is in use ({busy}): not unloaded. Unloading it "
                                   "stops its line: its requests get 503. Send parameters "
                                   '{"force": true} to unload it all the same')
            before = self._versions(name)
            done = await self._switch(name, None, gone, "unloaded" + (" (forced)" if force
                                                                       and gone else ""))
        await self._audit_versions("model-unload", name, before, done, caller)
        return done

    def _versions(self, name: str) -> list[str]:
        return [str(v) for n, v in sorted(self.models.served) if n == name]

    async def _audit_versions(self, action: str, name: str, before: list[str], done: dict,
                              caller: Mapping | None) -> None:
        """The audit entry of a load or unload: the versions served before and after."""
        change = Entry(action, "model", name, {"versions": before},
                       {"versions": done["versions"]}, dict(caller or {}))
        await self.audit.arecord(change, "model %s %s by %s: version(s) %s -> %s", name,
                                 "loaded" if action == "model-load" else "unloaded", change.by(),
                                 before, done["versions"])

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
        old = {v: s for (n, v), s in self.models.served.items() if n == name}
        try:
            entry = await asyncio.to_thread(load_entry, folder)
            config = effective_config(entry.config, self.settings)
            stamps = await asyncio.to_thread(lambda: {v: file_stamp(p)
                                                      for v, p in entry.versions.items()})
        except (ConfigError, OSError) as exc:
            reason = exc.message if isinstance(exc, ConfigError) else str(exc)
            raise self._failed(name, sig, reason, sorted(old)) from None
        keep = {v: s for v, s in old.items()
                if v in entry.versions and s.config == config and s.source == stamps[v]}
        todo = sorted(v for v in entry.versions if v not in keep)
        gpu = self.models.gpu
        if gpu is not None:
            gpu.check_beside(name, [(s.name, s.config, s.load_id)
                                    for s in self.models.served.values()], [config] * len(todo))
        new: dict[int, Served] = {}
        self._loading[name] = todo
        loop = asyncio.get_running_loop()
        try:
            for v in todo:
                new[v] = await self.load(entry, v, entry.versions[v], loop)
        except BaseException as exc:
            for s in new.values():
                await self.release(s)
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
        served = {k: s for k, s in self.models.served.items() if k[0] != name}
        served.update({(name, v): s for v, s in sorted((serving or {}).items())})
        # the switch: nothing is awaited from here to the assignment, so a request admitted
        # before it is on the old versions and one admitted after it on the new
        if entry is not None:
            self.models.entries[name] = entry
        if serving:
            self.reasons.pop(name, None)
        else:
            self.reasons[name] = reason
        self.models.served = served
        switched = time.monotonic()
        self.models.generation += 1
        for fn in self.models.on_change:
            fn()
        for v in serving or {}:
            metrics.READY.labels(name, str(v)).set(1)
        log.info("model %s: serving version(s) %s from now on (loaded %s, unloading %s)", name,
                 sorted(serving or ()), sorted(loaded), sorted(s.version for s in gone))
        t0 = time.monotonic()
        for s in gone:
            await self.release(s, self.settings.drain_timeout_s)
        gpu = self.models.gpu
        if gpu is not None and (gone or loaded):
            # the gone versions' memory back to the budget; from here serving allocates nothing
            await gpu.settled([s.load_id for s in gone])
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
            gone = [s for (n, _), s in self.models.served.items() if n == name]
            if gone:
                log.warning("model repository poll: the folder of model %s is gone; unloading it "
                            "(its requests get 503)", name)
                async with self._lock(name):
                    await self._switch(name, None, gone, "unloaded (its folder was removed)")

