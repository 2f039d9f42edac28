"""model.toml's [verdict] rewritten in place: only the changed keys' lines, comments kept."""

from __future__ import annotations

import sys

import pytest

from visionserve.errors import ConfigError, InvalidInput
from visionserve.verdicts import change, edit_section, toml_value, write_atomic

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TEXT = """\
task = "anomaly"  # what it is
[input]
width = 64
height = 64

[verdict]   # the line's rule
image_threshold = 0.5   # calibrated 2026-12-01
roi = [
  [[0, 0], [10, 0], [10, 10]],  # the left pad
]
# min_region_area is off for now

[batching]
max_batch_size = 4
preferred_batch_sizes = [1, 4]
"""


def test_changed_key_keeps_its_place_and_comment():
    out = edit_section(TEXT, "verdict", {"image_threshold": 0.75})
    assert out == TEXT.replace("image_threshold = 0.5   #", "image_threshold = 0.75  #")


def test_multi_line_value_replaced_and_new_key_after_the_last():
    out = edit_section(TEXT, "verdict", {"roi": [[[1, 2], [3, 4], [5, 6.5]]],
                                         "min_region_area": 40.0})
    data = tomllib.loads(out)
    assert data["verdict"] == {"image_threshold": 0.5, "roi": [[[1, 2], [3, 4], [5, 6.5]]],
                               "min_region_area": 40.0}
    assert "# min_region_area is off for now\n" in out and data["batching"]["max_batch_size"] == 4
    assert out.index("min_region_area = 40.0") < out.index("# min_region_area is off")


def test_none_removes_and_missing_section_is_added():
    out = edit_section(TEXT, "verdict", {"roi": None})
    assert "roi" not in tomllib.loads(out)["verdict"] and "[[0, 0]" not in out
    plain = "task = \"anomaly\"\n[input]\nwidth = 64\nheight = 64\n"
    out = edit_section(plain, "verdict", {"pixel_threshold": 0.6, "area_unit": "mm2"})
    assert tomllib.loads(out)["verdict"] == {"pixel_threshold": 0.6, "area_unit": "mm2"}
    assert out.startswith(plain)


@pytest.mark.parametrize("value, text", [(True, "true"), (3, "3"), (0.1, "0.1"),
                                          ("a\"b", '"a\\"b"'), ([1, [2.5]], "[1, [2.5]]"),
                                          (float("inf"), "inf")])
def test_toml_values(value, text):
    assert toml_value(value) == text


def test_change_validates_whole_and_writes_nothing(tmp_path):
    path = tmp_path / "model.toml"
    path.write_text(TEXT)
    config, text = change(path, {"image_threshold": 0.8})
    assert config.verdict.image_threshold == 0.8 and path.read_text() == TEXT
    write_atomic(path, text)
    assert tomllib.loads(path.read_text())["verdict"]["image_threshold"] == 0.8
    with pytest.raises(InvalidInput, match="field 'verdict.image_threshold'"):
        change(path, {"image_threshold": -1})
    with pytest.raises(InvalidInput, match="field 'verdict.colour': unknown field"):
        change(path, {"colour": "red"})
    assert [p.name for p in tmp_path.iterdir()] == ["model.toml"]


def test_a_repository_that_cannot_be_written(tmp_path, monkeypatch):
    path = tmp_path / "model.toml"
    path.write_text(TEXT)

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("visionserve.verdicts.os.replace", refuse)
    _, text = change(path, {"image_threshold": 0.8})
    with pytest.raises(ConfigError, match="cannot be rewritten .*Permission denied.*not applied"):
        write_atomic(path, text)
    assert path.read_text() == TEXT and [p.name for p in tmp_path.iterdir()] == ["model.toml"]
