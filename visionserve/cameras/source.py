"""The interface of a camera source, and the registry that opens one from its URI by scheme.

A source module (``folder.py``, ``gige.py``, ``rtsp.py``, ...) registers its scheme when it is
imported::

    from .source import register

    def _open(name: str, uri: str, settings: Mapping[str, Any]) -> Source: ...

    register("gige", _open)

:func:`open_source` imports ``visionserve.cameras.<scheme>`` on first use of the scheme, so
adding a source is adding its module; a scheme whose module is not there is a ConfigError that
names it. ``open_source`` builds the object only: the camera service calls ``open()``, in the
camera's own thread.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from ..errors import ConfigError

#: A grabbed frame that is a file's bytes (JPEG, PNG, BMP); pixels come in one of the GenICam
#: formats :data:`.pixels.PIXEL_FORMATS` names
ENCODED = "encoded"

#: Settings every source is opened with besides its own (``[camera.NAME]``'s ``trigger`` and
#: ``rate_hz``; ``user`` and ``password`` where credentials are configured for it): a source
#: refuses other keys it does not know (ConfigError), and ignores these where they do not apply.
COMMON_SETTINGS = ("trigger", "rate_hz", "user", "password")

#: How a camera is triggered (the ``trigger`` setting): by the server per trigger call
#: (``software``), by its own input line (``hardware``: a frame's arrival is the trigger), or
#: free-running at ``rate_hz`` (``free``).
TRIGGERS = ("software", "hardware", "free")


@dataclass(frozen=True)
class Grabbed:
    """One frame as the camera sent it.

    ``pixels``: HxW for mono and Bayer formats, HxWx3 for RGB8/BGR8; uint8, or uint16 for the
    deeper formats (the values as the camera sent them, not scaled). None when ``encoded`` holds
    a file's bytes instead (``pixel_format == "encoded"``: JPEG, PNG or BMP, as-is).
    ``camera_time``: the camera's own timestamp in seconds, when it gives one; ``frame_id``: its
    frame (block) id, when it gives one.
    """

    pixels: np.ndarray | None
    pixel_format: str
    encoded: bytes | None = None
    camera_time: float | None = None
    frame_id: int | None = None


class CameraFault(Exception):
    """A camera did not deliver a frame: timeout, incomplete frame, disconnected, not found.

    ``reason`` is a short fixed word for metrics (one of :data:`FAULT_REASONS`); the message
    says what happened for a person, and never carries credentials.
    """

    def __init__(self, message: str, reason: str = "error") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason if reason in FAULT_REASONS else "error"


#: The ``reason`` of a :class:`CameraFault`: a label of the camera fault metric.
FAULT_REASONS = ("timeout", "incomplete", "disconnected", "not_found", "config", "error")


@runtime_checkable
class Source(Protocol):
    """A camera. Every method but ``describe`` and ``stats`` is called from the camera's own
    thread only (the camera service's), one at a time."""

    name: str

    def describe(self) -> str:
        """The URI with any credentials removed: safe for logs and pages."""
        ...

    def open(self) -> None:
        """Connect and configure; raises CameraFault (not found, refused, bad setting)."""
        ...

    def grab(self, timeout_s: float) -> Grabbed:
        """Trigger (when the camera is software-triggered) and return the newest frame taken
        after the call; raises CameraFault. Never blocks past ``timeout_s``."""
        ...

    def close(self) -> None:
        """Release the camera; safe to call twice, and after a failed ``open``."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters since the source was built: ``frames``, ``drops`` (incomplete or lost
        frames), ``resends`` (packets resent) where the source knows them."""
        ...


#: name, URI, settings -> a Source (not opened yet). Raises ConfigError for a bad URI/setting.
Opener = Callable[[str, str, Mapping[str, Any]], Source]

_OPENERS: dict[str, Opener] = {}
_LOCK = threading.Lock()
_SCHEME = re.compile(r"^([a-z][a-z0-9]*)(?::|$)")


def own_settings(name: str, scheme: str, settings: Mapping[str, Any],
                 known: Sequence[str]) -> dict[str, Any]:
    """A source's own settings (``settings`` less :data:`COMMON_SETTINGS`); ConfigError naming
    any that ``known`` lacks."""
    own = {k: v for k, v in settings.items() if k not in COMMON_SETTINGS}
    unknown = sorted(set(own) - set(known))
    if unknown:
        raise ConfigError(f"camera {name}: unknown {scheme} setting(s) {', '.join(unknown)}; "
                          f"known: {', '.join(known)}")
    return own


def register(scheme: str, opener: Opener) -> None:
    """Make ``scheme`` open with ``opener``; called by the scheme's module when it is imported."""
    with _LOCK:
        _OPENERS[scheme] = opener


def scheme_of(uri: str) -> str:
    """The scheme of a camera URI (``folder`` of ``folder:/srv/drop``); ConfigError if none."""
    match = _SCHEME.match(uri.strip())
    if match is None:
        raise ConfigError(f"camera source {redact(uri)!r} has no scheme; expected folder:PATH, "
                          "gige://DEVICE or rtsp://HOST/PATH")
    return match.group(1)


def opener_for(scheme: str) -> Opener:
    """The opener of ``scheme``, importing ``visionserve.cameras.<scheme>`` on first use."""
    with _LOCK:
        found = _OPENERS.get(scheme)
    if found is not None:
        return found
    module = f"{__package__}.{scheme}"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:  # the module is there but needs something missing
            raise ConfigError(f"camera sources {scheme}:// need {exc.name!r}, which is not "
                              f"installed (docs/cameras.md)") from None
        raise ConfigError(f"camera source scheme {scheme!r} is not available in this build "
                          f"(no module {module})") from None
    with _LOCK:
        found = _OPENERS.get(scheme)
    if found is None:
        raise ConfigError(f"camera source scheme {scheme!r} is not a camera source")
    return found


def open_source(name: str, uri: str, settings: Mapping[str, Any]) -> Source:
    """The source ``uri`` names, built (not opened) with its settings; ConfigError for an
    unknown scheme, a missing module or a bad setting."""
    return opener_for(scheme_of(uri))(name, uri.strip(), settings)


def redact(uri: str) -> str:
    """``uri`` without a password or user in it (``rtsp://user:pw@host/x`` -> ``rtsp://host/x``)."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparsable uri>"
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))

