"""deploy/k8s and deploy/kserve: schema-valid (kubernetes-validate, offline schemas) and in
agreement with the server's settings and the image (ports, probes, grace periods, UID)."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from visionserve.config import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KSERVE = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"
# The oldest Kubernetes still common on plant clusters, and the newest the validator knows.
K8S_VERSIONS = ("1.28.0", None)


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _docs(path):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


@pytest.fixture(scope="module")
def deployment(manifests) -> dict:
    return manifests[("Deployment", "visionserve")]


@pytest.fixture(scope="module")
def container(deployment) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture()
def settings(manifests, monkeypatch) -> ServerSettings:
    """ServerSettings as the pod sees them: defaults overridden by the ConfigMap."""
    data = manifests[("ConfigMap", "visionserve-settings")]["data"]
    fields = set(ServerSettings.model_fields)
    unknown = [k for k in data if k.removeprefix("VISIONSERVE_").lower() not in fields]
    assert not unknown, f"ConfigMap keys that are not ServerSettings fields (silently ignored): {unknown}"
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    return ServerSettings()


# --- schemas ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kv():
    return pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")


def _version(kv, v: str | None) -> str:
    return v or kv.latest_version()


@pytest.mark.parametrize("version", K8S_VERSIONS, ids=lambda v: v or "latest")
def test_manifests_match_kubernetes_schemas(kv, manifests, version):
    for doc in manifests.values():
        kv.validate(doc, _version(kv, version), strict=True)   # raises, naming the bad field


def test_validator_catches_a_mistake(kv, deployment):
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/x"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, _version(kv, None), strict=True)


def test_kustomization_lists_every_manifest():
    kustom = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustom["resources"]) == files


# --- agreement with the server ------------------------------------------------------------

def _port(container: dict, ref) -> int:
    if isinstance(ref, int):
        return ref
    (p,) = [p for p in container["ports"] if p["name"] == ref]
    return p["containerPort"]


def test_container_ports_match_settings(container, settings):
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.http_port, "grpc": settings.grpc_port}
    defaults = ServerSettings.model_fields
    assert settings.http_port == defaults["http_port"].default
    assert settings.grpc_port == defaults["grpc_port"].default


def test_probes(container, settings):
    for name, path in (("readinessProbe", "/v2/health/ready"), ("startupProbe", "/v2/health/ready"),
                       ("livenessProbe", "/v2/health/live")):
        probe = container[name]["httpGet"]
        assert probe["path"] == path, name
        assert _port(container, probe["port"]) == settings.http_port, name
    startup = container["startupProbe"]
    # warm-up (every batch size, CUDA graphs) must fit; the integration test allows 120 s
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def _prestop_seconds(container: dict) -> float:
    pre = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    cmd = pre["exec"]["command"]
    assert cmd[0] == "sleep" and len(cmd) == 2, cmd
    return float(cmd[1])


def test_grace_period_covers_prestop_and_drain(deployment, container, settings):
    pre = _prestop_seconds(container)
    assert pre > 0, "endpoints need a moment to drop the pod before SIGTERM"
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre + settings.drain_timeout_s, (
        f"terminationGracePeriodSeconds {grace} <= preStop {pre} + drain {settings.drain_timeout_s}")


def test_one_gpu_per_pod(container, settings):
    res = container["resources"]
    assert int(res["limits"]["nvidia.com/gpu"]) == 1
    if "nvidia.com/gpu" in res.get("requests", {}):
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"]
    assert {"cpu", "memory"} <= set(res["requests"]) and {"memory"} <= set(res["limits"])
    assert settings.device in ("cuda:0", "cuda"), "the device plugin shows the pod one GPU, cuda:0"


def test_security_context_matches_image_user(deployment, container):
    dockerfile = (ROOT / "Dockerfile").read_text()
    uid = int(re.findall(r"^USER\s+(\d+)", dockerfile, re.MULTILINE)[-1])
    pod = deployment["spec"]["template"]["spec"]["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == uid
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    if sc.get("readOnlyRootFilesystem"):
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/tmp" in mounts, "caches (CUDA_CACHE_PATH, XDG_CACHE_HOME) live under /tmp"


def test_no_service_links(deployment):
    """A Service named visionserve would inject VISIONSERVE_* variables: the settings prefix."""
    assert deployment["spec"]["template"]["spec"]["enableServiceLinks"] is False


def test_settings_come_from_the_configmap(container, manifests):
    refs = [e["configMapRef"]["name"] for e in container["envFrom"]]
    assert all(("ConfigMap", r) in manifests for r in refs) and refs


def test_service_routes_both_protocols(manifests, deployment, container):
    svc = manifests[("Service", "visionserve")]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc"]["appProtocol"] == "grpc"
    for name in ("http", "grpc"):
        assert _port(container, ports[name]["targetPort"]) == _port(container, name)


def test_selectors_match_pods(manifests, deployment):
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pdb = manifests[("PodDisruptionBudget", "visionserve")]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_hpa_scales_on_queue_depth(manifests, deployment):
    hpa = manifests[("HorizontalPodAutoscaler", "visionserve")]
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "visionserve_queue_depth"
    assert hpa["spec"]["minReplicas"] <= deployment["spec"]["replicas"] <= hpa["spec"]["maxReplicas"]


def test_queue_depth_metric_exists_in_the_server():
    source = ROOT / "visionserve" / "metrics.py"
    if not source.exists():
        pytest.skip("visionserve/metrics.py not written yet")
    assert "visionserve_queue_depth" in source.read_text()


# --- KServe example -----------------------------------------------------------------------

def test_kserve_example(settings):
    (isvc,) = _docs(KSERVE)
    assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
    predictor = isvc["spec"]["predictor"]
    assert predictor["protocolVersion"] == "v2"
    (c,) = predictor["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    http = int(env.get("VISIONSERVE_HTTP_PORT", settings.http_port))
    assert [p["containerPort"] for p in c["ports"]] == [http]
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": http}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": http}
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    drain = float(env.get("VISIONSERVE_DRAIN_TIMEOUT_S", settings.drain_timeout_s))
    assert predictor["terminationGracePeriodSeconds"] > drain


def test_admin_token_from_a_secret(settings, deployment, container):
    """Protected routes need the admin token, a Secret mounted as a file; inference needs none."""
    assert settings.admin_token_file is not None and settings.auth_token_file is None
    folder = str(settings.admin_token_file.parent)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] and mount["readOnly"]
    isvc = _docs(KSERVE)[0]["spec"]["predictor"]
    (c,) = isvc["containers"]
    env = {e["name"]: e["value"] for e in c["env"]}
    kfolder = env["VISIONSERVE_ADMIN_TOKEN_FILE"].rsplit("/", 1)[0]
    (kmount,) = [m for m in c["volumeMounts"] if m["mountPath"] == kfolder]
    (kvolume,) = [v for v in isvc["volumes"] if v["name"] == kmount["name"]]
    assert kvolume["secret"]["secretName"] == volume["secret"]["secretName"]
