"""The commands that only diagnose or queue work (``env``, ``doctor``, ``guard``) import neither
the web server nor a model runtime: they work, and start fast, where those are broken or absent.
Each runs in a fresh interpreter that then says which heavy modules it loaded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: web/RPC frameworks and model runtimes
HEAVY = ("uvicorn", "fastapi", "starlette", "grpc", "torch", "onnxruntime")

# runs the command line's main() as ``visionserve ARGS`` does, then reports sys.modules
WRAPPER = f"""
import contextlib, io, json, sys
from visionserve.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
print(json.dumps({{"code": code, "loaded": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def _run(*argv: str) -> dict:
    run = subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True, text=True,
                         cwd=REPO, timeout=300, check=False)
    assert run.stdout.strip(), run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [
    ("env",), ("env", "--json"), ("doctor",), ("doctor", "--help"), ("guard", "--help"),
    ("guard", "list"), ("serve", "--help"),
], ids=" ".join)
def test_command_imports_no_web_server_or_model_runtime(argv, tmp_path):
    if argv == ("guard", "list"):
        argv = (*argv, "--db", str(tmp_path / "guard.sqlite"))
    result = _run(*argv)
    if argv != ("doctor",):  # doctor's exit code says what it found on this machine
        assert result["code"] in (0, None), result
    assert result["loaded"] == [], f"visionserve {' '.join(argv)} imported {result['loaded']}"


def test_the_check_sees_a_heavy_import():
    """The wrapper would say so: serving builds the HTTP app, which needs the web framework."""
    run = subprocess.run([sys.executable, "-c", "import visionserve.http.server\n" + WRAPPER,
                          "env", "--json"], capture_output=True, text=True, cwd=REPO, timeout=300,
                         check=False)
    loaded = json.loads(run.stdout.strip().splitlines()[-1])["loaded"]
    assert "uvicorn" in loaded and "fastapi" in loaded
