"""deploy/build-image.sh and what it builds, checked without a Docker engine (issue 23): the tags it
gives are the ones compose and Kubernetes run, and the build host's pip settings reach the build as
secrets only. The image itself is run in tests/docker."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "build-image.sh"
VERSION = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE).group(1)


def test_script_parses_and_documents_itself():
    assert SCRIPT.stat().st_mode & 0o111, "not executable"
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    out = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0 and "--target cpu|gpu|all" in out.stdout
    bad = subprocess.run(["bash", str(SCRIPT), "--target", "tpu"], capture_output=True, text=True,
                         timeout=30, check=False)
    assert bad.returncode == 2 and "tpu" in bad.stderr


def test_tags_built_are_the_ones_compose_and_kubernetes_run():
    text = SCRIPT.read_text()
    assert 'tag="visionserve:$VERSION-cpu"' in text and 'tag="visionserve:$VERSION"' in text
    # (the CPU override has Compose's own !reset tags, which yaml.safe_load refuses)
    for name, tag in (("docker-compose.yml", VERSION), ("docker-compose.cpu.yml", f"{VERSION}-cpu")):
        images = set(re.findall(r"^\s+image: (.+)$", (ROOT / "deploy" / name).read_text(), re.MULTILINE))
        assert images == {f"${{VISIONSERVE_IMAGE:-visionserve:{tag}}}"}, (name, images)
    kustomization = yaml.safe_load((ROOT / "deploy" / "k8s" / "kustomization.yaml").read_text())
    images = {i["name"]: i for i in kustomization["images"]}
    assert images["visionserve"]["newTag"] == VERSION
    deployment = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].split(":")[0] == "visionserve"


def test_pip_settings_reach_the_build_as_secrets_only():
    dockerfile = (ROOT / "Dockerfile").read_text()
    runs = re.findall(r"^RUN (?:.*\\\n)*.*$", dockerfile, re.MULTILINE)
    pip_runs = [r for r in runs if "pip install" in r]
    assert pip_runs
    for run in pip_runs:
        assert "--mount=type=secret,id=pip.conf" in run and "--mount=type=secret,id=pip-ca" in run, run
    # the secret's path is set in the builder only; the runtime stages never see it
    runtime = dockerfile[dockerfile.index("AS runtime-base"):]
    assert "PIP_CONFIG_FILE" not in runtime
    text = SCRIPT.read_text()
    assert "--secret \"id=pip.conf" in text and "--secret \"id=pip-ca" in text
    assert "--build-arg \"PIP_" not in text and "--build-arg PIP_" not in text
