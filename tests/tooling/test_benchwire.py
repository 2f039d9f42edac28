"""``python -m visionserve_tools.benchwire``: what the engine's loop pays to send each task's
answers to a front end, the answers' own pickling against the default (figures in docs/gpu.md)."""

from __future__ import annotations

import json
import pickle

from visionserve_tools import benchwire


def test_the_wire_benchmark_reports_each_task_and_leaves_the_pickling_as_it_was(tmp_path):
    out = tmp_path / "wire.json"
    assert benchwire.main(["--rounds", "1", "--encodes", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["per_answer"]) == set(benchwire.answers())
    assert all(set(v) == {"copy", "zero_copy"} for v in report["per_frame_intake"].values())
    for figures in report["per_answer"].values():
        assert set(figures["engine_pickle_us"]) == {"fields", "default"}
        assert all(v > 0 for v in figures["front_end_unpickle_us"].values())
    for make in benchwire.answers().values():  # the answers' own pickling is back in place
        answer = make()
        assert "__reduce__" in vars(type(answer)) and "__reduce__" in vars(type(answer.result))
        assert repr(pickle.loads(pickle.dumps(answer, 5))) == repr(answer)
