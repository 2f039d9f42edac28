"""The engine picks each instance's executor from its placement, and says at start-up which it
picked and why (the tiny ONNX model, on the CPU)."""

from __future__ import annotations

import logging

from visionserve.batching import CostModel
from visionserve.config import ModelConfig, ServerSettings
from visionserve.engine import Engine
from visionserve.execution import InProcess, choose
from visionserve.execution.results import padded_size
from visionserve.execution.threads import ThreadExecutor
from visionserve.tasks import create


async def test_on_the_cpu_the_engine_runs_each_instance_in_its_own_threads(tiny_repo, caplog):
    engine = Engine(ServerSettings(models=tiny_repo), device="cpu")
    with caplog.at_level(logging.INFO, logger="visionserve.engine"):
        await engine.start()
    try:
        served = engine.get("tiny")
        assert served.runners and all(type(r) is ThreadExecutor for r in served.runners)
        assert all(r.prepare is None for r in served.runners if isinstance(r, ThreadExecutor))
        said = [r.getMessage() for r in caplog.records if " executes " in r.getMessage()]
        # once per model version, whatever its instances
        assert said == ["tiny:1 executes in the serving process (2 threads; CPU)"], said
    finally:
        await engine.close()


def test_an_instance_placed_in_process_gets_the_preparation_it_was_given():
    config = ModelConfig.model_validate({"name": "m", "input": {"width": 8, "height": 8},
                                         "output": {"labels": ["ok", "ng"]}})

    def prepare(frames, padded):  # pragma: no cover - never called
        raise AssertionError

    class Backend:
        stream = None
        device_outputs = False

    executor = choose(InProcess(prepare, "GPU preprocessing on cuda:0"), name="m:1#0",
                      backend=Backend(),  # type: ignore[arg-type]
                      config=config, preferred=(1, 2),
                      cost=CostModel(lambda n: padded_size(n, (1, 2))),
                      on_batch=lambda r: None, task=create(config), nice=0)
    assert isinstance(executor, ThreadExecutor) and executor.prepare is prepare
    assert executor.describe() == "in the serving process (2 threads; GPU preprocessing on cuda:0)"
    assert (executor.batches_in_flight, executor.full_batches_extra) == (2, 0)
