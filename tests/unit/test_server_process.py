"""The serving process's own settings: the command line maps to them, bad values are refused."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from visionserve.config import ServerSettings
from visionserve.process import run_loop
from visionserve.runtime import serve, startup

REPO = Path(__file__).resolve().parents[2]


def test_switch_interval_is_applied_to_the_serving_process():
    before = sys.getswitchinterval()
    try:
        p = argparse.ArgumentParser()
        serve.add_arguments(p)
        args = p.parse_args(["--switch-interval-ms", "0.25", "--frontends", "3"])
        settings = serve.settings_from(args)
        assert settings.frontends == 3
        startup.apply_process_settings(settings)
        assert sys.getswitchinterval() == pytest.approx(0.00025)
        # the defaults: 0.5 ms with the front end in this process, Python's 5 ms with front-end
        # processes (docs/gpu.md)
        startup.apply_process_settings(ServerSettings())
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        startup.apply_process_settings(ServerSettings(frontends=2))
        assert sys.getswitchinterval() == pytest.approx(0.005)
        startup.apply_process_settings(ServerSettings(frontends=2, switch_interval_ms=0.5))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("option, value, words", [
    ("--switch-interval-ms", "0", "greater than 0"),
    ("--frontends", "-1", "greater than or equal to 0"),
    ("--frontend-arena-bytes", "10", "greater than or equal to 1048576"),
])
def test_bad_process_settings_are_refused_with_exit_2(option, value, words):
    run = subprocess.run([sys.executable, "-m", "visionserve", "serve", option, value,
                          "--device", "cpu"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert run.returncode == 2, run.stderr
    assert option in run.stderr and words in run.stderr and "Traceback" not in run.stderr


def test_the_serving_loop_is_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")

    async def which():
        import asyncio

        return type(asyncio.get_running_loop())

    assert run_loop(which()) is uvloop.Loop


def test_a_child_that_keeps_dying_early_is_started_again_ever_later(monkeypatch):
    """RestartBackoff (front ends and PLC server processes): 1 s, doubling up to 30 s while the
    child dies within 10 s of its start; at once again after one that ran 10 s."""
    import visionserve.process as process

    now = [100.0]
    monkeypatch.setattr(process.time, "monotonic", lambda: now[0])
    b = process.RestartBackoff()
    delays = []
    for _ in range(7):
        b.started()
        now[0] += 0.5
        delays.append(b.delay())
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    b.started()
    now[0] += 10
    assert b.delay() == 0
    b.started()
    now[0] += 1
    assert b.delay() == 1
