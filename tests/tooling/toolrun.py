"""Running a tool of visionserve_tools the way a user does, for the tools' dry-run tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_tool(module: str, *args: str, timeout: float) -> tuple[int, str]:
    """``python -m visionserve_tools.<module> args`` from the repository root, in a process
    group of its own: (exit status, output). Past ``timeout`` s the group (the tool, its server
    and its clients) is killed and the test fails with the output's end."""
    old = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO) + (os.pathsep + old if old else "")}
    p = subprocess.Popen([sys.executable, "-m", f"visionserve_tools.{module}", *args],
                         cwd=str(REPO), env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        output, _ = p.communicate()
        pytest.fail(f"{module} did not finish:\n{output[-4000:]}")
    return p.returncode, output
