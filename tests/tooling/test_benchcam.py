"""benchcam: trigger to verdict at a PLC with the server's own cameras. The accounting of the
cameras' frame ids (16-bit GigE Vision block ids wrap), and one short run end to end with
recorded frames (a real server with a Modbus server, ``visionserve plc-sim --trigger`` as the
PLC, the records file read back). Behaviour and the report's structure, not speed."""

from __future__ import annotations

import json
import sys

import pytest

from visionserve.records.record import Record
from visionserve.records.store import SqliteStore
from visionserve_tools import benchcam


def _record(t: float, camera: str, frame: int | None) -> Record:
    return Record(t, f"P-{t:g}", None, camera, "m", "1", None, "OK", "ok", 0.9, {},
                  {"total_ms": 1.0}, "rid", camera_frame=frame)


@pytest.mark.parametrize("frames, drops, missing, ok", [
    ([65533, 65534, 65535, 1, 2], 0, 0, True),  # 16-bit ids wrap from 65535 to 1
    ([65534, 1, 2], 1, 1, True),  # 65535 lost on the way, and the source counted it
    ([65534, 1, 2], 0, 1, False),  # ... lost, and nobody counted it
    ([7, 8, 8, 9], 0, 0, False),  # one frame answered twice
    ([100000, 100001, 100003], 1, 1, True),  # 64-bit ids do not wrap
])
def test_frame_ids_are_accounted_for_across_the_16_bit_wrap(tmp_path, frames, drops, missing, ok):
    store = SqliteStore(tmp_path / "records.sqlite")
    store.write([_record(float(i + 1), "cam1", f) for i, f in enumerate(frames)]
                + [_record(99.0, "cam2", None)])  # pushed frames have no id: not counted
    store.close()
    counts = {"cam1": {"source_drops": drops, "faults_timeout": 2}}
    acc = benchcam.frames_accounted(tmp_path / "records.sqlite", ["cam1", "cam2"], counts)
    assert acc["cam1"]["records"] == len(frames) and acc["cam1"]["faults"] == 2
    assert (acc["cam1"]["frame_ids_missing"], acc["cam1"]["ok"]) == (missing, ok)
    assert (acc["cam1"]["first_frame_id"], acc["cam1"]["last_frame_id"]) == (frames[0], frames[-1])
    assert acc["cam2"]["records"] == 0 and acc["cam2"]["ok"]


@pytest.mark.slow
def test_a_short_run_with_recorded_frames_reports_every_trigger_answered(tmp_path, monkeypatch,
                                                                         capsys):
    pytest.importorskip("pymodbus")
    out = tmp_path / "cameras.json"
    monkeypatch.setattr(sys, "argv", ["benchcam"])
    code = benchcam.main(["--replay", "--quick", "--scenario", "640x480", "--count", "12",
                          "--rate", "20", "--work", str(tmp_path / "work"), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["cameras"].startswith("replay")
    (run,) = report["runs"]
    assert run["scenario"] == "640x480 Mono8" and run["cameras"] == 1
    plc = run["plc"]
    assert (plc["triggers"], plc["results"], plc["missing"], plc["refused"]) == (12, 12, 0, 0)
    assert 0 < plc["p50_ms"] <= plc["p99_ms"] <= plc["max_ms"]
    bare = run["bare"]
    assert bare["total_ms"] == pytest.approx(bare["prepare_ms"] + bare["model_ms"], 1e-3)
    acc = run["accounting"]["cam1"]
    # the replay camera's frame ids 1..12, each answered once, in the records file
    assert (acc["records"], acc["first_frame_id"], acc["last_frame_id"]) == (12, 1, 12)
    assert acc["ok"] and acc["frame_ids_missing"] == 0
    assert run["camera_counts"]["cam1"]["frames"] == 12
    assert "trigger -> result at the PLC p50" in printed
