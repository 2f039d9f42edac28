"""Users, sign-in sessions and failed-login counters, in one SQLite file (docs/security.md, "Users
and the console's sign-in").

One file because with ``--frontends N`` the HTTP front ends are separate processes: a session
made in one must be valid in every other, and a logout must end it in all of them at once. Every
process reads the same file (WAL: readers never wait for a writer), so there is no secret to
share and no revocation list to keep in step, and ``visionserve users`` changes users while the
server runs. The file is made with mode 0600; it holds argon2 hashes of the passwords and SHA-256
hashes of the session ids, never a password or a session id itself.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from ..config import USERS_DB_ENV
from ..errors import Unavailable
from ..storage import open_sqlite, sqlite_fault

#: the roles, lowest first: each one may do what the ones before it may
ROLES = ("viewer", "quality", "admin")
VIEWER, QUALITY, ADMIN = ROLES

DB_ENV = USERS_DB_ENV
DEFAULT_DB = "$XDG_DATA_HOME/visionserve/users.sqlite"  # how help texts name the default

#: names the audit line uses for credentials (docs/security.md); no user may take them
RESERVED_NAMES = frozenset({"admin-token", "loopback"})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
MIN_PASSWORD, MAX_PASSWORD = 8, 1024

# failed sign-ins, per user name and per client address: the first FREE_FAILURES pass at once;
# after that each attempt must wait FIRST_DELAY_S, doubled at every further failure up to
# MAX_DELAY_S (429 with Retry-After until then); a key forgets after FORGET_S without failures
FREE_FAILURES = 3
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 900.0
FORGET_S = 3600.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY, role TEXT NOT NULL, hash TEXT NOT NULL,
    created REAL NOT NULL, changed REAL NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    key TEXT PRIMARY KEY, user TEXT NOT NULL, csrf TEXT NOT NULL,
    created REAL NOT NULL, expires REAL NOT NULL);
CREATE INDEX IF NOT EXISTS sessions_user ON sessions (user);
CREATE TABLE IF NOT EXISTS login_failures (
    key TEXT PRIMARY KEY, failures INTEGER NOT NULL, last REAL NOT NULL);
"""

_hasher = PasswordHasher()  # argon2id, the library's defaults (RFC 9106, low-memory profile)


class UserError(ValueError):
    """A user name, role or password that cannot be taken."""


class UserConflict(UserError):
    """A user that is not there, or a name that is taken."""


@dataclass(frozen=True)
class User:
    name: str
    role: str
    created: float


@dataclass(frozen=True)
class Session:
    """A signed-in user. ``key`` is the SHA-256 of the cookie's session id (what the file
    keeps); ``role`` is the user's role now, not at sign-in."""

    key: str
    user: str
    role: str
    csrf_token: str
    expires: float


def role_covers(role: str, needed: str) -> bool:
    """True when ``role`` may do what ``needed`` may (admin covers quality covers viewer)."""
    return role in ROLES and ROLES.index(role) >= ROLES.index(needed)


def check_name(name: str) -> str:
    if not _NAME.match(name) or name in RESERVED_NAMES:
        raise UserError(f"bad user name {name!r}: 1 to 64 letters, digits and . _ @ -, starting "
                        "with a letter or digit" + (f"; {name!r} is reserved for the audit line"
                                                    if name in RESERVED_NAMES else ""))
    return name


def check_role(role: str) -> str:
    if role not in ROLES:
        raise UserError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    return role


def check_password(password: str) -> str:
    if not MIN_PASSWORD <= len(password) <= MAX_PASSWORD:
        raise UserError(f"a password needs {MIN_PASSWORD} to {MAX_PASSWORD} characters")
    return password


def login_delay(failures: int) -> float:
    """Seconds an attempt must wait after ``failures`` failed ones in a row."""
    if failures < FREE_FAILURES:
        return 0.0
    return min(FIRST_DELAY_S * 2 ** (failures - FREE_FAILURES), MAX_DELAY_S)


def session_key(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class UserStore:
    """The users file. ``create``: make it (mode 0600, its folder 0700) where it is missing;
    else a missing file raises FileNotFoundError. Safe to use from several threads (one
    connection each) and processes (SQLite's locks)."""

    def __init__(self, path: Path, create: bool = False) -> None:
        self.path = Path(path)
        if create:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        elif not self.path.is_file():
            raise FileNotFoundError(self.path)
        self._local = threading.local()
        self._db.executescript(_SCHEMA)
        self._dummy: str | None = None

    @property
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = open_sqlite(str(self.path), 5.0)
            db.execute("PRAGMA journal_mode=WAL")
            self._local.db = db
        return db

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A transaction that takes the write lock at once (several statements as one)."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    # --- users ------------------------------------------------------------------------------

    def add(self, name: str, role: str, password: str) -> None:
        check_name(name)
        check_role(role)
        check_password(password)
        now = time.time()
        try:
            self._db.execute("INSERT INTO users VALUES (?, ?, ?, ?, ?)",
                             (name, role, _hasher.hash(password), now, now))
        except sqlite3.IntegrityError:
            raise UserConflict(f"user {name!r} exists (users passwd, users role change "
                               "it)") from None

    def remove(self, name: str) -> None:
        """Remove a user and end their sessions."""
        with self._write() as db:
            if db.execute("DELETE FROM users WHERE name = ?", (name,)).rowcount == 0:
                raise self._missing(name)
            db.execute("DELETE FROM sessions WHERE user = ?", (name,))

    def set_password(self, name: str, password: str) -> None:
        """A new password; the user's sessions end (a password change locks out who knew the
        old one)."""
        digest = _hasher.hash(check_password(password))
        with self._write() as db:
            if db.execute("UPDATE users SET hash = ?, changed = ? WHERE name = ?",
                          (digest, time.time(), name)).rowcount == 0:
                raise self._missing(name)
            db.execute("DELETE FROM sessions WHERE user = ?", (name,))

    def set_role(self, name: str, role: str) -> None:
        """A new role, in force at the user's next request (sessions read the role live)."""
        check_role(role)
        if self._db.execute("UPDATE users SET role = ?, changed = ? WHERE name = ?",
                            (role, time.time(), name)).rowcount == 0:
            raise self._missing(name)

    def users(self) -> list[User]:
        return [User(*row) for row in self._db.execute(
            "SELECT name, role, created FROM users ORDER BY name")]

    def count(self) -> int:
        return self._db.execute("SELECT count(*) FROM users").fetchone()[0]

    def authenticate(self, name: str, password: str) -> User | None:
        """The user when ``password`` is theirs, else None, taking as long for a name nobody
        has (a hash is checked either way). Slow on purpose (argon2): call off the event loop."""
        row = self._db.execute("SELECT name, role, created, hash FROM users WHERE name = ?",
                               (name,)).fetchone()
        if row is None:
            self._dummy = self._dummy or _hasher.hash(secrets.token_urlsafe(16))
            stored, user = self._dummy, None
        else:
            stored, user = row[3], User(*row[:3])
        try:
            _hasher.verify(stored, password)
        except (VerificationError, InvalidHashError):
            return None
        if user is not None and _hasher.check_needs_rehash(stored):
            self._db.execute("UPDATE users SET hash = ? WHERE name = ?",
                             (_hasher.hash(password), user.name))
        return user

    @staticmethod
    def _missing(name: str) -> UserConflict:
        return UserConflict(f"no user {name!r} (users list shows them)")

    # --- sessions ---------------------------------------------------------------------------

    def open_session(self, user: str, ttl_s: float) -> tuple[str, Session]:
        """(the session id for the cookie, the session); ended sessions past their expiry are
        cleared on the way."""
        token, csrf, now = secrets.token_urlsafe(32), secrets.token_urlsafe(32), time.time()
        key = session_key(token)
        with self._write() as db:
            db.execute("DELETE FROM sessions WHERE expires <= ?", (now,))
            role = db.execute("SELECT role FROM users WHERE name = ?", (user,)).fetchone()
            if role is None:
                raise self._missing(user)
            db.execute("INSERT INTO sessions VALUES (?, ?, ?, ?, ?)",
                       (key, user, csrf, now, now + ttl_s))
        return token, Session(key, user, role[0], csrf, now + ttl_s)

    def session(self, token: str) -> Session | None:
        """The live session of a cookie's session id, or None (unknown, ended, expired, or its
        user removed). One indexed read: called on the event loop for protected requests."""
        row = self._db.execute(
            "SELECT s.key, s.user, u.role, s.csrf, s.expires FROM sessions s "
            "JOIN users u ON u.name = s.user WHERE s.key = ? AND s.expires > ?",
            (session_key(token), time.time())).fetchone()
        return Session(*row) if row else None

    def end_session(self, key: str) -> None:
        self._db.execute("DELETE FROM sessions WHERE key = ?", (key,))

    # --- failed sign-ins --------------------------------------------------------------------

    def login_wait(self, keys: tuple[str, ...]) -> float:
        """Seconds before a sign-in for these throttle keys (``user:NAME``, ``addr:IP``) may be
        tried; 0: now."""
        now, wait = time.time(), 0.0
        for failures, last in self._db.execute(
                f"SELECT failures, last FROM login_failures WHERE key IN "
                f"({','.join('?' * len(keys))})", keys):
            if now - last < FORGET_S:
                wait = max(wait, last + login_delay(failures) - now)
        return wait

    def login_failed(self, keys: tuple[str, ...]) -> None:
        now = time.time()
        with self._write() as db:
            # forgotten counters go, so that made-up user names cannot grow the file for long
            db.execute("DELETE FROM login_failures WHERE last < ?", (now - FORGET_S,))
            for key in keys:
                db.execute(
                    "INSERT INTO login_failures VALUES (?, 1, ?) ON CONFLICT (key) DO UPDATE SET "
                    "failures = CASE WHEN ? - last < ? THEN failures + 1 ELSE 1 END, last = ?",
                    (key, now, now, FORGET_S, now))

    def login_succeeded(self, key: str) -> None:
        self._db.execute("DELETE FROM login_failures WHERE key = ?", (key,))


class Users:
    """A server process's handle on the users file, opened at its first use once it exists (the
    CLI may make it while the server runs). Until then there are no users, and no sessions."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._store: UserStore | None = None
        self._lock = threading.Lock()

    def store(self) -> UserStore | None:
        if self._store is None and self.path.is_file():
            with self._lock:
                if self._store is None:
                    self._store = UserStore(self.path)
        return self._store

    def session(self, token: str) -> Session | None:
        """The live session of a cookie's id, or None. Raises Unavailable (503) where the file
        cannot be read: no request is let through for it."""
        with self._readable():
            store = self.store()
            return store.session(token) if store is not None else None

    def any_user(self) -> bool:
        with self._readable():
            store = self.store()
            return store is not None and store.count() > 0

    @contextmanager
    def _readable(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            if not sqlite_fault(exc):
                raise  # a bug, not the file's fault
            raise Unavailable(f"the console's users file {self.path} cannot be read ({exc}); "
                              "sessions are refused until it can", retry_after_s=5.0) from None

    def describe(self) -> str:
        """A start-up line: how many users of which role, or that there are none."""
        try:
            store = self.store()
            users = store.users() if store is not None else []
        except sqlite3.Error as exc:  # the server still starts: sessions are refused (503)
            return f"console sign-in: the users file {self.path} cannot be read ({exc})"
        if not users:
            return (f"console sign-in: no users in {self.path}; protected routes follow the rule "
                    "above ('visionserve users add' makes one)")
        roles = ", ".join(f"{r} {n}" for r in ROLES
                          if (n := sum(u.role == r for u in users)))
        return (f"console sign-in: {len(users)} users in {self.path} ({roles}): protected routes "
                "also take a session of a high enough role")
