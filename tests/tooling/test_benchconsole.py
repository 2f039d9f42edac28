"""``python -m visionserve_tools.benchconsole``: the console's cost (figures in docs/benchmarks.md).
Its pieces, fast and untimed: the store filler writes the records and captured images it is asked
for in the server's layout, readable by the server's own store; the CPU reader reads a process
tree; the CPUs are split between the server and the browser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from visionserve.records.capture import FolderTarget
from visionserve.records.store import RecordQuery, SqliteStore
from visionserve_tools import benchconsole


def test_the_store_filler_writes_n_records_and_m_captured_images(tmp_path):
    filled = benchconsole.fill_store(tmp_path, 300, 40, batch=64)
    assert (filled["records"], filled["images"]) == (300, 40)
    store = SqliteStore(tmp_path / "records.sqlite")
    ng = store.listing(RecordQuery(verdict="NG", limit=500))
    assert len(ng) == 40 and len(store.listing(RecordQuery(verdict="OK", limit=500))) == 260
    assert {r.model for _, r in store.listing(RecordQuery(limit=500))} == {
        "defect-classifier", "defect-detector"}
    # each NG record names its image, which is there with its sidecar, in the capture layout
    images = FolderTarget(tmp_path / "captures", quota=1 << 30).images()
    assert sorted(r.image for _, r in ng) == sorted(images) and len(images) == 40
    _, first = ng[0]
    assert first.image is not None and first.label in benchconsole.NG_LABELS
    image = tmp_path / "captures" / first.image
    assert image.read_bytes()[:2] == b"\xff\xd8"  # a JPEG
    assert json.loads(image.with_name(image.name + ".json").read_text())["image"] == first.image
    # the listings the benchmark times find what the filler wrote
    queries = benchconsole.filters(filled)
    assert store.listing(RecordQuery(verdict="NG", model="defect-detector", limit=50))
    assert "no match (NG labelled ok)" in queries and queries["verdict=NG"]["verdict"] == "NG"
    with pytest.raises(ValueError, match="need as many NG records"):
        benchconsole.fill_store(tmp_path / "more", 3, 4)


def test_the_cpu_reader_reads_a_process_tree_and_its_window():
    busy = ("import time\nend = time.process_time() + 0.4\n"
            "while time.process_time() < end: pass\ntime.sleep(30)")
    spawn = (f"import subprocess, sys, time\n"
             f"subprocess.Popen([sys.executable, '-c', {busy!r}])\ntime.sleep(30)")
    parent = subprocess.Popen([sys.executable, "-c", spawn])
    try:
        window = benchconsole.CpuWindow(parent.pid)
        end = time.monotonic() + 20
        while len(benchconsole.tree_pids(parent.pid)) < 2 and time.monotonic() < end:
            time.sleep(0.05)
        pids = benchconsole.tree_pids(parent.pid)
        assert pids[0] == parent.pid and len(pids) == 2
        time.sleep(1.0)
        figures = window.close()
        # the child's busy loop counts: the tree, not the process alone
        assert figures["cpu_pct_of_a_core"] > 15, figures
        assert 0 <= figures["loop_cpu_pct_of_a_core"] < figures["cpu_pct_of_a_core"]
        assert figures["wall_s"] >= 1.0
    finally:
        for pid in reversed(benchconsole.tree_pids(parent.pid)):
            os.kill(pid, 9)
        parent.wait()


def test_the_cpus_are_split_between_the_server_and_the_browser():
    cpus = sorted(os.sched_getaffinity(0))
    server, browser = benchconsole.split_cpus("on")
    if len(cpus) > 1:
        assert browser and server and server | browser == set(cpus) and max(server) < min(browser)
        assert len(browser) == max(1, len(cpus) // 4)
    else:
        assert server == browser == set()
    assert benchconsole.split_cpus("off") == (set(), set())


def test_it_says_what_to_measure(capsys):
    with pytest.raises(SystemExit) as exc:
        benchconsole.main([])
    assert exc.value.code == 2 and "--live, --ng-page" in capsys.readouterr().err
