"""The inference server's "busy" word, and the guard jobs' yield statistics (cooperative yielding).

Two small shared-memory files, each with one writer:

- **the busy word** (the server's, ``/dev/shm/visionserve-guard-<pid>.share``): how many of the
  server's batchers have a batch running, and how many have frames queued or running. The batchers
  write it through :func:`note`, which the server installs as their state observer
  (:func:`visionserve.batching.observe_states`) when it hosts a guard or runs beside one: on the
  event loop, a dictionary look-up per call and, on a change of a batcher's state, two stores into
  the mapped page. No system call, no lock. Guard jobs map it read-only
  (``VISIONSERVE_GUARD_SHARE``); the hook injected into PyTorch jobs (:mod:`.yieldhook`) waits at
  module and optimizer boundaries while a batch runs, and keeps less GPU work queued ahead while
  frames wait for their batch.
- **the yield statistics** (one per job, ``<job log>.yield``, written by the job's hook): hook
  calls, yields, forced passes, time waited. The supervisor reads them for the metrics and for
  ``guard show``, and removes the file when the job ends. The job never writes the busy word, so a
  job that dies, paused or in the middle of a yield, leaves nothing the next job could trip on.

Layout of the busy word (little-endian, 64 bytes)::

    0  u32 magic 'VSBW'   4  u32 version
    8  u64 running: batchers with a batch running (the job waits while it is non-zero)
   16  u64 busy periods: idle -> busy transitions (metrics)
   24  u32 owner pid (a job treats the word of a dead server as idle)
   32  u64 busy: batchers with frames queued or a batch running
   40  u64 duty, per mille: the share of time jobs may run (0: no limit), set by a hosted guard
       from its latency budget (rate limiting through the same hook)

Layout of the yield statistics (72 bytes)::

    0  u32 magic 'VSYS'   4  u32 version   8  u32 pid   12 u32 flags (1: CUDA work bounded,
                                                          2: mode "bound": it never waits)
   16  u64 hook calls     24 u64 yields (waits)   32 u64 forced passes (waited max / min share)
   40  u64 ns waited      48 u64 run-ahead syncs   56 u64 last hook, CLOCK_MONOTONIC ns
   64  u64 ns slept for the duty cycle

Both files are plain mmaps: readers and writers on one machine see each other's stores at once
(shared page cache), and an aligned 8-byte store is not torn on the machines this runs on.
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass

# the states note() takes, re-exported for its callers
from ..batching import IDLE, QUEUED, RUNNING  # noqa: F401

log = logging.getLogger(__name__)

#: set for a server and ``guard run`` that are separate processes: both use this word
SHARE_ENV = "VISIONSERVE_GUARD_SHARE"
STATS_ENV = "VISIONSERVE_GUARD_YIELD_STATS"

WORD_SIZE = 64
WORD_MAGIC = 0x57425356  # b"VSBW"
STATS_MAGIC = 0x53595356  # b"VSYS"
VERSION = 1
_HEAD = struct.Struct("<II")
_STATS = struct.Struct("<IIIIQQQQQQQ")
SHM_DIR = "/dev/shm"
PREFIX = "visionserve-guard-"

#: batcher (any hashable with a ``_loop_task`` attribute) -> its state as last noted
_state: dict = {}
_word: memoryview | None = None  # u64 view of the mapped word, or None: not published
_path: str | None = None
_lock = threading.Lock()  # publish/prune (guard thread) against each other; note() needs none


def note(batcher, state: int) -> None:
    """The batchers' state observer (the server installs it): ``state`` = :data:`RUNNING` (a batch
    runs), :data:`QUEUED` (frames wait for a batch) or :data:`IDLE`. Costs a dict look-up unless
    the batcher's state changed. Event loop thread only."""
    if _state.get(batcher) != state:
        _changed(batcher, state)


def _changed(batcher, state: int) -> None:
    was = busy_now()
    _state[batcher] = state
    word = _word if _word is not None else _from_env()
    if word is not None:
        _write(word)
        if state and not was:
            word[2] += 1


def _write(word: memoryview) -> None:
    states = list(_state.values())  # list() of a dict view: atomic under the GIL (see prune)
    word[1] = sum(1 for v in states if v == RUNNING)
    word[4] = sum(1 for v in states if v)


def serving() -> bool:
    """Whether batchers run in this process (then a guard hosted here can publish the word)."""
    return bool(_state)


def busy_now() -> int:
    """Batchers with frames queued or a batch running."""
    return sum(1 for v in list(_state.values()) if v)


def _from_env() -> memoryview | None:
    """A server started with ``VISIONSERVE_GUARD_SHARE`` publishes there (a guard that is its own
    process reads the same path); tried once."""
    global _tried_env
    if _tried_env:
        return None
    _tried_env = True
    path = os.environ.get(SHARE_ENV)
    if not path:
        return None
    try:
        publish(path)
        return _word
    except OSError as exc:
        log.warning("guard: cannot publish the busy word at %s (%s); jobs will not yield",
                    path, exc)
        return None


_tried_env = False


def default_path() -> str:
    folder = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
    return os.path.join(folder, f"{PREFIX}{os.getpid()}.share")


def publish(path: str | None = None) -> str:
    """Create (or take over) the busy word at ``path`` (default: $VISIONSERVE_GUARD_SHARE, else
    ``/dev/shm/visionserve-guard-<pid>.share``) and make :func:`note` write it. Idempotent for the
    same path. Returns the path."""
    global _word, _path
    with _lock:
        path = os.path.abspath(path or os.environ.get(SHARE_ENV) or default_path())
        if _word is not None and _path == path:
            return path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, WORD_SIZE)
            mm = mmap.mmap(fd, WORD_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        words = memoryview(mm).cast("Q")
        _write(words)
        words[2] = 0
        struct.pack_into("<I", mm, 24, os.getpid())
        _HEAD.pack_into(mm, 0, WORD_MAGIC, VERSION)  # last: a reader sees a whole word or none
        _word, _path = words, path
        return path


def published_path() -> str | None:
    return _path if _word is not None else None


def set_duty(share_of_time: float | None) -> bool:
    """Let jobs run at most this share of the time (None or >= 1: no limit); False when this
    process does not publish the word."""
    word = _word
    if word is None:
        return False
    if share_of_time is None or share_of_time >= 1:
        word[5] = 0
    else:
        word[5] = max(1, int(share_of_time * 1000))
    return True


def prune() -> None:
    """Forget batchers that were closed (their loop task is gone) so that a model unloaded while
    frames were queued does not read busy for ever. The guard calls it once a second."""
    with _lock:
        gone = [b for b in list(_state) if getattr(b, "_loop_task", True) is None]
        if not gone:
            return
        for b in gone:
            _state.pop(b, None)
        if _word is not None:  # (a change noted meanwhile is rewritten at the next one)
            _write(_word)


def unpublish(remove: bool = True) -> None:
    """Stop writing the word; remove its file (the server stops, or a test ends)."""
    global _word, _path
    with _lock:
        word, path = _word, _path
        _word, _path = None, None
        if word is not None:  # not released: the event loop may be storing into it right now
            word[1] = word[4] = word[5] = 0
        if remove and path:
            try:
                os.unlink(path)
            except OSError:
                pass


def remove_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove busy words left by servers that died (the pid in the name is gone)."""
    removed = []
    for path in glob.glob(os.path.join(directory, f"{PREFIX}*.share")):
        stem = os.path.basename(path)[len(PREFIX):-len(".share")]
        if not stem.isdigit() or int(stem) == os.getpid():
            continue
        try:
            os.kill(int(stem), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
        except PermissionError:
            pass  # alive, someone else's
    return removed


@dataclass(frozen=True)
class Word:
    running: int
    busy: int
    periods: int
    owner: int


def read_word(path: str) -> Word | None:
    """The busy word at ``path``, or None (missing, or not a word)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(WORD_SIZE)
    except OSError:
        return None
    if len(raw) < 40 or _HEAD.unpack_from(raw)[0] != WORD_MAGIC:
        return None
    running, periods = struct.unpack_from("<QQ", raw, 8)
    owner, = struct.unpack_from("<I", raw, 24)
    busy, = struct.unpack_from("<Q", raw, 32)
    return Word(running, busy, periods, owner)


@dataclass(frozen=True)
class YieldStats:
    """What a job's hook reported (see the module docstring)."""

    pid: int
    bounded: bool  # CUDA run-ahead bounded by events
    hooks: int
    yields: int
    forced: int
    waited_s: float
    syncs: int
    last_hook_ns: int
    throttled_s: float = 0.0
    mode: str = "wait"  # "bound": the hook never waits, it only bounds the queued GPU work


def read_stats(path: str) -> YieldStats | None:
    """A job's yield statistics; None when the hook never started (no torch, opted out, stripped
    environment) or the file is not one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_STATS.size)
    except OSError:
        return None
    if len(raw) < _STATS.size:
        return None
    magic, _v, pid, flags, hooks, yields, forced, waited, syncs, last, slept = _STATS.unpack(raw)
    if magic != STATS_MAGIC:
        return None
    return YieldStats(pid, bool(flags & 1), hooks, yields, forced, waited / 1e9, syncs, last,
                      slept / 1e9, "bound" if flags & 2 else "wait")
