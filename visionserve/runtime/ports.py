"""The listening ports, taken before anything else starts: a port that another program holds is
one clear line and exit code 2, not a traceback, a raw gRPC C-core log line or an abort (a bind
that failed inside uvicorn exited while a model was loading in another thread)."""

from __future__ import annotations

import errno
import socket

from ..errors import ConfigError


def listen_socket(host: str, port: int, option: str, *, reuse_port: bool = False,
                  listen: bool = True) -> socket.socket:
    """A socket bound to ``host:port`` (listening unless ``listen`` is False); ConfigError naming
    the command-line ``option`` that set the port when it cannot be had."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(addr)
            if listen:
                sock.listen(2048)
        except OSError:
            sock.close()
            raise
        return sock
    except OSError as exc:
        why = "address already in use: stop the program that listens there, or choose " \
              f"another {option}" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ConfigError(f"cannot listen on {host or '*'}:{port} ({option}): {why}") from None


def check_free(host: str, port: int, option: str) -> None:
    """ConfigError (see :func:`listen_socket`) when ``host:port`` cannot be bound now; the
    port is left free for the server that binds it next (gRPC binds its own)."""
    if port > 0:
        listen_socket(host, port, option, listen=False).close()
