"""Promoting a candidate and rolling it back on the console, in a real browser (Debian's headless
Chromium through Selenium) against a real server with the shipped classifier,
``--model-control-mode explicit`` (docs/console.md, docs/closed-loop.md): a quality user signed in
through ``/ui/login`` goes from the Models page to the model's Candidates page, sees the
candidate's comparison with the live version, promotes it with the keyboard through the
confirmation and rolls it back the same way; the server serves version 2, then version 1 again,
and the audit log names the user. A viewer sees no Candidates link, the page answers 403, and a
promotion sent from the viewer's page with its CSRF token is refused 403. Where the model takes
a second approver, the first approval is kept and shown, and another user's promotes. axe-core
finds no WCAG 2.1 A/AA violation.

The candidate is a trained and compared one as its folder holds it (``candidate.json``,
``evaluation.json``, ``comparison.json``), made of the shipped version's files: training one is
what tests/integration/test_loop_promote.py does; this test is about the page."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
from browserkit import (
    MARKS,
    axe_violations,
    page_text,
    press,
    screenshot,
    shipped_repo,
    sign_in,
    tab_to,
)
from conftest import start_server, wait_for

from tests.integration.test_console_users import PASSWORD, add_users

try:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped with the reason (pytestmark)
    pass

pytestmark = MARKS  # browser, slow, and skipped (with the reason) without Chromium

MODEL = "defect-classifier"
TOKEN = "promote-browser-admin-token-0123"
PAGE = f"/ui/models/{MODEL}/candidates"
RATES = {"live": {"accuracy": 0.6, "ng_recall": 0.5, "false_reject_rate": 0.25, "frames": 10,
                  "ng_frames": 6, "ok_frames": 4},
         "candidate": {"accuracy": 0.9, "ng_recall": 1.0, "false_reject_rate": 0.0,
                       "frames": 10, "ng_frames": 6, "ok_frames": 4},
         "disagree": [3, 5]}


def write(path, value) -> None:
    path.write_text(json.dumps(value))


def candidate(repo) -> None:
    """c-1 of the model, trained and compared with version 1."""
    folder = repo / MODEL / "candidates" / "c-1"
    folder.mkdir(parents=True)
    for name in ("model.onnx", "model.pt2", "weights.pt"):
        if (repo / MODEL / "1" / name).is_file():
            shutil.copy(repo / MODEL / "1" / name, folder / name)
    job = {"id": "c-1", "model": MODEL, "from_version": 1, "job": {"id": 1, "command": []},
           "trained_on": [], "held_out": [], "recipe": {}, "created_by": "qe-anna",
           "created": "2026-12-07T00:00:00Z", "created_at": 0}
    write(folder / "job.json", job)
    write(folder / "candidate.json", {**job, "finished": "2026-12-07T00:05:00Z", "metrics": {}})
    write(folder / "evaluation.json", {"job": {"id": 2, "command": []}, "live_version": 1,
                                       "requested_by": "qe-anna"})
    write(folder / "comparison.json", {"summary": RATES, "records": []})
    for path in [folder.parent, *folder.parent.rglob("*")]:
        path.chmod(path.stat().st_mode & 0o755)


def start(tmp, approvers: int = 1):
    add_users(tmp / "xdg")
    repo = shipped_repo(tmp / "repo", (MODEL,), recipes=False)
    if approvers > 1:
        toml = repo / MODEL / "model.toml"
        toml.write_text(toml.read_text() + f"\n[training]\napprovers = {approvers}\n")
    candidate(repo)
    return start_server(repo, tmp, "--host", "0.0.0.0", "--admin-token", TOKEN, "--records",
                        "--records-dir", str(tmp / "data"), "--model-control-mode", "explicit",
                        grpc=False, env={"XDG_DATA_HOME": str(tmp / "xdg")})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start(tmp_path_factory.mktemp("promote-browser"))
    yield s
    s.stop()


def _served(server) -> list[str]:
    return httpx.get(f"{server.url}/v2/models/{MODEL}", timeout=10).json()["versions"]


def _act(browser, label: str) -> str:
    """Tab to the button named ``label``, Enter, and confirm in the dialog: its text."""
    button = browser.find_element(By.XPATH, f"//button[normalize-space()='{label}']")
    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, button)
    press(browser, Keys.ENTER)
    dialog = browser.find_element(By.ID, "confirm")
    WebDriverWait(browser, 10).until(lambda d: dialog.get_attribute("open") is not None)
    text = browser.find_element(By.ID, "confirm-text").text
    tab_to(browser, browser.find_element(By.ID, "confirm-ok"), limit=4)
    press(browser, Keys.ENTER)
    # the page reloads after a success, and says what was done
    WebDriverWait(browser, 120, ignored_exceptions=(WebDriverException,)).until(
        lambda d: d.find_element(By.ID, "status").text.startswith("Done"))
    return text


def test_a_quality_user_promotes_and_rolls_back(browser, server):
    sign_in(browser, server, "qe-anna", PASSWORD)
    browser.find_element(By.LINK_TEXT, "Candidates").click()
    WebDriverWait(browser, 30).until(lambda d: d.current_url.endswith(PAGE))
    row = browser.find_element(By.CSS_SELECTOR, "tr[data-candidate=c-1]")
    cells = [c.text for c in row.find_elements(By.CSS_SELECTOR, "th, td")]
    assert cells[:8] == ["c-1", "done", "1", "1", "0.6 → 0.9", "0.5 → 1.0", "0.25 → 0.0",
                         "2 / 10"], cells
    assert "No promotion in force." in page_text(browser)
    assert browser.find_elements(By.ID, "rollback") == []
    assert axe_violations(browser) == []

    said = _act(browser, "Promote c-1")
    assert "Promote candidate c-1 of model defect-classifier?" in said
    assert browser.find_element(By.ID, "status").text == "Done: candidate c-1 promoted."
    assert _served(server) == ["1", "2"]
    row = browser.find_element(By.CSS_SELECTOR, "tr[data-candidate=c-1]")
    assert row.find_elements(By.TAG_NAME, "td")[0].text == "promoted (v2)"
    assert "Version 2 is candidate c-1, promoted by qe-anna" in page_text(browser)
    screenshot(browser, "candidates-promoted")
    assert axe_violations(browser) == []

    said = _act(browser, "Roll back to version 1")
    assert "Roll model defect-classifier back from version 2 (candidate c-1)" in said
    assert _served(server) == ["1"]
    row = browser.find_element(By.CSS_SELECTOR, "tr[data-candidate=c-1]")
    assert row.find_elements(By.TAG_NAME, "td")[0].text == "rolled-back (v2)"
    assert browser.find_elements(By.ID, "rollback") == []
    entries = httpx.get(f"{server.url}/v1/audit", headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=10).json()["entries"]
    assert [(e["action"], e["user"]) for e in entries[:2]] == [("rollback", "qe-anna"),
                                                               ("promote", "qe-anna")]


_FETCH = """
const [url, token, done] = arguments;
fetch(url, {method: "POST", headers: {"Content-Type": "application/json", "X-CSRF-Token": token},
            body: "{}", credentials: "same-origin"})
  .then(async r => done([r.status, await r.text()]), e => done([0, String(e)]));
"""


def test_a_viewer_has_no_button_and_is_refused(browser, server):
    before = _served(server)
    sign_in(browser, server, "otto", PASSWORD)  # a viewer
    assert browser.find_elements(By.LINK_TEXT, "Candidates") == []
    r = browser.execute_async_script(
        "fetch(arguments[0]).then(r => arguments[1](r.status))", server.url + PAGE)
    assert r == 403
    browser.get(server.url + PAGE)
    assert browser.find_elements(By.CSS_SELECTOR, "button[data-action]") == []
    token = json.loads(browser.execute_async_script(
        "fetch('/ui/session').then(r => r.text()).then(arguments[0])"))["csrf_token"]
    for url in (f"/v1/models/{MODEL}/candidates/c-1/promote", f"/v1/models/{MODEL}/rollback"):
        status, text = browser.execute_async_script(_FETCH, url, token)
        assert status == 403, (url, text)
    wait_for(lambda: _served(server) == before, 5, "nothing changed")


def test_a_second_approver_promotes_what_the_first_approved(browser, tmp_path):
    two = start(tmp_path, approvers=2)
    try:
        sign_in(browser, two, "qe-anna", PASSWORD, PAGE)
        assert "two approvers" in page_text(browser)
        _act(browser, "Promote c-1")
        assert browser.find_element(By.ID, "status").text == (
            "Done: your approval of candidate c-1 is kept: another user's promotes it.")
        assert _served(two) == ["1"]
        row = browser.find_element(By.CSS_SELECTOR, "tr[data-candidate=c-1]")
        assert "approved by qe-anna; waiting for another approver" in row.text
        assert axe_violations(browser) == []

        sign_in(browser, two, "max", PASSWORD, PAGE)  # an admin
        _act(browser, "Promote c-1")
        assert browser.find_element(By.ID, "status").text == "Done: candidate c-1 promoted."
        assert _served(two) == ["1", "2"]
        entries = httpx.get(f"{two.url}/v1/audit", headers={"Authorization": f"Bearer {TOKEN}"},
                            timeout=10).json()["entries"]
        assert [(e["action"], e["user"]) for e in entries
                if e["action"].startswith("promote")] == [("promote", "max"),
                                                          ("promote-approval", "qe-anna")]
    finally:
        two.stop()
