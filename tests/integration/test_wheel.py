"""The installed wheel works from any directory, without the source checkout.

Builds the wheel from a clean copy of what the build reads (no stale ``build/``), installs it
into a fresh venv, and runs the ``visionserve`` command from ``/``: ``serve`` with no
``--models`` starts on the default model the wheel carries and answers ready; ``bench --help``,
``guard --help`` and the tooling modules run. The venv gets the dependencies by a ``.pth`` line
naming this interpreter's site-packages (written after the install, so pip never sees the
checkout's editable install there): nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import pytest
from conftest import REPO, free_port

pytestmark = pytest.mark.slow

#: What the build reads: pyproject.toml's metadata, setup.py's hook and what it copies.
BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "visionserve",
                "visionserve_tools", "models/defect-classifier")


def _run(argv: list[str], venv: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd="/", env=_env(venv), capture_output=True, text=True,
                          timeout=timeout, check=False)


def _env(venv: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
           and not k.startswith("VISIONSERVE_")}
    return {**env, "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index",
                            "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("visionserve-*.whl")

    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                              "install", "--no-deps", "--no-index", str(wheel)],
                             capture_output=True, text=True, timeout=300, check=False)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    site = Path(_run([str(venv / "bin" / "python"), "-c",
                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"], venv)
                .stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_test_dependencies.pth").write_text("\n".join(sorted(deps)) + "\n")
    return venv


def test_the_installed_wheel_is_what_runs(venv):
    code = ("import visionserve, visionserve_tools\n"
            "from visionserve.config import default_models_dir\n"
            "print(visionserve.__file__); print(visionserve_tools.__file__)\n"
            "print(default_models_dir())")
    run = _run([str(venv / "bin" / "python"), "-c", code], venv)
    assert run.returncode == 0, run.stderr
    package, tools, models = (Path(line) for line in run.stdout.split())
    for path in (package, tools, models):
        assert path.is_relative_to(venv) and not path.is_relative_to(REPO), path
    assert (models / "defect-classifier" / "model.toml").is_file()
    assert (models / "defect-classifier" / "1" / "model.onnx").is_file()


def test_serve_from_root_starts_on_the_shipped_model(venv, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(venv / "bin" / "visionserve"), "serve", "--device", "cpu",
                                 "--host", "127.0.0.1", "--http-port", str(port),
                                 "--grpc-port", "-1"],
                                cwd="/", env=_env(venv), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        ready = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2)
                if ready.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        assert ready is not None and ready.status_code == 200, log.read_text()[-3000:]
        model = httpx.get(f"http://127.0.0.1:{port}/v2/models/defect-classifier", timeout=5)
        assert model.status_code == 200, model.text
        # the console: its templates and files come from the installed package
        page = httpx.get(f"http://127.0.0.1:{port}/ui/models", timeout=10)
        assert page.status_code == 200 and "defect-classifier" in page.text, page.text[-2000:]
        for name in ("console.css", "console.js"):
            asset = httpx.get(f"http://127.0.0.1:{port}/ui/static/{name}", timeout=5)
            assert asset.status_code == 200 and asset.content, name
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("argv", [
    ["visionserve", "bench", "--help"],
    ["visionserve", "guard", "--help"],
    ["python", "-m", "visionserve_tools.benchguard", "--help"],
    ["python", "-m", "visionserve_tools.training.train", "--help"],
])
def test_commands_run_from_root(venv, argv):
    run = _run([str(venv / "bin" / argv[0]), *argv[1:]], venv)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "usage:" in run.stdout
