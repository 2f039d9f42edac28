"""The serving process's threads by what they wait on: the event loop (and the front ends on it)
at the process's own priority, the model's threads below it.

On a small edge CPU the decode, compute and runtime threads keep every core busy under load.
When the event loop wakes up for a request, it then waited for a core behind them, and so did its
answers: refusals of an overloaded model took 60-100 ms at p99 on the 2-core machine, and
admitted frames that the server had answered in time reached their clients late. With those
threads a few nice levels down (``worker_nice``), the kernel runs the loop first when it wakes up;
the loop uses little CPU, so the model's threads still get the rest.

Linux sets a nice value per thread, and a new thread inherits its creator's: the runner threads
lower their own at start (the decode pool they create follows), and models load and warm up in a
thread of their own at that level (:func:`run_lowered`), so the thread pools that onnxruntime and
torch create on the way inherit it too. Elsewhere this does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

_warned = False


def usable_cpus() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, ``docker --cpuset-cpus``,
    a systemd ``CPUAffinity=``), not every core of the machine. Thread pools sized to the machine
    would put 8 or 16 threads on the 2 cores a server was given."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def lower_this_thread(nice: int) -> None:
    """Put the calling thread (and the threads it creates from now on) ``nice`` levels below the
    process's priority; 0: leave it. Lowering needs no privilege; a failure is logged once."""
    global _warned
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())
        os.setpriority(os.PRIO_PROCESS, tid, min(19, base + nice))
    except OSError as exc:
        if not _warned:
            _warned = True
            log.warning("could not lower the priority of the model's threads (worker_nice): %s",
                        exc)


def thread_nice(tid: int | None = None) -> int:
    """The nice value of a thread of this process (default: the calling one); Linux."""
    return os.getpriority(os.PRIO_PROCESS, tid or threading.get_native_id())


_loads = 0
_loads_lock = threading.Lock()
_serving_interval = 0.0


@contextlib.contextmanager
def switching_fast(interval_s: float):
    """While a model loads beside the serving versions, Python's thread switch interval is
    ``interval_s`` (if shorter): the loading thread runs pure-Python deserialisation, and a serving
    thread that wants the interpreter back waits up to one interval for it, at every hand-off of
    every batch. On the H200 the bench model's load took the GPU from 24% to 3-8% busy for its
    first 1.8 s with the serving 0.5 ms. Nested and concurrent loads share one setting; the last
    one out restores the serving interval."""
    global _loads, _serving_interval
    with _loads_lock:
        if _loads == 0:
            _serving_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(interval_s, _serving_interval))
        _loads += 1
    try:
        yield
    finally:
        with _loads_lock:
            _loads -= 1
            if _loads == 0:
                sys.setswitchinterval(_serving_interval)


async def run_lowered(nice: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` in a new thread at ``nice`` levels down, awaited (``asyncio.to_thread`` for
    work whose own threads must not outrank the event loop: loading and warming up a model)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(value=None, exc: BaseException | None = None) -> None:
        if not done.done():
            done.set_exception(exc) if exc is not None else done.set_result(value)

    def run() -> None:
        lower_this_thread(nice)
        try:
            value = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, value)

    thread = threading.Thread(target=run, name=f"load:{getattr(fn, '__name__', 'fn')}", daemon=True)
    # Thread.start waits until the new thread runs: on busy cores, not on the event loop
    await asyncio.to_thread(thread.start)
    return await done
