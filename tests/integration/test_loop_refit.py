"""The closed loop's other ways of training a candidate (docs/closed-loop.md), on a real server
with a real guard (``--guard --records --capture learn``):

- the shipped anomaly model refitted with the good parts among its captures (a new good look of
  the surface, which it falsely rejects, labelled good; OK frames sampled), no defect learnt;
  its candidate compared with the live version: false rejects on the held-out good frames fall,
  the defects labelled defective are still rejected;
- a model's own training command (``[training] command`` in its model.toml, a small real
  script) run as the guard job in the model's folder, handed the labelled set: a folder per
  label for a classifier, images and boxes.json for a detector;
- a model with no way to train it refused with a 409 that names the [training] command.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from conftest import REPO, start_server, wait_for

from tests.integration.test_console_users import add_users, quality_session, session_client
from tests.integration.test_records_images import shipped_repo
from visionserve_tools import synthetic

ANOMALY, CLASSIFIER, DETECTOR, PLAIN = ("surface-anomaly", "defect-classifier", "defect-detector",
                                        "plain-classifier")
TOKEN = "refit-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SIZE = (320, 240)
#: a new good look of the surface the shipped anomaly model was not fitted on: it rejects most
NEW_LOOK = synthetic.SurfaceParams(textures=("textile",), texture_contrast=(2.4, 2.8),
                                   grain_scale=(0.9, 1.2), brightness=(0.45, 0.6),
                                   saturation=(0.2, 0.3), max_rotation_deg=2)
COMMAND = ('\n[training]\ncommand = ["{python}", "train.py", "{data}", "{out}", "--from", '
           '"{from}"]\n')


def add_command(folder: Path, extra: str = "") -> None:
    shutil.copy(REPO / "tests" / "tools" / "copy_train.py", folder / "train.py")
    with (folder / "model.toml").open("a") as f:
        f.write(COMMAND.replace('"{from}"]', f'"{{from}}"{extra}]'))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("refit")
    add_users(tmp / "xdg")
    repo = tmp / "repo"
    for name in (ANOMALY, CLASSIFIER, DETECTOR):
        shutil.copytree(REPO / "models" / name, repo / name)
    shutil.copytree(REPO / "models" / CLASSIFIER, repo / PLAIN)
    (repo / PLAIN / "1" / "weights.pt").unlink()  # a user's export: nothing to fine-tune
    text = (repo / PLAIN / "model.toml").read_text()
    (repo / PLAIN / "model.toml").write_text(text.replace(f'name = "{CLASSIFIER}"',
                                                          f'name = "{PLAIN}"'))
    add_command(repo / CLASSIFIER)
    add_command(repo / DETECTOR)
    for path in [repo, *repo.rglob("*")]:  # the server refuses a repository others can write
        path.chmod(path.stat().st_mode & 0o755)
    s = start_server(repo, tmp, "--host", "0.0.0.0", "--trusted-proxies", "127.0.0.1",
                     "--admin-token", TOKEN, "--records", "--records-dir", str(tmp / "data"),
                     "--capture", "learn", "--capture-sample-percent", "100",
                     "--guard", "--guard-db", str(tmp / "guard.sqlite"), grpc=False,
                     env={"XDG_DATA_HOME": str(tmp / "xdg")})
    s.repo = repo
    yield s
    s.stop()


@pytest.fixture(scope="module")
def quality(server):
    yield from quality_session(server, "198.51.100.221")


def inspect(server, model: str, image, part: str) -> dict:
    r = httpx.post(f"{server.url}/v1/models/{model}/inspect", timeout=60,
                   content=synthetic.encode(image),
                   headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                            "X-Deadline-Ms": "10000"})
    assert r.status_code == 200, r.text
    return r.json()


def records(server, model: str) -> list[dict]:
    return httpx.get(f"{server.url}/v1/records", params={"limit": 500, "model": model},
                     headers=ADMIN, timeout=10).json()["records"]


def wait_state(client: httpx.Client, path: str, timeout: float = 300) -> dict:
    def settled():
        body = client.get(path).json()
        return body if body["state"] in ("done", "failed") else None
    return wait_for(settled, timeout, f"{path} to finish")


def label(client: httpx.Client, record_id: int, body: dict) -> None:
    r = client.put(f"/v1/records/{record_id}/label", json=body)
    assert r.status_code == 200, r.text


def test_the_anomaly_model_is_refitted_with_its_good_parts(server, quality):
    base = f"/v1/models/{ANOMALY}/candidates"
    r = quality.post(base, json={})
    assert r.status_code == 409 and "no good parts" in r.json()["error"], r.text
    assert not (server.repo / ANOMALY / "candidates" / "c-1").exists()

    frames = ([("usual", synthetic.generate("ok", 100 + i, SIZE)) for i in range(12)]
              + [("new", synthetic.generate("ok", 200 + i, SIZE, NEW_LOOK)) for i in range(40)]
              + [(look, synthetic.generate(look, 300 + i, SIZE))
                 for i in range(2) for look in synthetic.DEFECT_LABELS])
    for i, (kind, image) in enumerate(frames):
        inspect(server, ANOMALY, image, f"A-{i}")
    wait_for(lambda: len(records(server, ANOMALY)) >= len(frames), 30, "every record")
    kinds = {}
    for rec in records(server, ANOMALY):
        kind = frames[int(rec["part_id"][2:])][0]
        kinds[rec["id"]] = kind
        if kind == "new" and rec["verdict"] == "NG":  # "this NG was wrong"
            label(quality, rec["id"], {"label": "good", "verdict_was_wrong": True})
        elif kind not in ("new", "usual"):
            label(quality, rec["id"], {"label": "defective"})
    rejected_new = sum(1 for rec in records(server, ANOMALY)
                       if kinds[rec["id"]] == "new" and rec["verdict"] == "NG")
    assert rejected_new >= 20  # the live version rejects the new look

    r = quality.post(base, json={})
    assert r.status_code == 202, r.text
    shown = r.json()
    job = httpx.get(f"{server.url}/v1/guard/jobs/{shown['job']['id']}", headers=ADMIN).json()
    assert "visionserve_tools.training.refit" in job["command"]
    assert "--original" not in job["command"]  # the shipped model's good images are not here
    done = wait_state(quality, f"{base}/{shown['id']}")
    assert done["state"] == "done", (done, server.log()[-3000:])
    c = done["candidate"]
    assert c["kind"] == "refit" and c["created_by"] == "qe-anna"
    trained = {x["record_id"]: x for x in c["trained_on"]}
    held = {x["record_id"]: x for x in c["held_out"]}
    assert not set(trained) & set(held)
    assert {x["label"] for x in trained.values()} == {"good"}  # never a defect
    assert {kinds[i] for i in trained} == {"usual", "new"}
    sampled = [x for x in trained.values() if x["labelled_by"] is None]
    assert sampled and all(x["kept_for"] == "sample" for x in sampled)
    assert c["recipe"]["sampled_ok"] == len(sampled) and c["recipe"]["original_data"] is None
    defective = {i for i, k in kinds.items() if k not in ("new", "usual")}
    assert defective <= set(held)  # every defect measures recall
    assert c["metrics"]["memory_bank_rows"] > c["metrics"]["kept_rows"] == 4096
    folder = server.repo / ANOMALY / "candidates" / shown["id"]
    for name in ("model.onnx", "model.pt2", "metadata.json", "fit.json", "candidate.json"):
        assert (folder / name).is_file(), name
    meta = httpx.get(f"{server.url}/v2/models/{ANOMALY}", timeout=10).json()
    assert meta["versions"] == ["1"]  # never served

    r = quality.post(f"{base}/{shown['id']}/evaluate")
    assert r.status_code == 202, r.text
    result = wait_state(quality, f"{base}/{shown['id']}/comparison", 180)
    assert result["state"] == "done", (result, server.log()[-3000:])
    live, cand = result["summary"]["live"], result["summary"]["candidate"]
    print("refit comparison:", json.dumps({"live": live, "candidate": cand}))
    assert live["ok_frames"] >= 5 and live["ng_frames"] == len(defective)
    assert cand["false_reject_rate"] < live["false_reject_rate"]
    assert cand["ng_recall"] >= 0.75 and live["ng_recall"] >= 0.75


def test_a_models_own_training_command_runs_as_the_guard_job(server, quality):
    base = f"/v1/models/{CLASSIFIER}/candidates"
    looks = [(look, seed) for seed in range(2) for look in synthetic.LABELS]
    for i, (look, seed) in enumerate(looks):
        inspect(server, CLASSIFIER, synthetic.generate(look, seed), f"C-{i}")
    wait_for(lambda: len(records(server, CLASSIFIER)) >= len(looks), 30, "every record")
    for rec in records(server, CLASSIFIER):
        label(quality, rec["id"], {"label": looks[int(rec["part_id"][2:])][0]})
    r = quality.post(base, json={"steps": 5})
    assert r.status_code == 202, r.text
    shown = r.json()
    folder = server.repo / CLASSIFIER / "candidates" / shown["id"]
    assert shown["job"]["command"] == [sys.executable, "train.py", str(folder / "train"),
                                       str(folder), "--from", str(server.repo / CLASSIFIER / "1")]
    job = httpx.get(f"{server.url}/v1/guard/jobs/{shown['job']['id']}", headers=ADMIN).json()
    assert job["cwd"] == str(server.repo / CLASSIFIER)
    done = wait_state(quality, f"{base}/{shown['id']}", 120)
    assert done["state"] == "done", (done, server.log()[-3000:])
    c = done["candidate"]
    assert c["kind"] == "command" and c["expects"] == ["model.onnx"]
    counted = c["metrics"]["images"]
    assert sum(counted.values()) == len(c["trained_on"]) == c["recipe"]["labelled_frames"]
    assert set(counted) <= set(synthetic.LABELS)
    assert c["metrics"]["cwd"] == str(server.repo / CLASSIFIER)
    assert filecmp.cmp(folder / "model.onnx", server.repo / CLASSIFIER / "1" / "model.onnx")
    # the comparison runs on it as on any classifier candidate: the same model, no disagreement
    r = quality.post(f"{base}/{shown['id']}/evaluate")
    assert r.status_code == 202, r.text
    result = wait_state(quality, f"{base}/{shown['id']}/comparison", 120)
    assert result["state"] == "done" and result["summary"]["disagree"] == [], result


def test_a_detectors_command_is_handed_its_boxes(server, quality):
    base = f"/v1/models/{DETECTOR}/candidates"
    for i in range(6):
        inspect(server, DETECTOR, synthetic.generate("scratch" if i % 2 else "ok", 40 + i),
                f"D-{i}")
    wait_for(lambda: len(records(server, DETECTOR)) >= 6, 30, "every record")
    boxes = {}
    for rec in records(server, DETECTOR):
        body = [{"label": "scratch", "box": [10, 20, 110, 60]}] if rec["id"] % 2 else []
        label(quality, rec["id"], {"boxes": body})
        boxes[rec["id"]] = body
    r = quality.post(base, json={})
    assert r.status_code == 202, r.text
    shown = r.json()
    done = wait_state(quality, f"{base}/{shown['id']}", 120)
    assert done["state"] == "done", (done, server.log()[-3000:])
    c = done["candidate"]
    folder = server.repo / DETECTOR / "candidates" / shown["id"]
    assert c["metrics"]["images"] == {"images": len(c["trained_on"])}
    assert {x["record_id"]: x["boxes"] for x in c["trained_on"] + c["held_out"]} == boxes
    assert all(x["file"].startswith("train/images/") for x in c["trained_on"])
    assert not (folder / "train").exists()  # the training frames go once it is done
    if c["held_out"]:  # the held-out part stays, in the same layout
        kept = json.loads((folder / "heldout" / "boxes.json").read_text())
        assert kept == {x["file"].removeprefix("heldout/"): x["boxes"] for x in c["held_out"]}


def test_a_model_without_a_way_to_train_it_is_refused(server, quality):
    r = quality.post(f"/v1/models/{PLAIN}/candidates", json={})
    assert r.status_code == 409, r.text
    assert "no weights.pt" in r.json()["error"] and "[training] command" in r.json()["error"]
    assert not (server.repo / PLAIN / "candidates").exists() or not any(
        (server.repo / PLAIN / "candidates").iterdir())
    viewer, vcsrf = session_client(server, "otto", "198.51.100.222")
    with viewer:
        r = viewer.post(f"/v1/models/{ANOMALY}/candidates", json={},
                        headers={"X-CSRF-Token": vcsrf})
        assert r.status_code == 403, r.text
    r = quality.post(f"/v1/models/{ANOMALY}/candidates", json={},
                     headers={"Origin": "http://evil.example"})
    assert r.status_code == 403


def test_a_failing_command_fails_the_candidate(tmp_path):
    """A command that exits without writing its model: the candidate says failed, with why."""
    repo = shipped_repo(tmp_path / "repo", (CLASSIFIER,))
    (repo / CLASSIFIER / "model.toml").chmod(0o644)
    add_command(repo / CLASSIFIER, ', "--fail"')
    for path in [repo, *repo.rglob("*")]:
        path.chmod(path.stat().st_mode & 0o755)
    s = start_server(repo, tmp_path, "--admin-token", TOKEN, "--records", "--records-dir",
                     str(tmp_path / "data"), "--capture", "learn", "--capture-sample-percent",
                     "100", "--guard", "--guard-db",
                     str(tmp_path / "guard.sqlite"), grpc=False)
    try:
        client = httpx.Client(base_url=s.url, headers=ADMIN, timeout=30)
        r = client.post(f"/v1/models/{CLASSIFIER}/candidates", json={})
        assert r.status_code == 409 and "no labelled captures" in r.json()["error"]
        for i in range(6):
            inspect(s, CLASSIFIER, synthetic.generate("scratch" if i % 2 else "ok", i), f"F-{i}")
        wait_for(lambda: len(records(s, CLASSIFIER)) >= 6, 30, "every record")
        for rec in records(s, CLASSIFIER):
            label(client, rec["id"], {"label": "scratch" if int(rec["part_id"][2:]) % 2
                                      else "ok"})
        r = client.post(f"/v1/models/{CLASSIFIER}/candidates", json={})
        assert r.status_code == 202, r.text
        done = wait_state(client, f"/v1/models/{CLASSIFIER}/candidates/{r.json()['id']}", 120)
        assert done["state"] == "failed" and done["reason"], done
    finally:
        s.stop()
