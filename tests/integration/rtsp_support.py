"""An RTSP camera for the rtsp:// tests: ``tests/tools/rtsp_server.py`` (GStreamer's RTSP server)
in a process of its own on 127.0.0.1, killed, paused and restarted at will."""

from __future__ import annotations

import functools
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, free_port

TOOL = REPO / "tests" / "tools" / "rtsp_server.py"
PACKAGES = ("gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good "
            "gstreamer1.0-plugins-ugly gir1.2-gstreamer-1.0")


@functools.cache
def skip_reason() -> str | None:
    """Why the rtsp tests cannot run here, or None."""
    check = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, check=False,
                           text=True, timeout=60)
    if check.returncode != 0:
        return (f"no RTSP server to test against: {check.stderr.strip()} (Debian: apt-get "
                f"install {PACKAGES})")
    return None


class RtspServer:
    """The test camera at :attr:`url` (``rtsp://127.0.0.1:PORT/test``), the same port across
    restarts."""

    def __init__(self, log_dir: Path, user: str | None = None, password: str | None = None,
                 digest: bool = False) -> None:
        self.port = free_port()
        self.url = f"rtsp://127.0.0.1:{self.port}/test"
        self.auth = [] if user is None else ["--user", user, "--password", password or ""]
        self.auth += ["--digest"] if digest else []
        self.log_path = log_dir / f"rtsp-server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 15.0) -> None:
        """Start it; returns once it listens."""
        assert self.proc is None, "already running"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(TOOL), "--port", str(self.port), *self.auth],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                pytest.fail(f"{TOOL.name} exited at start: {self.log_path.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.kill()
        pytest.fail(f"{TOOL.name} did not listen on port {self.port} within {timeout_s} s")

    def pause(self) -> None:
        """Stop it without a word (SIGSTOP): the connection stays, nothing comes."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """Kill it (a camera unplugged or rebooting)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.kill()
