"""The user docs are a report of the current code, not a diary: no session numbers or commit ids
in the docs, the README or the code's comments; docs/benchmarks.md stays short; docs/results holds
only raw files that a page cites, and every cited one exists."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"

SESSION = re.compile(r"\bsessions? \d", re.IGNORECASE)
# how git names a commit: 7-12 hex digits (abbreviated) or 40, with a letter and a digit among them
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)(?:[0-9a-f]{7,12}|[0-9a-f]{40})\b")


def _pages() -> list[Path]:
    pages = [p for p in DOCS.rglob("*.md") if RESULTS not in p.parents]
    return [*pages, ROOT / "README.md"]


def _comments(path: Path) -> str:
    """A Python file's comments and docstrings, the prose in it."""
    out = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    prev = tokenize.INDENT
    for tok in tokens:
        docstring = tok.type == tokenize.STRING and prev in (
            tokenize.INDENT, tokenize.NEWLINE, tokenize.NL, tokenize.DEDENT)
        if tok.type == tokenize.COMMENT or docstring:
            out.append(tok.string)
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            prev = tok.type
    return "\n".join(out)


def _prose() -> list[tuple[str, str]]:
    texts = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8")) for p in _pages()]
    for pkg in ("visionserve", "visionserve_tools"):
        texts += [(str(p.relative_to(ROOT)), _comments(p)) for p in (ROOT / pkg).rglob("*.py")]
    return texts


@pytest.mark.parametrize("pattern", [SESSION, COMMIT], ids=["session", "commit id"])
def test_no_working_history_in_docs_or_comments(pattern: re.Pattern) -> None:
    found = [f"{name}: {m.group(0)!r}" for name, text in _prose() for m in pattern.finditer(text)]
    assert not found, "\n".join(found)


def test_benchmarks_page_is_a_short_report() -> None:
    lines = (DOCS / "benchmarks.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"docs/benchmarks.md has {lines} lines"


def test_raw_results_are_cited_and_citations_exist() -> None:
    text = "\n".join(p.read_text(encoding="utf-8") for p in _pages())
    cited = {c: re.compile(re.escape(c).replace(r"\*", ".*") + "$")
             for c in re.findall(r"results/([\w.*-]+\.\w+)", text)}
    files = sorted(p.name for p in RESULTS.iterdir())
    uncited = [f for f in files if not any(p.match(f) for p in cited.values())]
    assert not uncited, f"raw files no page cites: {uncited}"
    missing = [c for c, p in cited.items() if not any(p.match(f) for f in files)]
    assert not missing, f"cited raw files that do not exist: {missing}"
