"""The console's parts that need no server: its texts in one place, the System page's figures
from the Prometheus series, the time zone it names, and the files the wheel must carry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from visionserve import verdicts
from visionserve.config import ServerSettings, load_model_config, time_zone
from visionserve.console import pages, system, verdictform
from visionserve.console.strings import LIVE_SCRIPT_KEYS, SCRIPT_KEYS, STRINGS, VERDICT_SCRIPT_KEYS

CONSOLE = Path(pages.__file__).parent
REPO = CONSOLE.parents[1]


def test_every_text_the_templates_use_is_in_the_strings():
    used = set()
    for template in (CONSOLE / "templates").glob("*.html"):
        text = template.read_text(encoding="utf-8")
        used |= set(re.findall(r"\bs\.(\w+)", text)) | set(re.findall(r'"(nav_\w+)"', text))
        # no English outside the strings: what stands between tags is a {{ }} expression
        for between in re.findall(r">([^<>{}]+)<", text):
            assert not between.strip(), (template.name, between)
    used |= {key for _, key in pages.PAGES}
    assert used - set(STRINGS) == set()
    assert set(SCRIPT_KEYS) <= set(STRINGS)


def test_the_script_takes_its_texts_from_the_page():
    script = (CONSOLE / "static" / "console.js").read_text(encoding="utf-8")
    for key in SCRIPT_KEYS:
        assert f"strings.{key}" in script or key.startswith("confirm_"), key
    # nothing but the server: no other origin named anywhere in the console's files
    for path in [*(CONSOLE / "static").iterdir(), *(CONSOLE / "templates").iterdir()]:
        assert "http://" not in path.read_text() and "https://" not in path.read_text(), path


EXPOSITION = """\
# HELP visionserve_gpu_memory_budget_bytes GPU memory budget the server reserves
# TYPE visionserve_gpu_memory_budget_bytes gauge
visionserve_gpu_memory_budget_bytes 4.294967296e+09
# TYPE visionserve_gpu_memory_reserved_bytes gauge
visionserve_gpu_memory_reserved_bytes 2.147483648e+09
# TYPE visionserve_gpu_device_memory_total_bytes gauge
visionserve_gpu_device_memory_total_bytes 8.589934592e+10
# TYPE visionserve_frontends_alive gauge
visionserve_frontends_alive 3.0
# TYPE visionserve_batch_workers_alive gauge
visionserve_batch_workers_alive 2.0
# TYPE visionserve_plc_clients gauge
visionserve_plc_clients{protocol="modbus"} 1.0
# TYPE visionserve_plc_results counter
visionserve_plc_results_total{result="OK",station="st1"} 41.0
visionserve_plc_results_total{result="NG",station="st1"} 2.0
# TYPE visionserve_plc_last_ack_timestamp_seconds gauge
visionserve_plc_last_ack_timestamp_seconds{station="st1"} 1.7650512e+09
# TYPE visionserve_plc_engine_stalled gauge
visionserve_plc_engine_stalled 0.0
"""


def test_system_figures_from_the_series():
    f = system.read(EXPOSITION)
    assert f.gpu == {"budget": 4 * 1024**3, "reserved": 2 * 1024**3, "card_total": 80 * 1024**3}
    assert (f.frontends_alive, f.batch_workers, f.plc_stalled) == (3, 2, False)
    assert f.plc_clients == {"modbus": 1}
    assert f.plc_results == {("st1", "OK"): 41, ("st1", "NG"): 2}
    assert f.plc_last_ack == {"st1": 1.7650512e+09}


def test_a_machine_without_a_gpu_shows_none():
    """The GPU series exist on every machine (0 where nothing sets them): no card, no GPU."""
    text = ("# TYPE visionserve_gpu_memory_budget_bytes gauge\n"
            "visionserve_gpu_memory_budget_bytes 0\n")
    assert system.read(text).gpu == {}


@pytest.mark.parametrize("n, shown", [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                      (3 * 1024**3, "3.0 GiB"), (2048 * 1024**3, "2048.0 GiB")])
def test_sizes(n, shown):
    assert system.size(n) == shown


def test_time_zone(monkeypatch):
    assert time_zone("Europe/Berlin")[0] == "Europe/Berlin"
    monkeypatch.setenv("TZ", "America/Chicago")
    assert time_zone("")[0] == "America/Chicago"
    monkeypatch.delenv("TZ")
    name, zone = time_zone("")
    assert name and zone is not None  # the machine's, from /etc/localtime or UTC
    with pytest.raises(ValueError, match="unknown time zone 'Mars/Olympus'"):
        ServerSettings(time_zone="Mars/Olympus")


def test_the_wheel_carries_the_console():
    """pyproject.toml's package data names every template and static file."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    data = tomllib.loads((CONSOLE.parents[1] / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["visionserve.console"]
    files = [p.relative_to(CONSOLE) for p in CONSOLE.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert files and all(any(f.match(g) for g in globs) for f in files), (files, globs)


def test_the_verdict_script_takes_its_texts_from_the_page():
    """verdict.js, with the send it shares from console.js (which shows working, refused and
    network errors in the texts it is handed)."""
    script = "".join((CONSOLE / "static" / name).read_text(encoding="utf-8")
                     for name in ("verdict.js", "console.js"))
    assert set(VERDICT_SCRIPT_KEYS) <= set(STRINGS)
    for key in VERDICT_SCRIPT_KEYS:
        assert f"strings.{key}" in script or f'"{key}"' in script, key


def _fields(model: str) -> dict[str, verdictform.Field]:
    config = load_model_config(REPO / "models" / model / "model.toml")
    values = verdicts.current(config)
    return {f.name: f for f in verdictform.fields(config, values)}


def test_the_verdict_form_fits_each_task():
    """Each field of the rule in force gets the input its schema says: numbers with their
    limits, choices, the model's labels as checkboxes, the rest as JSON text."""
    classifier = _fields("defect-classifier")
    assert list(classifier) == ["ok_labels", "ok_threshold"]
    labels, threshold = classifier["ok_labels"], classifier["ok_threshold"]
    assert (labels.kind, labels.value) == (verdictform.LABELS, ["ok"])
    assert "ok" in labels.options and len(labels.options) > 1
    assert (threshold.kind, threshold.value, threshold.minimum, threshold.maximum,
            threshold.optional) == (verdictform.NUMBER, 0.5, 0.0, 1.0, False)
    anomaly = _fields("surface-anomaly")
    assert anomaly["image_threshold"].kind == verdictform.NUMBER
    area = anomaly["min_region_area"]
    assert (area.kind, area.optional, area.value, area.minimum) == (verdictform.NUMBER, True,
                                                                    None, 0.0)
    unit = anomaly["area_unit"]
    assert (unit.kind, unit.options, unit.value) == (verdictform.CHOICE, ("px", "mm2"), "px")
    assert anomaly["pixels_per_mm"].minimum == 0.0  # exclusive: the server says so
    assert (anomaly["roi"].kind, anomaly["roi"].value) == (verdictform.JSON, "[]")
    detector = _fields("defect-detector")
    assert detector["min_overlap"].kind == verdictform.NUMBER
    assert detector["roi_match"].kind == verdictform.CHOICE
    assert {detector[k].kind for k in ("defects", "count", "roi", "exclude")} == {verdictform.JSON}
    assert all(f.help for f in detector.values())


def test_the_live_pages_script_takes_its_texts_from_the_page():
    script = (CONSOLE / "static" / "live.js").read_text(encoding="utf-8")
    assert set(LIVE_SCRIPT_KEYS) <= set(STRINGS)
    for key in LIVE_SCRIPT_KEYS:
        assert f"strings.{key}" in script, key
    assert pages.PAGES[0][0] == "/ui/live"  # the console's home


def test_every_audit_action_has_its_name_on_the_page():
    from visionserve.audit import ACTIONS

    assert {f"audit_action_{a}" for a in ACTIONS} <= set(STRINGS)


def test_the_audit_page_shows_what_changed():
    from visionserve.console import auditview
    from visionserve.http.audit import AuditQuery

    old = {"ok_threshold": 0.5, "ok_labels": ["ok"]}
    assert auditview.changes(old, {**old, "ok_threshold": 0.7}) == ["ok_threshold: 0.5 → 0.7"]
    assert auditview.changes(None, "housing-black") == ["— → housing-black"]
    assert auditview.changes({"versions": ["1"]}, {"versions": []}) == ['versions: ["1"] → []']
    assert auditview.changes(None, {"role": "viewer"}) == ["— → role: viewer"]
    assert auditview.changes(None, None) == []
    query = AuditQuery(user="qe anna", action="verdict")
    assert auditview.page_link(query, before=7) == "/ui/audit?user=qe+anna&action=verdict&before=7"
    assert auditview.page_link(AuditQuery()) == "/ui/audit"
    assert auditview.local_input("2026-12-06T14:30") == "2026-12-06T14:30"
    assert auditview.local_input("1796582392") == ""
