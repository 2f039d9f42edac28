"""--hold-on-error (the image sets VISIONSERVE_HOLD_ON_ERROR=true): a start-up that fails says why
once and the process stays up, serving nothing, until SIGTERM; without it, it exits 2 at once.
The container side (unhealthy, no restarts) is in tests/docker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import REPO


def _serve(models, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "visionserve", "serve", "--models", str(models),
                             "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "-1",
                             "--device", "cpu", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def test_empty_repository_without_hold_exits_2(tmp_path):
    proc = _serve(tmp_path)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "holds no model" in err


def test_empty_repository_with_hold_stays_up_then_exits_2_on_sigterm(tmp_path):
    proc = _serve(tmp_path, "--hold-on-error")
    try:
        time.sleep(4)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 2
    lines = [ln for ln in err.splitlines() if "not serving" in ln]
    assert len(lines) == 1 and "holds no model" in lines[0] and str(tmp_path) in lines[0], err
