"""The front ends and batch workers the server chooses when the settings leave them to it."""

from __future__ import annotations

import logging

import pytest

from visionserve.config import ServerSettings
from visionserve.runtime.startup import choose_execution


@pytest.mark.parametrize("cores, frontends, workers", [
    (16, 8, 3), (64, 8, 3), (8, 4, 2), (4, 2, 1), (3, 0, 0), (2, 0, 0), (1, 0, 0)])
def test_on_a_gpu_the_cores_decide(cores, frontends, workers, caplog):
    with caplog.at_level(logging.INFO, logger="visionserve"):
        chosen = choose_execution(ServerSettings(), on_gpu=True, cores=cores)
    assert (chosen.frontends, chosen.gpu_batch_processes) == (frontends, workers)
    assert f"execution: {frontends} front-end process(es), {workers} batch worker(s)" \
        in caplog.text
    assert f"{cores} cores, a GPU" in caplog.text


def test_on_the_cpu_everything_stays_in_the_serving_process():
    chosen = choose_execution(ServerSettings(), on_gpu=False, cores=32)
    assert (chosen.frontends, chosen.gpu_batch_processes) == (0, 0)


def test_with_the_guard_batch_workers_only_when_named():
    chosen = choose_execution(ServerSettings(guard=True), on_gpu=True, cores=16)
    assert (chosen.frontends, chosen.gpu_batch_processes) == (8, 0)
    named = choose_execution(ServerSettings(guard=True, gpu_batch_processes=2), on_gpu=True,
                             cores=16)
    assert (named.frontends, named.gpu_batch_processes) == (8, 2)


def test_what_the_user_set_is_kept(monkeypatch):
    given = ServerSettings(frontends=0)
    chosen = choose_execution(given, on_gpu=True, cores=16)
    assert (chosen.frontends, chosen.gpu_batch_processes) == (0, 3)
    both = ServerSettings(frontends=2, gpu_batch_processes=0)
    assert choose_execution(both, on_gpu=True, cores=16) is both
    monkeypatch.setenv("VISIONSERVE_GPU_BATCH_PROCESSES", "1")
    chosen = choose_execution(ServerSettings(), on_gpu=True, cores=16)
    assert (chosen.frontends, chosen.gpu_batch_processes) == (8, 1)


def test_the_switch_interval_follows_the_chosen_front_ends():
    assert choose_execution(ServerSettings(), on_gpu=True, cores=16) \
        .serving_switch_interval_s() == 0.005
    assert choose_execution(ServerSettings(), on_gpu=False, cores=16) \
        .serving_switch_interval_s() == 0.0005
