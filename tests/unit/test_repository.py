"""The model repository: layout, versions and the errors a plant engineer will meet."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from visionserve.errors import ConfigError, NotFound
from visionserve.repository import folder_of, load_entry, parse_version, scan, signature

TOML = """\
{extra}
[input]
width = 32
height = 32
[output]
labels = ["ok", "ng"]
"""


def add_model(root: Path, name: str, versions=(1,), extra: str = "", filename: str = "model.onnx") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "model.toml").write_text(TOML.format(extra=extra))
    for v in versions:
        (folder / str(v)).mkdir()
        (folder / str(v) / filename).write_bytes(b"not read by scan")
    return folder


def test_scan_finds_models_and_versions(tmp_path):
    add_model(tmp_path, "alpha", versions=(1, 3))
    add_model(tmp_path, "beta.v2", versions=(2,))
    (tmp_path / "notes").mkdir()  # a folder without model.toml is not a model
    (tmp_path / "README.txt").write_text("hello")
    entries = scan(tmp_path)
    assert sorted(entries) == ["alpha", "beta.v2"]
    a = entries["alpha"]
    assert sorted(a.versions) == [1, 3] and a.default_version == 3
    assert a.versions[1] == tmp_path / "alpha" / "1" / "model.onnx"


def test_non_version_folders_are_ignored(tmp_path):
    folder = add_model(tmp_path, "m", versions=(2,))
    for odd in ("0", "latest", "-1"):
        (folder / odd).mkdir()
        (folder / odd / "model.onnx").write_bytes(b"x")
    (folder / "5").mkdir()  # a version folder without the model file
    assert sorted(load_entry(folder).versions) == [2]


def test_default_version(tmp_path):
    add_model(tmp_path, "m", versions=(1, 2, 3), extra="default_version = 2")
    entry = scan(tmp_path)["m"]
    assert entry.default_version == 2
    assert parse_version(entry, None) == 2
    assert parse_version(entry, "") == 2
    assert parse_version(entry, "3") == 3
    assert parse_version(entry, 1) == 1


@pytest.mark.parametrize("version", ["4", "0", "abc", "1.5", -1])
def test_unknown_version_is_not_found(tmp_path, version):
    add_model(tmp_path, "m", versions=(1, 2))
    entry = scan(tmp_path)["m"]
    with pytest.raises(NotFound, match=r"model m has no version .*\(have \[1, 2\]\)"):
        parse_version(entry, version)


def test_no_versions(tmp_path):
    add_model(tmp_path, "m", versions=())
    with pytest.raises(ConfigError, match=r"no version folder holds model.onnx \(expected .*m/1/model.onnx\)"):
        scan(tmp_path)


def test_version_holds_the_other_backends_file(tmp_path):
    add_model(tmp_path, "m", versions=(1,), filename="model.pt2")  # but runtime.backend is onnxruntime
    with pytest.raises(ConfigError, match="model.onnx"):
        scan(tmp_path)


@pytest.mark.parametrize("name", ["-dash", "has space", ".hidden", "x" * 200])
def test_bad_folder_name(tmp_path, name):
    add_model(tmp_path, name)
    with pytest.raises(ConfigError, match="not a valid model name"):
        scan(tmp_path)


def test_default_version_missing(tmp_path):
    add_model(tmp_path, "m", versions=(1, 2), extra="default_version = 7")
    with pytest.raises(ConfigError, match=r"default_version': version 7 not found \(have \[1, 2\]\)"):
        scan(tmp_path)


def test_name_mismatch(tmp_path):
    add_model(tmp_path, "folder-name", extra='name = "other"')
    with pytest.raises(ConfigError, match="'other' differs from the folder name 'folder-name'"):
        scan(tmp_path)


def test_name_matching_the_folder_is_fine(tmp_path):
    add_model(tmp_path, "same", extra='name = "same"')
    assert list(scan(tmp_path)) == ["same"]


def test_empty_repository(tmp_path):
    with pytest.raises(ConfigError, match="holds no model"):
        scan(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no model"):
        scan(tmp_path)


def test_repository_not_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder"):
        scan(tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        scan(tmp_path / "file")


def test_bad_model_toml_names_the_file_and_field(tmp_path):
    add_model(tmp_path, "m", extra="colour = 3")
    with pytest.raises(ConfigError, match=r"m/model.toml: field 'colour': unknown field"):
        scan(tmp_path)


# --- version policy ------------------------------------------------------------------------------

@pytest.mark.parametrize("policy, served", [
    ("", [1, 2, 5]),
    ("all = true", [1, 2, 5]),
    ("latest = 1", [5]),
    ("latest = 2", [2, 5]),
    ("latest = 9", [1, 2, 5]),
    ("specific = [2, 1]", [1, 2]),
])
def test_version_policy_selects_the_served_versions(tmp_path, policy, served):
    folder = add_model(tmp_path, "m", versions=(1, 2, 5), extra=f"[version_policy]\n{policy}\n")
    entry = load_entry(folder)
    assert sorted(entry.versions) == served
    assert entry.default_version == served[-1]
    with pytest.raises(NotFound, match=r"have \[" + ", ".join(map(str, served))):
        parse_version(entry, 99)


@pytest.mark.parametrize("policy, message", [
    ("latest = 1\nspecific = [1]", "set one of latest, specific, all"),
    ("latest = 0", "version_policy.latest"),
    ("specific = []", "version_policy.specific"),
    ("specific = [1, 1]", "distinct integers"),
    ("newest = 1", "field 'version_policy.newest': unknown field"),
])
def test_bad_version_policy_is_refused_with_the_field(tmp_path, policy, message):
    add_model(tmp_path, "m", extra=f"[version_policy]\n{policy}\n")
    with pytest.raises(ConfigError, match=message):
        scan(tmp_path)


def test_specific_version_without_its_folder(tmp_path):
    folder = add_model(tmp_path, "m", versions=(1, 2), extra="[version_policy]\nspecific = [3]\n")
    with pytest.raises(ConfigError, match=r"'version_policy.specific': version\(s\) \[3\] not found "
                                          r"\(have \[1, 2\]"):
        load_entry(folder)


def test_default_version_must_be_served(tmp_path):
    folder = add_model(tmp_path, "m", versions=(1, 2),
                       extra="default_version = 1\n[version_policy]\nlatest = 1\n")
    with pytest.raises(ConfigError, match="'default_version': version 1 not found"):
        load_entry(folder)


def test_folder_of_takes_names_only(tmp_path):
    add_model(tmp_path, "m")
    assert folder_of(tmp_path, "m") == tmp_path / "m"
    for bad in ("missing", "..", "m/..", "../m", ".hidden"):
        with pytest.raises(NotFound, match="no model"):
            folder_of(tmp_path, bad)


def test_signature_changes_with_the_model_files(tmp_path):
    folder = add_model(tmp_path, "m", versions=(1,))
    before = signature(folder)
    assert signature(folder) == before
    (folder / "2").mkdir()
    (folder / "2" / "model.onnx").write_bytes(b"new version")
    assert signature(folder) != before
    after = signature(folder)
    (folder / "model.toml").write_text((folder / "model.toml").read_text() + "\n# edited\n")
    assert signature(folder) != after
    assert signature(tmp_path / "gone") == ()


@pytest.mark.parametrize("where, mode, who", [
    ("", 0o777, "every user"),                  # the repository: anyone adds a model folder
    ("m", 0o775, "group"),                      # a model folder
    ("m/model.toml", 0o646, "every user"),
    ("m/1", 0o770, "group"),                    # a version folder
    ("m/1/model.onnx", 0o664, "group"),         # the model file
    ("m/1/model.onnx.data", 0o666, "every user"),  # what an ONNX file may read beside it
])
def test_a_repository_others_can_write_is_refused(tmp_path, where, mode, who):
    """A model file is code the server runs and a poll loads whatever lands in the folder: a
    repository, model folder or file that other users can write is refused, naming the path and
    the fix."""
    root = tmp_path / "repo"
    add_model(root, "m")
    (root / "m" / "1" / "model.onnx.data").write_bytes(b"weights")
    path = root / where
    path.chmod(mode)
    with pytest.raises(ConfigError) as err:
        scan(root)
    assert f"{path} is writable by {who}" in err.value.message
    assert f"chmod go-w {path}" in err.value.message


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_model_file_of_another_user_is_refused(tmp_path):
    root = tmp_path / "repo"
    folder = add_model(root, "m")
    os.chown(folder / "1" / "model.onnx", 12345, -1)
    with pytest.raises(ConfigError, match=r"model.onnx is owned by uid 12345, not by the server's "
                                          r"user \(uid 0\) or root.*chown 0 "):
        scan(root)
    os.chown(folder / "1" / "model.onnx", 0, -1)  # root's own files, and the server's, pass
    assert sorted(scan(root)) == ["m"]


def test_a_symlinked_model_file_is_checked_where_it_points(tmp_path):
    """The file a symlink names, and the folder that holds it, must be as closed as the
    repository: others could replace the file there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "model.onnx").write_bytes(b"x")
    root = tmp_path / "repo"
    folder = add_model(root, "m")
    (folder / "1" / "model.onnx").unlink()
    (folder / "1" / "model.onnx").symlink_to(shared / "model.onnx")
    with pytest.raises(ConfigError, match=f"{shared} is writable by every user"):
        scan(root)


def test_a_candidates_area_is_never_served_nor_polled(tmp_path):
    """The closed loop's candidates (docs/closed-loop.md) lie beside the versions: neither the
    scan nor the version policy serves one, and a poll does not see one come or change."""
    folder = add_model(tmp_path, "m", versions=(1,), extra='version_policy = {all = true}')
    before = signature(folder)
    for cid in ("c-1", "c-2"):
        (folder / "candidates" / cid).mkdir(parents=True)
        (folder / "candidates" / cid / "model.onnx").write_bytes(b"a candidate")
    (folder / "candidates" / "2").mkdir()  # even a numeric name inside the area
    (folder / "candidates" / "2" / "model.onnx").write_bytes(b"x")
    entry = load_entry(folder)
    assert sorted(entry.versions) == [1] and entry.default_version == 1
    assert sorted(scan(tmp_path)["m"].versions) == [1]
    assert signature(folder) == before
    (folder / "candidates" / "c-1" / "candidate.json").write_text("{}")
    assert signature(folder) == before
