"""A port that another program holds: one line naming the port and its option, exit code 2; no
abort, no traceback, no raw gRPC C-core log line before it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from conftest import REPO, free_port


def _serve(models, http_port: int, grpc_port: int, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "visionserve", "serve", "--models", str(models), "--device", "cpu",
         "--http-port", str(http_port), "--grpc-port", str(grpc_port), *extra],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False)


@pytest.mark.parametrize("frontends", ["0", "2"])
@pytest.mark.parametrize("which", ["--http-port", "--grpc-port"])
def test_a_port_in_use_is_one_line_and_exit_2(tiny_repo, which, frontends):
    holder = socket.socket()
    holder.bind(("0.0.0.0", 0))  # the default --host: every IPv4 address
    holder.listen()
    taken = holder.getsockname()[1]
    try:
        ports = (taken, free_port()) if which == "--http-port" else (free_port(), taken)
        run = _serve(tiny_repo, *ports, "--frontends", frontends)
    finally:
        holder.close()
    err = run.stdout + run.stderr
    assert run.returncode == 2, err
    lines = [line for line in err.splitlines() if "cannot listen" in line]
    assert len(lines) == 1, err
    assert f":{taken} ({which})" in lines[0] and "already in use" in lines[0], lines[0]
    for bad in ("terminate called", "Aborted", "Traceback", "add_port.cc", "Failed to add port",
                "GRPC_VERBOSITY", "uvicorn.error"):
        assert bad not in err, err
