"""A folder on a file system of its own that a test breaks and mends: a small tmpfs it fills up,
or a bind mount it remounts read-only (root ignores file modes, not a read-only mount). Needs root
(mount): :func:`mount_disk` skips otherwise. Used by the guard's and the records' fault tests."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest


class Disk:
    """A folder on a file system of its own: ``full`` (a tmpfs of ``size``, 4 MiB by default,
    filled on :meth:`fail`, or by what the test writes) or ``readonly`` (a bind mount, remounted
    read-only on :meth:`fail`)."""

    def __init__(self, root: Path, kind: str, size: str = "4m") -> None:
        self.kind, self.dir = kind, root / "disk"
        self.dir.mkdir()
        if kind == "full":
            self._mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.dir))
        else:
            (root / "backing").mkdir()
            self._mount("--bind", str(root / "backing"), str(self.dir))
        self.mounted = True

    @staticmethod
    def _mount(*args: str) -> None:
        r = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
        if r.returncode:
            raise OSError(errno.EPERM, f"mount {' '.join(args)}: {r.stderr.strip()}")

    def _remount(self, mode: str) -> None:
        # EBUSY while a connection of the guard is open for writing: try again
        end = time.monotonic() + 10
        while True:
            try:
                return self._mount("-o", f"remount,{mode},bind", str(self.dir))
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.01)

    def fail(self) -> None:
        if self.kind == "readonly":
            return self._remount("ro")
        fd = os.open(self.dir / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while True:
                os.write(fd, b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def mend(self) -> None:
        if self.kind == "readonly":
            self._remount("rw")
        else:
            os.remove(self.dir / "filler")

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.dir)], check=False)
            self.mounted = False


def mount_disk(request, tmp_path: Path, kind: str, size: str = "4m") -> Disk:
    """A Disk of ``kind`` for this test (unmounted after it), or a skip saying why none."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a file system that can fail")
    try:
        d = Disk(tmp_path, kind, size)
    except OSError as exc:
        pytest.skip(f"cannot mount here: {exc}")
    request.addfinalizer(d.close)
    return d

