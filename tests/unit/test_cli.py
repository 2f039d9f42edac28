"""The ``visionserve`` command line: every help text renders, and the settings reference
(docs/settings.md, serve --help) is the code's."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest

from visionserve import cli
from visionserve.config import (
    SETTING_GROUPS,
    ServerSettings,
    grouped_setting_docs,
    setting_docs,
    unknown_variables,
)

REPO = Path(__file__).resolve().parents[2]


def _parsers(parser: argparse.ArgumentParser, argv: tuple[str, ...] = ()):
    """(argv, parser) for the parser and every subcommand below it, at any depth."""
    yield argv, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*argv, name))


def _help(argv: tuple[str, ...]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--help"])
    assert exit_.value.code == 0
    return out.getvalue()


ALL = [argv for argv, _ in _parsers(cli.build_parser())]


def test_every_command_is_walked():
    assert {("serve",), ("doctor",), ("env",), ("guard",)} <= set(ALL)
    assert any(len(argv) == 2 and argv[0] == "guard" for argv in ALL), "the guard's subcommands"


@pytest.mark.parametrize("argv", ALL, ids=lambda argv: " ".join(argv) or "visionserve")
def test_help_renders_for_every_command(argv):
    text = _help(argv)
    assert text.startswith("usage: visionserve")
    for markup in (":class:", ":func:", ":mod:", ":meth:"):  # developer text, not for users
        assert markup not in text


def test_serve_help_lists_every_setting_with_its_default():
    text = " ".join(_help(("serve",)).split())  # argparse wraps lines
    for doc in setting_docs():
        for flag in doc.flags:
            assert flag in text
        assert f"[default: {doc.default}]" in text
    assert "VISIONSERVE_<OPTION>" in text  # how an option's variable is named
    assert "80% of it" in text  # a literal percent sign (argparse formats help with %)


def _serve_help_at(columns: int, monkeypatch) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))  # argparse wraps to $COLUMNS
    return _help(("serve",))


def test_serve_help_is_grouped_with_every_group_heading(monkeypatch):
    text = _serve_help_at(100, monkeypatch)
    headings = [line[:-1] for line in text.splitlines() if line.endswith(":") and
                not line.startswith(" ")]
    assert headings == ["options", *SETTING_GROUPS]
    for title, docs in grouped_setting_docs():
        assert docs, f"group {title!r} holds no setting"
        section = text.split(f"\n{title}:\n", 1)[1].split("\n\n", 2)[1]  # after its description
        for doc in docs:
            assert f"  {doc.flags[0]}" in section, f"{doc.flags[0]} is not under {title}"


def test_every_setting_names_a_known_group():
    assert {d.group for d in setting_docs()} <= set(SETTING_GROUPS)


def test_every_option_help_is_at_most_three_lines_at_100_columns(monkeypatch):
    lines = _serve_help_at(100, monkeypatch).split("\n\noptions:\n", 1)[1].splitlines()
    helps: dict[str, int] = {}
    option = None
    for line in lines:
        stripped = line.strip()
        if line.startswith("  -"):  # an option's line: its help may start on it
            option = stripped.split()[0].rstrip(",")
            helps[option] = 1 if "  " in stripped else 0
        elif option is not None and line.startswith(" " * 24) and stripped:
            helps[option] += 1
        else:
            option = None  # a heading, a group's description or a blank line
    assert set(helps) >= {d.flags[0] for d in setting_docs()}
    assert helps["--frontends"] == 3 and helps["--host"] == 2  # the count itself
    long = {flag: n for flag, n in helps.items() if n > 3}
    assert not long, f"help over three lines at 100 columns: {long}"


def test_no_history_in_the_help():
    import re

    for doc in setting_docs():
        assert not re.search(r"sessions? \d|H100|H200|\d+(\.\d+)?x\b", doc.help), doc.name


def test_a_removed_setting_is_refused_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--gpu-prep-processes", "2"])
    assert exit_.value.code == 2
    assert "--gpu-prep-processes" in capsys.readouterr().err


def test_serve_help_in_a_fresh_process():
    run = subprocess.run([sys.executable, "-m", "visionserve", "serve", "--help"], capture_output=True,
                         text=True, cwd=REPO, timeout=120, check=False)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "--guard-latency-budget-ms" in run.stdout


def test_doctor_help_is_for_users():
    text = _help(("doctor",))
    assert "Facts" not in text and "in a test" not in text
    assert "Exit code" in text


# --- misspelt settings ---------------------------------------------------------------------------


def test_unknown_variable_names_the_nearest_setting():
    (warning,) = unknown_variables({"VISIONSERVE_HTTP_PROT": "9000", "VISIONSERVE_HTTP_PORT": "9000",
                                    "visionserve_device": "cpu", "PATH": "/bin"})
    assert "VISIONSERVE_HTTP_PROT" in warning and "VISIONSERVE_HTTP_PORT (--http-port)" in warning
    (far,) = unknown_variables({"VISIONSERVE_ZZZZZZ": "1"})
    assert "did you mean" not in far and "docs/settings.md" in far


@pytest.mark.parametrize("name", ["GPU_PREP_PROCESSES", "GPU_CUDNN_AUTOTUNE", "GPU_GRAPH_FETCH",
                                  "FRONTEND_ZERO_COPY", "LOAD_SWITCH_INTERVAL_MS"])
def test_a_removed_setting_s_variable_says_it_was_removed(name):
    (warning,) = unknown_variables({f"VISIONSERVE_{name}": "1"})
    assert f"VISIONSERVE_{name}" in warning and "removed" in warning and "ignored" in warning
    assert "did you mean" not in warning
    assert name.lower() not in ServerSettings.model_fields


def test_compose_variables_are_not_unknown():
    import re

    compose = (REPO / "deploy" / "docker-compose.yml").read_text()
    names = set(re.findall(r"\$\{(VISIONSERVE_\w+)", compose))
    assert {"VISIONSERVE_GPU", "VISIONSERVE_IMAGE", "VISIONSERVE_MODELS_DIR"} <= names
    assert unknown_variables(dict.fromkeys(names, "x")) == []


def test_serve_warns_about_a_misspelt_variable_at_start_up(tmp_path):
    import os

    run = subprocess.run([sys.executable, "-m", "visionserve", "serve", "--device", "cpu",
                          "--models", str(tmp_path / "none")], capture_output=True, text=True, cwd=REPO,
                         timeout=120, env={**os.environ, "VISIONSERVE_HTTP_PROT": "9000"}, check=False)
    assert run.returncode == 2  # no repository there: it stops, after the warning
    (line,) = [ln for ln in run.stderr.splitlines() if "VISIONSERVE_HTTP_PROT" in ln]
    assert "WARNING" in line and "VISIONSERVE_HTTP_PORT" in line
