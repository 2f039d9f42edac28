"""The recipes file: what it says, what it may not say, and the state file beside it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from visionserve import recipes
from visionserve.errors import ConfigError, NotFound

GOOD = """\
[recipe.a]
model = "tiny"
[recipe.b]
model = "tiny"
version = 2
verdict = { ok_threshold = 0.7 }
[station.st1]
recipe = "a"
cameras = ["cam-1", "cam-2"]
[station.st2]
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipes.toml"
    path.write_text(text)
    return path


def test_a_good_file(tmp_path):
    book = recipes.load(_write(tmp_path, GOOD))
    assert book.recipes["b"] == recipes.Recipe("b", "tiny", 2, {"ok_threshold": 0.7})
    assert book.station_of(None, "cam-2") == "st1" and book.station_of("st2", "cam-2") == "st2"
    assert book.station_of(None, "cam-9") is None
    assert book.recipe_of("st1").id == "a" and book.recipe_of("st2") is None
    with pytest.raises(NotFound, match="unknown station 'st9'"):
        book.recipe_of("st9")
    assert book.view()["stations"]["st1"] == {"recipe": "a", "cameras": ["cam-1", "cam-2"]}


@pytest.mark.parametrize("text, words", [
    (GOOD + 'recipe = "c"\n', "runs recipe 'c', which is not defined"),
    (GOOD.replace('[station.st2]', '[station.st2]\ncameras = ["cam-1"]'),
     "camera 'cam-1' is listed by stations 'st1' and 'st2'"),
    (GOOD.replace("[recipe.a]", '[recipe."a b"]'), "recipe name 'a b'"),
    (GOOD.replace("version = 2", "version = 0"), "recipe.b.version"),
    (GOOD + "[station.st3]\ncolour = 1\n", "station.st3.colour"),
    ("[recipe.a\n", "cannot be read"),
])
def test_bad_files_name_what_is_wrong(tmp_path, text, words):
    with pytest.raises(ConfigError, match="recipes file .*" + words.replace("(", r"\(")):
        recipes.load(_write(tmp_path, text))


def test_the_state_file_overrides_the_files_start_and_stale_entries_are_ignored(tmp_path):
    path = _write(tmp_path, GOOD)
    recipes.write_state(recipes.state_path(path), {"st1": "b", "st2": None})
    assert json.loads(recipes.state_path(path).read_text()) == {"stations": {"st1": "b"}}
    assert recipes.load(path).stations == {"st1": "b", "st2": None}
    recipes.state_path(path).write_text(json.dumps({"stations": {"st1": "gone", "st9": "a"}}))
    assert recipes.load(path).stations == {"st1": "a", "st2": None}
    recipes.state_path(path).write_text("{not json")
    assert recipes.load(path).stations["st1"] == "a"


@pytest.mark.parametrize("text, words", [
    ('[recipe.a]\nmodel = "nope"\n', "names model 'nope', which the repository does not hold"),
    ('[recipe.a]\nmodel = "tiny"\nversion = 5\n', "names version 5 of tiny"),
    ('[recipe.a]\nmodel = "tiny"\nverdict = { ok_threshold = 2 }\n',
     "its verdict settings do not fit model tiny"),
])
def test_serve_refuses_recipes_the_repository_cannot_run(tiny_repo, tmp_path, text, words):
    path = _write(tmp_path, text)
    run = subprocess.run([sys.executable, "-m", "visionserve", "serve", "--models", str(tiny_repo),
                          "--recipes", str(path), "--device", "cpu", "--http-port", "0"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2, run.stderr
    assert words in run.stderr and "Traceback" not in run.stderr
