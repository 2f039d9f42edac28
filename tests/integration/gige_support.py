"""Aravis's GigE Vision camera simulator (``arv-fake-gv-camera-0.8``, Debian ``aravis-tools``)
on loopback, for the gige:// tests.

The simulator listens on 127.0.0.1:3956, GigE Vision's control port, and will not bind another
loopback address, so one runs at a time on a machine: a simulator holds an exclusive lock file
while it runs (other test processes, pytest-xdist workers included, wait for it). Each test's
simulator has its own serial, and the source opened by serial must find that one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from visionserve.cameras import gige

SIMULATOR = "arv-fake-gv-camera-0.8"
ADDRESS = "127.0.0.1"
LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "visionserve-gige-simulator.lock"
#: the pixel formats the simulator offers
FORMATS = ("Mono8", "Mono16", "RGB8", "BayerRG8", "BayerGB8", "BayerGR8", "BayerBG8")


def skip_reason() -> str | None:
    """Why the gige tests cannot run here, or None."""
    if shutil.which(SIMULATOR) is None:
        return f"{SIMULATOR} is not installed (Debian: apt-get install aravis-tools)"
    return gige.available()


class Simulator:
    """One simulated camera on 127.0.0.1, killed and restarted at will."""

    def __init__(self, serial: str, log_dir: Path) -> None:
        self.serial = serial
        self.log_path = log_dir / f"arv-fake-{serial}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._lock = open(LOCK, "a")  # noqa: SIM115 - held for the simulator's life
        deadline = time.monotonic() + 300
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._lock.close()
                    pytest.fail(f"another GigE simulator held {LOCK} for 5 minutes")
                time.sleep(0.05)

    @property
    def device_id(self) -> str:
        """Aravis's id of the simulated camera."""
        return f"Aravis-Fake-{self.serial}"

    def start(self, timeout_s: float = 10.0, lost_per_1000: int = 0) -> None:
        """Start it and return once it answers discovery with its serial; ``lost_per_1000``:
        stream packets it drops on purpose."""
        assert self.proc is None, "already running"
        lossy = ["-r", str(lost_per_1000)] if lost_per_1000 else []
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([SIMULATOR, "-i", ADDRESS, "-s", self.serial, *lossy],
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                pytest.fail(f"{SIMULATOR} exited at start: {self.log_path.read_text()[-2000:]}")
            found = gige.probe(ADDRESS, 0.1)
            if found is not None and found.serial == self.serial:
                return
            time.sleep(0.02)
        self.kill()
        pytest.fail(f"{SIMULATOR} did not answer within {timeout_s} s (is another one running "
                    f"on {ADDRESS}:{gige.GVCP_PORT}?)")

    def kill(self) -> None:
        """Kill it (a camera unplugged): no goodbye on the wire."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.kill()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
