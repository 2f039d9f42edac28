"""``folder:PATH``: a camera that drops its frames as files (FTP or SMB upload to a share).

A file is taken only when it is complete: its size and modification time the same across two
looks ``settle_ms`` apart, and its bytes a whole image file (a JPEG ends with its end-of-image
marker, a PNG with its IEND chunk, a BMP is as long as its header says; the header declares a
usable image). A file still being written is never a frame. At a trigger the newest complete file
is the frame (a newer file still being written is waited for, within the grab's timeout); older
files left in the folder are stale, moved out with it and counted as drops. Free-running, every
file is a frame, oldest first. A taken file is then moved to the done folder (``done = "move"``,
``done_dir``: default ``PATH/done``) or deleted (``done = "delete"``). A file that stays
incomplete (unchanged for ``incomplete_after_s``: the writer gave up) goes the same way, counted
as a drop.

Whoever can write to the folder can inject frames: docs/cameras.md says how to protect it.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import imaging
from ..errors import ConfigError, VisionServeError
from .source import COMMON_SETTINGS, ENCODED, CameraFault, Grabbed, register

log = logging.getLogger(__name__)

#: the files a folder camera's frames are; any other file is left alone
EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp")
#: how often an empty folder (or a file still being written) is looked at again
POLL_S = 0.005
_PNG_END = b"IEND\xaeB`\x82"


@dataclass(frozen=True)
class FolderSettings:
    done: str = "move"
    done_dir: Path | None = None
    settle_ms: float = 5.0
    incomplete_after_s: float = 5.0
    max_bytes: int = 64 * 1024**2
    trigger: str = "software"

    @classmethod
    def of(cls, name: str, settings: Mapping[str, Any]) -> FolderSettings:
        own = {k: v for k, v in settings.items() if k not in COMMON_SETTINGS}
        unknown = sorted(set(own) - {"done", "done_dir", "settle_ms", "incomplete_after_s",
                                     "max_bytes"})
        if unknown:
            raise ConfigError(f"camera {name}: unknown folder setting(s) {', '.join(unknown)}; "
                              "known: done, done_dir, settle_ms, incomplete_after_s, max_bytes")
        try:
            out = cls(done=str(own.get("done", "move")),
                      done_dir=Path(own["done_dir"]) if own.get("done_dir") else None,
                      settle_ms=float(own.get("settle_ms", 5.0)),
                      incomplete_after_s=float(own.get("incomplete_after_s", 5.0)),
                      max_bytes=int(own.get("max_bytes", 64 * 1024**2)),
                      trigger=str(settings.get("trigger") or "software"))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"camera {name}: bad folder setting: {exc}") from None
        if out.done not in ("move", "delete"):
            raise ConfigError(f"camera {name}: done = {out.done!r}; use \"move\" or \"delete\"")
        if not (0 <= out.settle_ms <= 1000 and out.incomplete_after_s > 0 and out.max_bytes > 0):
            raise ConfigError(f"camera {name}: settle_ms is 0..1000, incomplete_after_s and "
                              "max_bytes above 0")
        return out


def incomplete(data: bytes) -> str | None:
    """Why ``data`` is not (yet) a whole image file; None when it is one."""
    kind = imaging.sniff(data)
    if kind is None:
        return "not a JPEG, PNG or BMP file (yet)"
    if kind == "png" and not data.endswith(_PNG_END):
        return "PNG without its IEND chunk"
    if kind == "bmp":
        declared = struct.unpack("<I", data[2:6])[0] if len(data) >= 6 else -1
        if declared != len(data):
            return f"BMP of {len(data)} bytes, its header says {declared}"
    try:  # the header declares a usable image; a JPEG ends with its end-of-image marker
        imaging.encoded_frame(data, max_pixels=2**62)
    except VisionServeError as exc:
        return exc.message
    return None


class FolderSource:
    """The folder camera (see the module's docstring)."""

    def __init__(self, name: str, uri: str, settings: Mapping[str, Any]) -> None:
        self.name = name
        self.uri = uri
        path = uri.split(":", 1)[1].removeprefix("//")  # folder:///srv/drop, as a URL
        if not path:
            raise ConfigError(f"camera {name}: folder: needs a path, e.g. folder:/srv/drop")
        self.path = Path(path)
        self.settings = FolderSettings.of(name, settings)
        self.done_dir = self.settings.done_dir or self.path / "done"
        self.newest_first = self.settings.trigger != "free"
        self._opened = False
        self._counts = {"frames": 0, "drops": 0, "incomplete": 0}
        # name -> (size, mtime_ns, first seen so) of files not yet complete
        self._waiting: dict[str, tuple[int, int, float]] = {}

    def describe(self) -> str:
        return f"folder:{self.path}"

    def open(self) -> None:
        if not self.path.is_dir():
            raise CameraFault(f"folder {self.path} does not exist (or is no folder)", "not_found")
        if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
            raise CameraFault(f"folder {self.path}: no permission to read and remove its files",
                              "not_found")
        if self.settings.done == "move":
            try:
                self.done_dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CameraFault(f"done folder {self.done_dir} cannot be made: {exc}",
                                  "not_found") from None
        self._waiting.clear()
        self._opened = True

    def close(self) -> None:
        self._opened = False

    def stats(self) -> dict[str, int]:
        return dict(self._counts)

    def grab(self, timeout_s: float) -> Grabbed:
        if not self._opened:
            raise CameraFault(f"folder {self.path} is not open", "disconnected")
        deadline = time.monotonic() + timeout_s
        while True:
            waited_for: str | None = None
            files = self._files()
            for i, entry in enumerate(files):
                data, why = self._read_complete(entry)
                if data is None:
                    if self.newest_first and i == 0:
                        waited_for = f"{entry.name}: {why}"
                        break  # the newest is this trigger's frame: wait for it
                    continue  # free-running: the next one in order may be complete
                stale = files[i + 1:] if self.newest_first else []
                return self._take(entry, data, stale)
            now = time.monotonic()
            if now >= deadline:
                if waited_for is not None:
                    raise CameraFault(f"folder {self.path}: newest file still incomplete after "
                                      f"{timeout_s:g} s ({waited_for})", "incomplete")
                raise CameraFault(f"folder {self.path}: no new complete file within "
                                  f"{timeout_s:g} s", "timeout")
            time.sleep(min(POLL_S, deadline - now))

    # --- the folder ---------------------------------------------------------------------------

    def _files(self) -> list[os.DirEntry[str]]:
        """The image files in the folder, in the order they are taken (by modification time)."""
        try:
            with os.scandir(self.path) as it:
                entries = [e for e in it if not e.name.startswith(".")
                           and e.name.lower().endswith(EXTENSIONS) and e.is_file()]
        except FileNotFoundError:
            self._opened = False
            raise CameraFault(f"folder {self.path} is gone (unmounted or removed)",
                              "disconnected") from None
        except OSError as exc:
            self._opened = False
            raise CameraFault(f"folder {self.path} cannot be read: {exc}",
                              "disconnected") from None
        stamped = []
        for e in entries:
            try:
                stamped.append((e.stat().st_mtime_ns, e.name, e))
            except FileNotFoundError:  # taken away meanwhile
                continue
        stamped.sort(key=lambda t: (t[0], t[1]), reverse=self.newest_first)
        return [e for _, _, e in stamped]

    def _read_complete(self, entry: os.DirEntry[str]) -> tuple[bytes | None, str]:
        """(the file's bytes, "") when it is complete; (None, why) when not yet. A file that has
        stayed incomplete for ``incomplete_after_s`` is put away and counted as a drop."""
        try:
            first = os.stat(entry.path)
            if self.settings.settle_ms:
                time.sleep(self.settings.settle_ms / 1000)
            second = os.stat(entry.path)
            if (first.st_size, first.st_mtime_ns) != (second.st_size, second.st_mtime_ns):
                self._waiting.pop(entry.name, None)
                return None, "still growing"
            if second.st_size > self.settings.max_bytes:
                big = f"{second.st_size} bytes, over max_bytes {self.settings.max_bytes}"
                self._give_up(entry, big)
                return None, big
            with open(entry.path, "rb") as f:
                data = f.read(self.settings.max_bytes + 1)
        except FileNotFoundError:
            return None, "gone"
        except OSError as exc:
            return None, f"cannot be read: {exc}"
        why = "size changed while read" if len(data) != second.st_size else incomplete(data)
        if why is None:
            self._waiting.pop(entry.name, None)
            return data, ""
        stamp = (second.st_size, second.st_mtime_ns)
        seen = self._waiting.get(entry.name)
        if seen is None or seen[:2] != stamp:
            self._waiting[entry.name] = (*stamp, time.monotonic())
        elif time.monotonic() - seen[2] >= self.settings.incomplete_after_s:
            self._give_up(entry, why)
        return None, why

    def _give_up(self, entry: os.DirEntry[str], why: str) -> None:
        log.warning("camera %s: %s stays incomplete (%s); put away, not inspected", self.name,
                    entry.name, why)
        self._waiting.pop(entry.name, None)
        self._counts["incomplete"] += 1
        self._counts["drops"] += 1
        self._put_away(entry)

    def _take(self, entry: os.DirEntry[str], data: bytes,
              stale: list[os.DirEntry[str]]) -> Grabbed:
        mtime = os.stat(entry.path).st_mtime
        self._put_away(entry)
        for old in stale:  # older than this trigger's frame: no part is waiting for them
            self._counts["drops"] += 1
            self._put_away(old)
        self._counts["frames"] += 1
        return Grabbed(None, ENCODED, encoded=data, camera_time=mtime)

    def _put_away(self, entry: os.DirEntry[str]) -> None:
        """Move the file to the done folder, or delete it (``done``). A file that cannot be moved
        would be taken again: that is a fault of the camera."""
        try:
            if self.settings.done == "delete":
                os.unlink(entry.path)
                return
            target = self.done_dir / entry.name
            if target.exists():
                stem, ext = os.path.splitext(entry.name)
                target = self.done_dir / f"{stem}.{time.time_ns()}{ext}"
            os.replace(entry.path, target)
        except FileNotFoundError:
            pass  # taken away by someone else meanwhile
        except OSError as exc:
            raise CameraFault(f"folder {self.path}: {entry.name} cannot be "
                              f"{'deleted' if self.settings.done == 'delete' else 'moved'}: "
                              f"{exc}", "error") from None


register("folder", FolderSource)
