"""Who may call what, for both front ends: the route table, the tokens, and the checks.

Every HTTP route is in :data:`ROUTES`, in one of two classes (docs/security.md):

- *open*: inference (OIP infer, metadata, config, ready, stats; inspect), health and
  ``/metrics``. Open to every client unless an inference token is set (``--auth-token``): then
  they need it, but health (``--no-auth-health-open`` closes it) and ``/metrics``
  (``--no-auth-metrics-open``), which load balancers and scrapers probe without the secret.
- *protected*: whatever changes state, writes a file, runs a command, or reads more than a
  verdict (verdict and recipe changes, the model repository, the guard's job API, part records,
  the API docs, the console's pages). They need ``Authorization: Bearer <admin token>`` unless
  the server binds loopback addresses only. The bind address decides, not the client's: behind
  a reverse proxy on the same machine every client is 127.0.0.1, and behind a Docker port
  mapping none is.
  Whatever the bind address, a protected request must name this server in ``Host`` (DNS
  rebinding), must not come from a foreign ``Origin``, and a body it sends must be JSON (415):
  what a web page can send without the browser asking first is refused.

The console's style sheet and script (``STATIC``) are open to every client whatever the tokens,
with the ``Host`` and ``Origin`` checks of protected routes.

The admin token also passes where the inference token is asked for; the inference token never
opens a protected route. Where the console has users (:mod:`visionserve.users`), a protected route
also takes a session cookie of a user whose role is at least the route's ``role``, with the
session's CSRF token on every change; the sign-in routes (class *signin*) need no token, but the
``Host`` and ``Origin`` checks. A server that binds a non-loopback address and has no admin token
makes one at its first start and keeps it in the data directory (:func:`with_admin_token`).

The HTTP middleware also gives every request its id (``X-Request-Id`` in and out).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import re
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from .config import ServerSettings, data_home, users_db_path
from .errors import ConfigError, VisionServeError, http_status, retry_after
from .logs import new_request_id, request_id
from .users.store import ADMIN as ADMIN_ROLE
from .users.store import QUALITY, VIEWER, Session, Users, role_covers

log = logging.getLogger("visionserve")

# --- the route table ------------------------------------------------------------------------------

INFERENCE, HEALTH, METRICS, ADMIN = "inference", "health", "metrics", "admin"
#: the console's sign-in: no token, but the Host and Origin checks of protected routes
SIGNIN = "signin"
#: the console's style sheet and script: files of the package, open to every client whatever
#: the tokens (a browser sends none for them); the Host and Origin checks still hold
STATIC = "static"


@dataclass(frozen=True)
class Route:
    """Requests of ``methods`` (space-separated) to ``path`` (``{name}``: one path segment;
    ``{name:path}``: the rest of the path, slashes included, as FastAPI's ``:path``) are
    of class ``access``. A protected route opens to a console session whose role covers
    ``role``; ``form``: its body may be form-encoded (exempt from the JSON-only rule, 415)."""

    methods: str
    path: str
    access: str
    role: str = ADMIN_ROLE
    form: bool = False

    def matches(self, method: str, path: str) -> bool:
        method = "GET" if method == "HEAD" else method
        return method in self.methods.split() and _pattern(self.path).match(path) is not None


#: every route of the server (HTTP), classified; a request that matches none is protected
ROUTES: tuple[Route, ...] = (
    Route("GET", "/v2/health/live", HEALTH),
    Route("GET", "/v2/health/ready", HEALTH),
    Route("GET", "/metrics", METRICS),
    Route("GET", "/v2", INFERENCE),
    Route("GET", "/v2/models/stats", INFERENCE),
    Route("GET", "/v2/models/{m}", INFERENCE),
    Route("GET", "/v2/models/{m}/versions/{v}", INFERENCE),
    Route("GET", "/v2/models/{m}/ready", INFERENCE),
    Route("GET", "/v2/models/{m}/versions/{v}/ready", INFERENCE),
    Route("GET", "/v2/models/{m}/config", INFERENCE),
    Route("GET", "/v2/models/{m}/versions/{v}/config", INFERENCE),
    Route("GET", "/v2/models/{m}/stats", INFERENCE),
    Route("GET", "/v2/models/{m}/versions/{v}/stats", INFERENCE),
    Route("POST", "/v2/models/{m}/infer", INFERENCE),
    Route("POST", "/v2/models/{m}/versions/{v}/infer", INFERENCE),
    Route("POST", "/v1/models/{m}/inspect", INFERENCE),
    Route("POST", "/v1/models/{m}/versions/{v}/inspect", INFERENCE),
    Route("POST", "/v1/stations/{s}/inspect", INFERENCE),
    Route("GET", "/v1/models/{m}/verdict", INFERENCE),  # the rule /v2/models/{m}/config shows
    Route("GET", "/v1/recipes", INFERENCE),
    Route("GET", "/v1/stations/{s}", INFERENCE),
    Route("POST", "/v1/cameras/{c}/trigger", INFERENCE),  # an inspection, as inspect is
    Route("POST", "/v1/stations/{s}/trigger", INFERENCE),
    Route("PUT", "/v1/models/{m}/verdict", ADMIN, QUALITY),
    Route("POST", "/v1/models/{m}/verdict/preview", ADMIN, QUALITY),  # changes nothing
    Route("POST", "/v2/repository/index", ADMIN),
    Route("POST", "/v2/repository/models/{m}/load", ADMIN),
    Route("POST", "/v2/repository/models/{m}/unload", ADMIN),
    Route("POST", "/v1/stations/{s}/recipe", ADMIN, QUALITY),
    Route("GET", "/v1/guard/jobs", ADMIN, VIEWER),
    Route("POST", "/v1/guard/jobs", ADMIN),  # runs a command
    Route("GET", "/v1/guard/jobs/{id}", ADMIN, VIEWER),
    Route("POST", "/v1/guard/jobs/{id}/cancel", ADMIN),
    Route("GET", "/v1/guard/jobs/{id}/logs", ADMIN, VIEWER),  # a command's output
    Route("GET", "/v1/guard/health", ADMIN, VIEWER),
    Route("GET", "/v1/parts/{id:path}", ADMIN, VIEWER),  # records and image names
    Route("GET", "/v1/records", ADMIN, VIEWER),  # the same, filtered
    Route("GET", "/v1/records/{id}/image", ADMIN, VIEWER),  # a record's captured image
    Route("GET", "/v1/records/{id}/overlay", ADMIN, VIEWER),  # the same, the answer drawn
    # labels of captured frames (docs/closed-loop.md): quality work, read and written
    Route("POST", "/v1/records/{id}/flag", ADMIN, QUALITY),
    Route("PUT", "/v1/records/{id}/label", ADMIN, QUALITY),
    Route("GET", "/v1/review", ADMIN, QUALITY),
    # candidates trained on the labels and their comparison (docs/closed-loop.md)
    Route("GET POST", "/v1/models/{m}/candidates", ADMIN, QUALITY),
    Route("GET", "/v1/models/{m}/candidates/{c}", ADMIN, QUALITY),
    Route("POST", "/v1/models/{m}/candidates/{c}/evaluate", ADMIN, QUALITY),
    Route("GET", "/v1/models/{m}/candidates/{c}/comparison", ADMIN, QUALITY),
    Route("GET", "/v1/models/{m}/candidates/{c}/trace", ADMIN, QUALITY),  # its audit trail
    # the promotion of a compared candidate and its rollback: quality work, audited
    Route("POST", "/v1/models/{m}/candidates/{c}/promote", ADMIN, QUALITY),
    Route("POST", "/v1/models/{m}/rollback", ADMIN, QUALITY),
    Route("GET POST DELETE", "/v1/models/{m}/candidates/{c}/shadow", ADMIN, QUALITY),
    Route("GET POST", "/ui/login", SIGNIN, form=True),  # the one form-encoded body taken
    Route("POST", "/ui/logout", SIGNIN),
    Route("GET", "/ui/session", SIGNIN),
    Route("GET", "/v1/live", ADMIN, VIEWER),  # every answer with its part id
    Route("GET", "/v1/live/summary", ADMIN, VIEWER),
    Route("GET", "/v1/audit", ADMIN, QUALITY),  # who changed what: names, addresses, rules
    Route("GET", "/v1/cameras", ADMIN, VIEWER),  # the cameras' sources (no credentials)
    Route("GET", "/docs", ADMIN),  # the API pages (api_docs): they can send any call
    Route("GET", "/docs/oauth2-redirect", ADMIN),
    Route("GET", "/redoc", ADMIN),
    Route("GET", "/openapi.json", ADMIN),
    # the console (docs/console.md): its pages read what protected routes read
    Route("GET", "/ui", ADMIN, VIEWER),
    Route("GET", "/ui/live", ADMIN, VIEWER),
    Route("GET", "/ui/parts", ADMIN, VIEWER),
    Route("GET", "/ui/parts/{part:path}", ADMIN, VIEWER),  # a part id may hold "/"
    Route("GET", "/ui/models", ADMIN, VIEWER),
    Route("GET", "/ui/stations", ADMIN, VIEWER),
    Route("GET", "/ui/system", ADMIN, VIEWER),
    Route("GET", "/ui/audit", ADMIN, QUALITY),
    Route("GET", "/ui/review", ADMIN, QUALITY),
    Route("GET", "/ui/models/{m}/candidates", ADMIN, QUALITY),
    Route("GET", "/ui/static/{name}", STATIC),
)

HEALTH_PATHS = tuple(r.path for r in ROUTES if r.access == HEALTH)
#: the routes whose answer is a stream that stays open (the live results): the connection limit
#: does not count them, they have their own (max_live_streams)
STREAM_PATHS = ("/v1/live",)

#: the gRPC methods that are protected routes (the model repository)
GRPC_ADMIN_METHODS = tuple(f"/inference.GRPCInferenceService/{m}" for m in (
    "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"))
GRPC_HEALTH_METHODS = ("/inference.GRPCInferenceService/ServerLive",
                       "/inference.GRPCInferenceService/ServerReady",
                       "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")

_PATTERNS: dict[str, re.Pattern] = {}


def _pattern(path: str) -> re.Pattern:
    if path not in _PATTERNS:
        pattern = re.sub(r"\\\{\w+:path\\\}", ".+", re.escape(path))
        _PATTERNS[path] = re.compile("^" + re.sub(r"\\\{\w+\\\}", "[^/]+", pattern) + "$")
    return _PATTERNS[path]


def route_of(method: str, path: str) -> Route | None:
    """The first route of :data:`ROUTES` a request matches; None: a protected route (admin)."""
    return next((r for r in ROUTES if r.matches(method, path)), None)


def classify(method: str, path: str) -> str:
    """The class of a request: the first route of :data:`ROUTES` it matches, else ADMIN."""
    route = route_of(method, path)
    return route.access if route is not None else ADMIN


def grpc_class(method: str) -> str:
    if method in GRPC_ADMIN_METHODS:
        return ADMIN
    return HEALTH if method in GRPC_HEALTH_METHODS else INFERENCE


# --- tokens ---------------------------------------------------------------------------------------

#: the admin token a server makes for itself, in the data directory
ADMIN_TOKEN_FILE = "admin-token"


def is_loopback(host: str) -> bool:
    """True when a server bound to ``host`` is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name, or "" (all interfaces)
        return False


def load_token(token: str | None, token_file: Path | None, name: str = "auth_token") -> str | None:
    if token and token_file:
        raise ConfigError(f"give either {name} or {name}_file, not both")
    if token_file:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise ConfigError(f"{name}_file {token_file}: {exc.strerror or exc}") from None
        if not token:
            raise ConfigError(f"{name}_file {token_file} is empty")
    return token or None


def with_admin_token(settings: ServerSettings) -> ServerSettings:
    """``settings`` with the admin token every process of the server uses: the one configured,
    or, on a non-loopback bind without one, the token in ``data_home()/admin-token`` (made with
    mode 0600 at the first start, read at the next; where it cannot be kept, one nobody knows).
    Raises ConfigError for a token file that cannot be read."""
    admin = load_token(settings.admin_token, settings.admin_token_file, "admin_token")
    inference = load_token(settings.auth_token, settings.auth_token_file)
    if admin is not None and admin == inference:
        raise ConfigError("admin_token and auth_token are the same: the inference token would "
                          "open every route; give the administration a token of its own")
    if admin is not None or is_loopback(settings.host):
        return settings
    path = data_home() / ADMIN_TOKEN_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        load_token(None, path, "admin_token")  # names an empty or unreadable file
        log.info("access: admin token read from %s", path)
    except OSError as exc:
        # a read-only container without a secret: serve inference, shut the protected routes
        # behind a token nobody is told
        log.warning("access: no admin token is set and none can be kept in %s (%s): protected "
                    "routes are closed to every client. Set admin_token_file (docs/security.md) "
                    "or --host 127.0.0.1", path, exc.strerror or exc)
        return settings.model_copy(update={"admin_token": secrets.token_urlsafe(32)})
    else:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        log.info("access: made an admin token for protected routes, in %s (mode 0600)", path)
    return settings.model_copy(update={"admin_token_file": path})


def _bearer(header: bytes | str | None) -> bytes | None:
    """The token of an ``Authorization: Bearer`` value, as bytes: HTTP gives the header's bytes
    (a non-ASCII token arrives as its UTF-8 bytes), gRPC a str."""
    if isinstance(header, str):
        header = header.encode("utf-8")
    if not header or header[:7].lower() != b"bearer ":
        return None
    return header[7:].strip()


def _matches(bearer: bytes | None, token: bytes | None) -> bool:
    return bearer is not None and token is not None and hmac.compare_digest(bearer, token)


def _utf8(token: str | None) -> bytes | None:
    return token.encode("utf-8") if token else None


# --- the rules ------------------------------------------------------------------------------------

UNAUTHENTICATED, FORBIDDEN = "unauthenticated", "forbidden"
ADMIN_NEEDED = ("it changes the server or reads its records, so it needs the admin token "
                "(Authorization: Bearer <admin token>; docs/security.md)")


@dataclass(frozen=True)
class Access:
    """The access rules of one server, from its settings (:meth:`from_settings`)."""

    token: bytes | None = None  # the inference token (UTF-8)
    admin_token: bytes | None = None
    admin_required: bool = True  # protected routes need the admin token (a non-loopback bind)
    health_open: bool = True
    metrics_open: bool = True
    hosts: frozenset[str] | None = frozenset()  # Host names on protected routes; None: any
    origins: frozenset[str] | None = frozenset()  # other origins allowed; None: any

    @classmethod
    def from_settings(cls, settings: ServerSettings) -> Access:
        """Call with the settings :func:`with_admin_token` gave (the token file resolved)."""
        return cls(_utf8(load_token(settings.auth_token, settings.auth_token_file)),
                   _utf8(load_token(settings.admin_token, settings.admin_token_file,
                                    "admin_token")),
                   not is_loopback(settings.host), settings.auth_health_open,
                   settings.auth_metrics_open, host_names(settings),
                   _listed(settings.allowed_origins))

    def admin_bearer(self, authorization: bytes | str | None) -> bool:
        """True when ``authorization`` carries the admin token."""
        return _matches(_bearer(authorization), self.admin_token)

    def credential(self, kind: str, authorization: bytes | str | None) -> tuple[str | None, str]:
        """(refusal, identity) of a request of class ``kind``: refusal is None (pass),
        UNAUTHENTICATED or FORBIDDEN (the inference token on a protected route); identity is who
        the credential says it is (``admin-token``, ``loopback``), or "" for an open route."""
        bearer = _bearer(authorization)
        if kind == STATIC:
            return None, ""
        if kind == ADMIN:
            if _matches(bearer, self.admin_token):
                return None, "admin-token"
            if self.admin_required:
                return (FORBIDDEN if _matches(bearer, self.token) else UNAUTHENTICATED), ""
            if self.token and not _matches(bearer, self.token):
                return UNAUTHENTICATED, ""
            return None, "loopback"
        if not self.token or (kind == HEALTH and self.health_open) or \
                (kind == METRICS and self.metrics_open):
            return None, ""
        if _matches(bearer, self.token) or _matches(bearer, self.admin_token):
            return None, ""
        return UNAUTHENTICATED, ""

    def cross_site(self, host: bytes | None, origin: bytes | None) -> str | None:
        """Why a protected request is refused (403) for its ``Host`` or ``Origin``, or None."""
        name = _split_host(host.decode("latin-1"))[0] if host else ""
        if self.hosts is not None and name and not _ip_literal(name) and name not in self.hosts:
            return (f"Host {name!r} is not a name this server answers to (DNS rebinding); add it "
                    "to the setting allowed_hosts")
        if origin is None or self.origins is None:
            return None
        seen = origin.decode("latin-1").strip().lower()
        if seen in self.origins or (host and _same_origin(seen, host.decode("latin-1"))):
            return None
        return (f"cross-site request refused: Origin {seen!r} is not this server; add it to the "
                "setting allowed_origins")

    def summary(self, settings: ServerSettings) -> list[str]:
        """The start-up block: which routes are open to whom."""
        inference = ("need the inference token (auth_token) or the admin token" if self.token
                     else "open to every client")
        probes = ", ".join(n for n, on in (("health", self.health_open),
                                           ("/metrics", self.metrics_open)) if on or not self.token)
        if self.admin_required:
            where = f" (from {settings.admin_token_file})" if settings.admin_token_file else ""
            protected = f"need the admin token{where}"
        else:
            protected = (f"open to this machine only (bind {settings.host})"
                         + (", with the inference or admin token" if self.token else ""))
        hosts = "any" if self.hosts is None else ", ".join(sorted(self.hosts)) + ", IP addresses"
        opened = f"; {probes}: open" if probes else ""
        return [f"inference (infer, metadata, config, ready, stats, inspect): {inference}{opened}",
                ("protected (verdict and recipe changes, /v2/repository, /v1/guard, /v1/parts, "
                  f"/v1/live, API docs, console pages): {protected}; Host: {hosts}; "
                  "JSON bodies only, no foreign Origin"),
                 Users(users_db_path(settings.users_db)).describe()]


def _listed(value: str) -> frozenset[str] | None:
    names = {n.strip().lower() for n in value.split(",") if n.strip()}
    return None if "*" in names else frozenset(names)


def host_names(settings: ServerSettings) -> frozenset[str] | None:
    """The names a protected request's ``Host`` may give: localhost, this machine's host name
    and FQDN, the bind address and ``allowed_hosts`` (None: ``*``, any name)."""
    extra = _listed(settings.allowed_hosts)
    if extra is None:
        return None
    own = {"localhost", socket.gethostname(), socket.getfqdn(), settings.host.strip("[]")}
    return frozenset(n.lower() for n in own if n) | extra


def _split_host(host: str) -> tuple[str, str]:
    """(name, port) of a ``Host`` value (``[::1]:8000`` -> ``("::1", "8000")``); port "" when
    it gives none."""
    host = host.strip().lower()
    if host.startswith("["):
        name, _, rest = host[1:].partition("]")
        return name, rest[1:] if rest.startswith(":") else ""
    if host.count(":") == 1:
        name, _, port = host.partition(":")
        return name, port
    return host, ""


def _ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


_DEFAULT_PORTS = {"http": "80", "https": "443"}


def _same_origin(origin: str, host: str) -> bool:
    """An ``Origin`` (``http://name:port``) that names the host and port of the request's
    ``Host``."""
    try:
        parts = urlsplit(origin)
        default = _DEFAULT_PORTS.get(parts.scheme, "")
        port = str(parts.port or default)
    except ValueError:
        return False
    name, host_port = _split_host(host)
    return (parts.hostname or "") == name and port == (host_port or default)


_JSON_TYPE = re.compile(r"^\s*application/(?:[\w.+-]+\+)?json\s*(?:;|$)", re.IGNORECASE)
_WRITES = ("POST", "PUT", "PATCH", "DELETE")


def body_refusal(method: str, headers: dict[bytes, bytes]) -> str | None:
    """Why a protected request's body is refused (415), or None: a state-changing request whose
    body is not declared JSON. A body without ``Content-Type`` passes from clients that are no
    browser (no ``Origin``): tritonclient sends its load and unload bodies so."""
    if method not in _WRITES:
        return None
    length = headers.get(b"content-length", b"").strip()
    if (length in (b"", b"0")) and b"transfer-encoding" not in headers:
        return None
    kind = headers.get(b"content-type")
    if kind is None and b"origin" not in headers:
        return None
    if kind is not None and _JSON_TYPE.match(kind.decode("latin-1")):
        return None
    shown = kind.decode("latin-1") if kind is not None else "none"
    return (f"this route takes a JSON body (Content-Type: application/json), or none; got "
            f"Content-Type {shown}")


# --- HTTP -----------------------------------------------------------------------------------------

#: where the middleware leaves the identity of a protected request's credential (scope key)
IDENTITY_KEY = "visionserve.identity"
#: where it leaves the console session of a protected or sign-in request that has one (scope key)
SESSION_KEY = "visionserve.session"
#: the console's session cookie, and the header that carries its CSRF token on every change
SESSION_COOKIE = "visionserve_session"
CSRF_HEADER = "X-CSRF-Token"
SESSION_ENDED = ("your console session has ended or expired, or is not one of this server's: "
                 "sign in again (/ui/login)")


class SessionSource(Protocol):
    """Where the middleware looks up console sessions (:class:`~visionserve.users.store.Users`)."""

    def session(self, token: str) -> Session | None: ...

    def any_user(self) -> bool: ...


def session_cookie(headers: dict[bytes, bytes]) -> str | None:
    """The session id a request's ``Cookie`` header carries, or None."""
    for part in headers.get(b"cookie", b"").decode("latin-1").split(";"):
        name, eq, value = part.strip().partition("=")
        if eq and name == SESSION_COOKIE and value:
            return value.strip('"')
    return None


def csrf_refusal(method: str, headers: dict[bytes, bytes], session: Session) -> str | None:
    """Why a change made with ``session`` is refused (403), or None: a state-changing request
    must carry the session's CSRF token in ``X-CSRF-Token``."""
    if method not in _WRITES:
        return None
    sent = headers.get(CSRF_HEADER.lower().encode())
    if sent is None:
        return (f"{method} with a console session needs the session's CSRF token in the "
                f"{CSRF_HEADER} header (GET /ui/session gives it)")
    if not hmac.compare_digest(sent, session.csrf_token.encode("latin-1")):
        return (f"wrong CSRF token in {CSRF_HEADER}: it must be the one GET /ui/session gives "
                "for this session")
    return None


class HttpSecurity:
    """ASGI middleware: a request id for every request (``X-Request-Id`` in and out), and the
    rules of ``access`` (401, 403, 415) before the app sees the request; with ``users``, the
    console sessions of protected and sign-in requests (looked up only for requests of those
    classes that carry the session cookie: inference requests never touch the users file)."""

    def __init__(self, app, access: Access, users: SessionSource | None = None) -> None:
        self.app = app
        self.access = access
        self.users = users

    def answer_from_head(self, scope) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """(status, headers, body) of a request that the app answers from its head alone
        (``answer_from_head`` of the app inside, the inspect API's), once it passes the checks
        here; None: serve the request as usual (then it keeps the request id given here). The
        HTTP protocol asks this as a request's head arrives (:mod:`.http.connections`)."""
        inner = getattr(self.app, "answer_from_head", None)
        if inner is None or scope["type"] != "http":
            return None
        headers = dict(scope.get("headers") or [])
        if self._refusal(scope, headers) is not None:
            return None  # __call__ says it
        rid = scope[_RID_KEY] = _request_id(headers)
        reset = request_id.set(rid)
        try:
            response = inner(scope)
        finally:
            request_id.reset(reset)
        if response is None:
            return None
        return (response.status_code,
                [*response.raw_headers, (b"x-request-id", rid.encode("latin-1"))], response.body)

    def _refusal(self, scope, headers: dict[bytes, bytes]) -> tuple | None:
        """(status, message, extra headers) of a request refused here, or None; a protected
        request that passes gets its identity in the scope."""
        method, path = scope["method"], scope["path"]
        route = route_of(method, path)
        kind = route.access if route is not None else ADMIN
        if kind in (ADMIN, SIGNIN, STATIC):
            why = self.access.cross_site(headers.get(b"host"), headers.get(b"origin"))
            if why is not None:
                return 403, why, ()
        if kind == SIGNIN and route is not None:
            return self._signin(scope, headers, route)
        token = session_cookie(headers) if kind == ADMIN and self.users is not None else None
        # the admin token wins over a cookie: API clients keep working as they did; without
        # any user, a cookie changes nothing
        if token is not None and self.users is not None and \
                not self.access.admin_bearer(headers.get(b"authorization")):
            try:
                session = self.users.session(token)
                if session is not None:
                    return self._with_session(scope, headers, session, route)
                if self.users.any_user():
                    return 401, SESSION_ENDED, ()
            except VisionServeError as exc:  # the users file cannot be read
                return _error(exc)
        refused, identity = self.access.credential(kind, headers.get(b"authorization"))
        if refused == FORBIDDEN:
            return 403, f"the inference token does not open {method} {path}: {ADMIN_NEEDED}", ()
        if refused is not None:
            message = (f"{method} {path}: {ADMIN_NEEDED}" if kind == ADMIN and
                       self.access.admin_required else
                       "missing or wrong bearer token (Authorization: Bearer <token>)")
            return 401, message, ((b"www-authenticate", b'Bearer realm="visionserve"'),)
        if kind == ADMIN:
            why = body_refusal(method, headers)
            if why is not None:
                return 415, why, ()
            scope[IDENTITY_KEY] = identity
        return None

    def _with_session(self, scope, headers: dict[bytes, bytes], session: Session,
                      route: Route | None) -> tuple | None:
        """A protected request made with a live session: its refusal, or None (it passes, the
        user's name its identity)."""
        method, path = scope["method"], scope["path"]
        needed = route.role if route is not None else ADMIN_ROLE
        if not role_covers(session.role, needed):
            return 403, (f"signed in as {session.user!r} ({session.role}): {method} {path} needs "
                         f"the role {needed} or higher"), ()
        why = csrf_refusal(method, headers, session)
        if why is not None:
            return 403, why, ()
        why = body_refusal(method, headers)
        if why is not None:
            return 415, why, ()
        scope[IDENTITY_KEY], scope[SESSION_KEY] = session.user, session
        return None

    def _signin(self, scope, headers: dict[bytes, bytes], route: Route) -> tuple | None:
        """A sign-in route (Host and Origin checked): its session, if the request has one,
        into the scope; a change made with a session needs the CSRF token, except the sign-in
        form itself, whose body may be form-encoded."""
        token = session_cookie(headers) if self.users is not None else None
        try:
            session = self.users.session(token) if self.users is not None and token else None
        except VisionServeError as exc:
            return _error(exc)
        if session is not None:
            scope[SESSION_KEY] = session
        if route.form:
            return None
        why = csrf_refusal(scope["method"], headers, session) if session is not None else None
        if why is not None:
            return 403, why, ()
        why = body_refusal(scope["method"], headers)
        return (415, why, ()) if why is not None else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scope.get(_RID_KEY)  # set once answer_from_head has checked this request
        headers = {} if rid else dict(scope.get("headers") or [])
        rid = rid or _request_id(headers)
        reset = request_id.set(rid)
        try:
            refused = None if _RID_KEY in scope else self._refusal(scope, headers)
            if refused is not None:
                status, message, extra = refused
                await _reply(send, rid, status, message, *extra)
                return

            async def send_with_id(message) -> None:
                if message["type"] == "http.response.start":
                    message.setdefault("headers", [])
                    message["headers"] = list(message["headers"]) + [
                        (b"x-request-id", rid.encode("latin-1"))]
                await send(message)

            await self.app(scope, receive, send_with_id)
        finally:
            request_id.reset(reset)


def _error(exc: VisionServeError) -> tuple:
    wait = retry_after(exc)
    return http_status(exc), exc.message, (((b"retry-after", wait.encode()),) if wait else ())


# where answer_from_head leaves the request id it gave to a request that passed its checks, for
# __call__ (scope key): present, the checks are not made twice
_RID_KEY = "visionserve.request_id"


def _request_id(headers: dict[bytes, bytes]) -> str:
    """The client's X-Request-Id (up to 64 characters), else a new one."""
    return headers.get(b"x-request-id", b"").decode("latin-1")[:64] or new_request_id()


async def _reply(send, rid: str, status: int, message: str, *headers: tuple[bytes, bytes]) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), *headers,
        (b"x-request-id", rid.encode("latin-1")), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# --- gRPC -----------------------------------------------------------------------------------------

def grpc_auth_interceptor(access: Access):
    """A grpc.aio server interceptor with the rules of ``access`` (``authorization: Bearer``
    metadata); None when they let every call through."""
    if not access.token and not access.admin_required:
        return None
    import grpc

    def denial(code: grpc.StatusCode, message: str, handler):
        async def unary(request, context):
            await context.abort(code, message)

        async def stream(request, context):
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator

        if handler.request_streaming:
            if handler.response_streaming:
                return grpc.stream_stream_rpc_method_handler(stream)
            return grpc.stream_unary_rpc_method_handler(unary)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)

    class AuthInterceptor(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            kind = grpc_class(details.method)
            meta = dict(details.invocation_metadata or ())
            refused, _ = access.credential(kind, meta.get("authorization"))
            if refused is None:
                return await continuation(details)
            handler = await continuation(details)
            if handler is None:
                return None
            name = details.method.rsplit("/", 1)[-1]
            if refused == FORBIDDEN:
                return denial(grpc.StatusCode.PERMISSION_DENIED,
                              f"the inference token does not open {name}: {ADMIN_NEEDED}", handler)
            message = (f"{name}: {ADMIN_NEEDED}" if kind == ADMIN and access.admin_required
                       else "missing or wrong bearer token")
            return denial(grpc.StatusCode.UNAUTHENTICATED, message, handler)

    return AuthInterceptor()
