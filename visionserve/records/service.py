"""The records from settings: the store, the capture target and the writer, tapped into the
engine while the server runs (:func:`records_running`), and the store alone for the readers (the
HTTP route in every front-end process, ``visionserve records export``)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

from ..config import ServerSettings, data_home, parse_bytes
from ..errors import VisionServeError
from .capture import Policy, open_target
from .images import ImageSource
from .store import RecordStore, open_store
from .writer import Recorder

log = logging.getLogger(__name__)

DAY_S = 86_400.0


def records_folder(settings: ServerSettings) -> Path:
    return Path(settings.records_dir) if settings.records_dir else data_home()


def store_of(settings: ServerSettings) -> RecordStore:
    """The record store the settings name (opened on first use)."""
    return open_store(settings.records_url, records_folder(settings))


def images_of(settings: ServerSettings) -> ImageSource:
    """Where the captured images of ``settings`` are read back from (the image routes)."""
    return ImageSource.of(settings, records_folder(settings))


def make_recorder(settings: ServerSettings) -> Recorder:
    """The writer (not started), its store and capture target from ``settings``; ConfigError
    for a bad store URL, capture target or missing extra."""
    policy = Policy(settings.capture, settings.capture_band, settings.capture_sample_percent)
    store = store_of(settings)
    target = open_target(settings, records_folder(settings), store.labelled_images) \
        if policy.active else None
    return Recorder(store, max_age_s=settings.records_max_age_days * DAY_S,
                    max_bytes=parse_bytes(settings.records_max_bytes),
                    queue_size=settings.records_queue, policy=policy, target=target,
                    capture_queue=settings.capture_queue,
                    recent_bytes=parse_bytes(settings.capture_recent))


@contextlib.asynccontextmanager
async def records_running(engine, settings: ServerSettings):
    """The record writer tapped into ``engine`` while the body runs (nothing unless
    ``--records``). Yields 0, or 2 when it could not start (the reason logged)."""
    if not settings.records:
        yield 0
        return
    try:
        recorder = make_recorder(settings)
    except VisionServeError as exc:
        log.error("records: %s", exc.message)
        yield 2
        return
    recorder.start()
    engine.tap(recorder)
    engine.recent_capture = recorder.capture_recent
    log.info("records: every answered frame to %s%s", recorder.store.where,
             f"; capture {settings.capture} to {recorder.target.where}"
             if recorder.target is not None else "")
    try:
        yield 0
    finally:
        engine.untap(recorder)
        engine.recent_capture = None
        import asyncio

        # what is queued is stored within the drain time; what is not is counted and logged
        await asyncio.to_thread(recorder.close, max(1.0, settings.drain_timeout_s))
