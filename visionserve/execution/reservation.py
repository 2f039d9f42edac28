"""The engine's view of a GPU: reserve the memory budget, then serve.

:class:`GpuReservation` is the one object the engine talks to: it plans and checks the budget
(:mod:`visionserve.gpu.memory`) before the models load, gives each instance its share and says
where its batches are prepared and run (:meth:`GpuReservation.placement`: a GPU preprocessor,
:mod:`visionserve.gpu.preprocess`, in the serving process or in worker processes), marks the
allocator when ready and publishes telemetry (:mod:`visionserve.gpu.telemetry`). It sits above
those three, which never import it (nor each other, but for the preprocessor using the staging
pool of the memory module).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..config import ModelConfig, parse_bytes
from ..errors import ConfigError, Conflict
from ..gpu.memory import (
    MIB,
    AllocationWatch,
    BudgetPlan,
    allocator_stats,
    cap_torch_allocator,
    check_free,
    pinned_gpu,
    plan_budget,
    prep_allowance,
    reserve_small_pool,
)
from .placement import InProcess, InWorkers, Placement

if TYPE_CHECKING:
    from pathlib import Path

    from ..backends.base import Backend
    from ..gpu.nvml import GpuInfo, Nvml
    from ..tasks import Task
    from .workers import WorkerPool

log = logging.getLogger(__name__)


class GpuReservation:
    """What the engine does on a GPU: plan and check the budget before loading, cap the
    allocators, give each instance its share and its placement, mark the allocator when
    ready, publish telemetry. One object, so ``engine.py`` needs only a few calls."""

    RETRY_S = 5.0  # how often an unavailable budget is checked again
    LOG_EVERY_S = 60.0

    def __init__(self, server_budget: str | None, device: str, nvml: Nvml | None = None,
                 one_call: bool = True, prep_processes: int = 0,
                 batch_processes: int = 0) -> None:
        self.server_budget = server_budget
        self.device = device
        self.one_call = one_call  # TorchPreprocessor's one-call preparation (onecall.py)
        # prepare-only worker processes: 0 in the server (slower than the serving process's)
        self.prep_processes = prep_processes
        self.batch_processes = batch_processes  # ... preparing and running them
        self._nvml = nvml
        self.plan = BudgetPlan(total=None)
        self.watch = AllocationWatch(device)
        # the serving runners' CUDA streams (each has its own block pool), by the load of the
        # model version whose runner they serve (Served.load_id)
        self.streams: dict[int, list[Any]] = {}
        # device bytes each load took (Served.load_id -> bytes), for the swaps' budget check
        self.footprints: dict[int, int] = {}
        # the worker processes of each load (--gpu-batch-processes) and
        # the device bytes their allocators may hold, which the serving process's cap leaves
        self.workers: dict[int, list[WorkerPool]] = {}
        self.worker_bytes: dict[int, int] = {}
        self.gpu: GpuInfo | None = None
        self.telemetry: Any = None

    @property
    def nvml(self) -> Nvml:
        if self._nvml is None:
            from ..gpu.nvml import real_nvml

            self._nvml = real_nvml()
        return self._nvml

    async def reserve(self, models: Sequence[tuple[str, ModelConfig]]) -> None:
        """Plan the budget; wait (not ready, saying why) until NVML shows it free; cap torch."""
        import asyncio
        import time

        self.plan = plan_budget(self.server_budget, models)
        self.gpu = pinned_gpu(self.nvml)
        if self.plan.total is not None and self.gpu is not None:
            last_log = -1e9
            while True:
                check = await asyncio.to_thread(check_free, self.nvml, self.gpu, self.plan.total)
                if check.ok:
                    log.info("%s", check.message(f"GPU {self.gpu.uuid}"))
                    break
                if time.monotonic() - last_log >= self.LOG_EVERY_S:
                    log.error("%s", check.message(f"GPU {self.gpu.uuid}"))
                    last_log = time.monotonic()
                await asyncio.sleep(self.RETRY_S)
        if self.plan.torch_cap is not None:
            await asyncio.to_thread(cap_torch_allocator, self.plan.torch_cap, self.device)

    def instance_config(self, name: str, config: ModelConfig) -> ModelConfig:
        """The config one instance loads with: runtime.gpu_memory_budget = its arena's share."""
        share = self.plan.share_of(name)
        if share is None or not share.ort_limit_per_instance:
            return config
        runtime = config.runtime.model_copy(
            update={"gpu_memory_budget": str(share.ort_limit_per_instance)})
        return config.model_copy(update={"runtime": runtime})

    def share(self, name: str, config: ModelConfig, measured: int | None = None) -> int:
        """Device bytes one served version of model ``name`` holds: its own
        ``runtime.gpu_memory_budget``, else what a load of it was measured to take
        (``measured``), else its share of the start-up plan."""
        if config.runtime.gpu_memory_budget is not None:
            return parse_bytes(config.runtime.gpu_memory_budget)
        if measured is not None:
            return measured
        planned = self.plan.share_of(name)
        if planned is None:
            raise ConfigError(f"model {name} was not planned into the GPU memory budget at "
                              "start-up: give it runtime.gpu_memory_budget to load it later")
        return planned.share

    def check_beside(self, name: str, serving: Sequence[tuple[str, ModelConfig, int]],
                     adding: Sequence[ModelConfig]) -> None:
        """Conflict unless ``adding`` (versions of model ``name`` to load) fits the budget beside
        every version ``serving`` now ((name, config, load id)): a swap holds the old and the new
        versions at once, until the old has drained. A version without a budget of its own
        counts what its load was measured to take (:meth:`measure`), and a new version of a
        model what its serving version takes: a model's share of the start-up plan is all that
        was free for it, so with it no swap would ever fit. Nothing to check without a budget
        (nothing is capped)."""
        if self.plan.total is None or not adding:
            return
        same = [self.footprints[i] for n, _, i in serving if n == name and i in self.footprints]
        try:
            held = sum(self.share(n, c, self.footprints.get(i)) for n, c, i in serving)
            need = sum(self.share(name, c, max(same) if same else None) for c in adding)
        except ConfigError as exc:
            raise Conflict(f"model {name} not loaded: {exc.message}") from None
        if held + need > self.plan.total:
            raise Conflict(
                f"model {name} not loaded: its {len(adding)} version(s) need {need / MIB:.0f} "
                f"MiB of GPU memory beside the {held / MIB:.0f} MiB the serving versions hold, "
                f"over the budget of {self.plan.total / MIB:.0f} MiB (--gpu-memory-budget); the "
                "serving versions keep serving. A swap holds the old and the new version at "
                "once: leave room for both, or unload a model first")

    def device_bytes(self) -> int:
        """What live blocks of the torch allocator hold on the device now (CUDA graphs' pools,
        buffers): cached free blocks are not counted, any load may reuse them."""
        import torch

        return int(torch.cuda.memory_allocated(self.device))

    def measure(self, load_id: int, before: int) -> None:
        """Record what load ``load_id`` took: the allocator's bytes now over ``before``, and
        its worker processes' allocators."""
        self.footprints[load_id] = (max(0, self.device_bytes() - before)
                                    + self.worker_bytes.get(load_id, 0))

    async def settled(self, gone: list[int]) -> None:
        """After a swap: the versions ``gone`` were unloaded (their streams forgotten; their
        memory stays with the torch allocator, within its cap, which gives it back to the device
        when a later load needs the room: an ``empty_cache`` here would give back the serving
        versions' cached blocks too, which they would then allocate again under load, and it
        synchronises the device), the new version's streams got their small-block pools, and
        the allocator's state now is the one to keep: serving adds no device memory from here
        until the next swap."""
        import asyncio

        freed = 0
        for key in gone:
            self.streams.pop(key, None)
            self.footprints.pop(key, None)
            self.workers.pop(key, None)  # closed with their runners
            freed += self.worker_bytes.pop(key, 0)
        if freed and self.plan.torch_cap is not None:  # theirs is the serving process's again
            await asyncio.to_thread(cap_torch_allocator, self._serving_cap(), self.device)
        await asyncio.to_thread(reserve_small_pool, self.device, self._serving_streams())
        self.watch.mark()

    def _serving_cap(self) -> int:
        """The serving process's allocator cap: the plan's, less what the workers hold."""
        assert self.plan.torch_cap is not None
        return self.plan.torch_cap - sum(self.worker_bytes.values())

    def worker_pids(self) -> list[int]:
        """The live worker processes of every load (for telemetry)."""
        return [pid for group in self.workers.values() for w in group for pid in w.pids]

    def _take_for_workers(self, owner: int, workers: WorkerPool, config: ModelConfig,
                          name: str) -> bool:
        """Take what ``workers`` (of load ``owner``) may hold off the serving process's cap;
        False (said in the log) where that would leave it less than it holds and room for one
        batch's preparation (its own, should the workers go)."""
        need = workers.device_bytes  # 0 on the CPU
        if need and self.plan.torch_cap is not None:
            cap = self._serving_cap() - need
            reserved = allocator_stats(self.device).reserved_bytes
            if cap < reserved + prep_allowance(config):
                log.warning("%s: its %d worker process(es) need %.0f MiB of GPU memory, and the "
                            "budget leaves %.0f MiB beside the %.0f MiB the serving process "
                            "holds (--gpu-memory-budget): its batches are prepared and run in "
                            "the serving process", name, len(workers.pids), need / MIB,
                            max(0, self._serving_cap() - reserved) / MIB, reserved / MIB)
                return False
            cap_torch_allocator(cap, self.device)
            log.info("%s: %.0f MiB of the GPU memory budget for its worker process(es)", name,
                     need / MIB)
        self.workers.setdefault(owner, []).append(workers)
        self.worker_bytes[owner] = self.worker_bytes.get(owner, 0) + need
        return True

    def _serving_streams(self) -> list[Any]:
        return [s for streams in self.streams.values() for s in streams]

    def placement(self, backend: Backend, config: ModelConfig, preferred: tuple[int, ...],
                  owner: int, pool_key: tuple | None = None, model_path: Path | None = None,
                  task: Task | None = None) -> Placement:
        """Where the batches of ``backend`` (of the load ``owner``) are prepared and run: with
        a warmed-up GPU preprocessor in this process, or on the CPU where the backend cannot
        take device tensors (no stream: e.g. onnxruntime without torch CUDA). Preprocessors of
        one ``pool_key`` (the versions of a model instance) share their pinned staging pool.
        With ``prep_processes`` worker processes prepare the batches
        (:class:`.workers.WorkerPool`), and this process's preprocessor is their fallback. With
        ``batch_processes`` they also run the model (loaded from ``model_path`` with the
        backend's config) and answer with its outputs, unless ``task`` reads them on the
        device; the fallback is then this process's preparation and ``backend``."""
        if not backend.takes_device_input:
            return InProcess(None, "CPU preprocessing: the backend takes host input")
        from ..gpu.preprocess import TorchPreprocessor

        prep = TorchPreprocessor.for_config(config, device=self.device, dtype=backend.input_dtype,
                                            stream=backend.stream,
                                            channels_last=backend.channels_last,
                                            pool_key=pool_key, one_call=self.one_call)
        prep.warmup(preferred)
        streams = self.streams.setdefault(owner, [])
        streams.append(backend.stream)
        if prep.decode_stream is not None:  # the decoded images' blocks live in its pool
            streams.append(prep.decode_stream)
        name = "#".join(map(str, pool_key)) if pool_key else ""
        here = f"GPU preprocessing on {self.device}"
        model = None
        if self.batch_processes:
            on_device = task is not None and task.on_device
            if model_path is None or backend.config is None or on_device:
                log.info("%s: its batches are run in the serving process: batch workers need a "
                         "task that reads the model's outputs on the host", name)
                return InProcess(prep.prepare, f"{here}; batch workers need a task that reads "
                                               "the model's outputs on the host")
            model = {"path": str(model_path), "config": backend.config.model_dump(mode="json")}
        if self.prep_processes or model is not None:
            from .workers import WorkerPool

            count = self.batch_processes or self.prep_processes
            workers = WorkerPool(config, prep, device=self.device, dtype=backend.input_dtype,
                                 channels_last=backend.channels_last, one_call=self.one_call,
                                 preferred=preferred, workers=count, name=name, model=model)
            if workers.start() and self._take_for_workers(owner, workers, config, name):
                return InWorkers(workers, f"--gpu-batch-processes {count}" if model is not None
                                 else f"{here} in the workers")
            workers.close()  # none could start or fit (logged): the instance runs in-process
            return InProcess(prep.prepare, f"{here}; its worker processes did not start or fit "
                                           "the GPU memory budget")
        return InProcess(prep.prepare, here)

    def ready(self) -> None:
        """Call when every model is warm: the allocator's state now is the one to keep (with
        the blocks the warm-ups left cached on the runners' streams, which serving reuses)."""
        from ..gpu.telemetry import GpuTelemetry

        reserve_small_pool(self.device, self._serving_streams())
        self.watch.mark()
        self.telemetry = GpuTelemetry(self.nvml, self.gpu.index if self.gpu else None,
                                      self.plan.total,
                                      allocator=lambda: allocator_stats(self.device),
                                      baseline=lambda: self.watch.baseline,
                                      workers=self.worker_pids)
        self.telemetry.update()
        self.telemetry.start()
        log.info("GPU memory after warm-up: %s",
                 self.watch.baseline.as_dict() if self.watch.baseline else {})

    async def close(self) -> None:
        if self.telemetry is not None:
            await self.telemetry.stop()
