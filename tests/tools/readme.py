"""The README's walkthroughs, run as a new user runs them: the commands of a section's ``bash``
block, in a folder of their own, with ``.venv/bin/python`` and ``.venv/bin/visionserve`` the
interpreter under test; its ``serve`` line is a real server on free loopback ports, and the
commands after it talk to that server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO, start_server

SERVE = ".venv/bin/visionserve serve "


def section(title: str) -> str:
    """The README's text from heading ``title`` (``### ...``) to the next one of its level or
    above (a ``#`` line inside a code block is no heading)."""
    lines = (REPO / "README.md").read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    level = len(title) - len(title.lstrip("#"))
    fenced = False
    for i in range(start + 1, len(lines)):
        fenced ^= lines[i].startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", lines[i]):
            return "".join(lines[start:i])
    return "".join(lines[start:])


def bash_block(title: str) -> str:
    """The first ``bash`` code block of section ``title``."""
    return re.search(r"```bash\n(.*?)```", section(title), re.S)[1]


def venv(folder: Path) -> None:
    """``folder/.venv/bin/{python,visionserve}``: this interpreter, on this checkout."""
    bin_ = folder / ".venv" / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    for name, args in (("python", ""), ("visionserve", " -m visionserve")):
        (bin_ / name).write_text(f'#!/bin/sh\nexec {sys.executable}{args} "$@"\n')
        (bin_ / name).chmod(0o755)


def bash(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=str(cwd), env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
    return done


def walk(title: str, cwd: Path, timeout: float = 300) -> str:
    """Run section ``title``'s commands in ``cwd``: those before ``serve``, then a server as the
    ``serve`` line asks (on loopback, free ports), then the rest against it. Returns the last
    commands' stdout."""
    venv(cwd)
    block = bash_block(title)
    before, serve, after = re.split(rf"^({re.escape(SERVE)}.*)$", block, maxsplit=1, flags=re.M)
    bash(before, cwd, timeout)
    args = serve[len(SERVE):].split()
    assert args[:2] == ["--models", "models"], serve  # what start_server takes as its first
    server = start_server(cwd / "models", cwd, *args[2:], grpc=False)
    try:
        return bash(after.replace("localhost:8000", f"127.0.0.1:{server.http_port}"),
                    cwd, timeout).stdout
    finally:
        server.stop()
