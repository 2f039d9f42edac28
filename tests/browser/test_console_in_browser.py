"""The console in a real browser: Debian's headless Chromium, driven through its chromedriver by
Selenium, against real servers on the shipped models (docs/console.md).

Each page loads and shows the server's data; load and unload go through the confirmation dialog
(and the server's own refusal shows under ``--model-control-mode none``); a station's recipe is
switched; every action is reached with Tab and started with Enter; axe-core (vendored under
``vendor/axe-core``, run in the page) finds no WCAG 2.1 A/AA violation. Screenshots of each page
go to ``build/console-screenshots/``."""

from __future__ import annotations

import httpx
import pytest
from browserkit import (
    MARKS,
    ZONE,
    axe_violations,
    open_page,
    page_text,
    press,
    screenshot,
    shipped_repo,
    tab_to,
)
from conftest import start_server

try:
    from selenium.common.exceptions import WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped with the reason (MARKS)
    pass

pytestmark = MARKS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The shipped models and a recipes file, loads and unloads allowed."""
    tmp = tmp_path_factory.mktemp("console")
    s = start_server(shipped_repo(tmp / "repo"), tmp, "--model-control-mode", "explicit",
                     "--time-zone", ZONE, grpc=False)
    yield s
    s.stop()


def _confirm_with_keyboard(browser, accept: bool = True) -> str:
    """The open confirmation dialog: its text; Tab to its answer and Enter."""
    dialog = browser.find_element(By.ID, "confirm")
    WebDriverWait(browser, 10).until(lambda d: dialog.get_attribute("open") is not None)
    text = browser.find_element(By.ID, "confirm-text").text
    button = browser.find_element(By.ID, "confirm-ok" if accept else "confirm-cancel")
    tab_to(browser, button, limit=4)  # the dialog keeps the focus inside it
    press(browser, Keys.ENTER)
    # the page reloads after a success: an element looked up as it goes is stale, or its node
    # no longer in the document (Chromium's inspector error), until the new page is there
    WebDriverWait(browser, 10, ignored_exceptions=(WebDriverException,)).until(
        lambda d: d.find_element(By.ID, "confirm").get_attribute("open") is None)
    return text


def _model_state(server, model: str) -> str:
    rows = httpx.post(server.url + "/v2/repository/index", json={}, timeout=30).json()
    return next(r["state"] for r in rows if r["name"] == model)


def _act_with_keyboard(browser, label: str) -> str:
    """Tab to the button named ``label``, Enter, and confirm in the dialog; its text."""
    button = browser.find_element(By.XPATH, f"//button[normalize-space()='{label}']")
    browser.find_element(By.TAG_NAME, "body").click()  # the focus starts at the page
    tab_to(browser, button)
    press(browser, Keys.ENTER)
    return _confirm_with_keyboard(browser)


def _said(browser) -> str:
    """What the page says after an action: its status region (success) or, prefixed
    ``alert:``, its alert region. The page reloads after a success, so both are looked up anew
    each time."""
    def said(d) -> str | None:
        try:
            status = d.find_element(By.ID, "status").text.strip()
            alert = d.find_element(By.ID, "alert").text.strip()
        except WebDriverException:  # the page is reloading
            return None
        if alert:
            return f"alert: {alert}"
        return status if status and status != "Working…" else None

    return WebDriverWait(browser, 60).until(said)


@pytest.mark.parametrize("path, shows", [
    ("/ui/models", ["defect-classifier", "defect-detector", "surface-anomaly", "READY",
                    "ok_threshold", "image_threshold", "Model control mode: explicit."]),
    ("/ui/stations", ["line1-st3", "housing-black", "line1-st4", "no recipe yet", "cam-7",
                      "Housing, white ABS"]),
    ("/ui/system", ["CPU (no GPU)", "Model versions loaded\n3",
                    "none: HTTP and gRPC run in the serving process",
                    "The guard is off on this server", "No PLC server runs on this server"]),
])
def test_each_page_shows_the_servers_data_and_passes_axe(browser, server, path, shows):
    open_page(browser, server, path)
    text = page_text(browser)
    for words in shows:
        assert words in text, (words, text)
    assert f"Times in {ZONE}." in text
    nav = browser.find_element(By.CSS_SELECTOR, "nav a[aria-current='page']")
    assert nav.get_attribute("href").endswith(path)
    screenshot(browser, path.rsplit("/", 1)[-1])
    assert axe_violations(browser) == []
    # no request left the server: every style sheet and script is its own
    for url in browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"):
        assert url.startswith(server.url), url


def test_the_console_home_leads_to_the_first_page(browser, server):
    open_page(browser, server, "/ui")
    assert browser.current_url == server.url + "/ui/live"


def test_unload_and_load_with_the_confirmation_and_the_keyboard(browser, server):
    open_page(browser, server, "/ui/models")
    # cancelled: nothing happens
    button = browser.find_element(By.XPATH,
                                  "//button[normalize-space()='Unload defect-classifier']")
    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, button)
    press(browser, Keys.ENTER)
    text = _confirm_with_keyboard(browser, accept=False)
    assert "Unload every version of model defect-classifier?" in text
    assert _model_state(server, "defect-classifier") == "READY"
    assert browser.switch_to.active_element == button  # back where the operator was
    # confirmed: unloaded, the page says so and shows it
    _act_with_keyboard(browser, "Unload defect-classifier")
    assert _said(browser) == "Done: model defect-classifier unloaded."
    assert _model_state(server, "defect-classifier") == "UNAVAILABLE"
    assert "UNAVAILABLE" in browser.find_element(By.XPATH, "//section[h2='defect-classifier']").text
    screenshot(browser, "models-unloaded")
    assert axe_violations(browser) == []
    _act_with_keyboard(browser, "Load defect-classifier")
    assert _said(browser) == "Done: model defect-classifier loaded."
    assert _model_state(server, "defect-classifier") == "READY"


def test_switch_a_stations_recipe_with_the_keyboard(browser, server):
    open_page(browser, server, "/ui/stations")
    select = browser.find_element(By.ID, "recipe-1")
    assert select.get_attribute("value") == "housing-black"
    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, select)
    press(browser, Keys.ARROW_DOWN)  # the next recipe: housing-white
    assert select.get_attribute("value") == "housing-white"
    text = _act_with_keyboard(browser, "Switch line1-st3")
    assert "Make station line1-st3 run recipe housing-white?" in text
    assert _said(browser) == "Done: station line1-st3 runs recipe housing-white."
    station = httpx.get(server.url + "/v1/stations/line1-st3", timeout=10).json()
    assert station["recipe"] == "housing-white"
    row = browser.find_element(By.XPATH, "//tr[th='line1-st3']")
    assert row.find_element(By.CLASS_NAME, "recipe").text == "housing-white"
    # a station without a recipe gets one; one that would share the model with other verdict
    # settings is refused, with the server's reason
    _act_with_keyboard(browser, "Switch line1-st4")
    said = _said(browser)
    assert said.startswith("alert: The server refused: station 'line1-st3' runs recipe "
                           "'housing-white'") and said.endswith("(HTTP 409)"), said
    select = browser.find_element(By.ID, "recipe-2")
    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, select)
    press(browser, Keys.ARROW_DOWN)
    assert select.get_attribute("value") == "housing-white"
    _act_with_keyboard(browser, "Switch line1-st4")
    assert _said(browser) == "Done: station line1-st4 runs recipe housing-white."
    screenshot(browser, "stations-switched")


def test_model_control_none_shows_the_servers_refusal(browser, tmp_path):
    s = start_server(shipped_repo(tmp_path / "repo", ("defect-classifier",), recipes=False),
                     tmp_path,
                     "--model-control-mode", "none", grpc=False)
    try:
        said = httpx.post(s.url + "/v2/repository/models/defect-classifier/unload", json={},
                          timeout=30)
        assert 400 <= said.status_code < 500
        open_page(browser, s, "/ui/models")
        assert "Loading and unloading are turned off on this server" in page_text(browser)
        _act_with_keyboard(browser, "Unload defect-classifier")
        alert = _said(browser)
        assert alert == (f"alert: The server refused: {said.json()['error']} "
                         f"(HTTP {said.status_code})"), alert
        assert browser.find_element(By.ID, "status").text == ""
        assert _model_state(s, "defect-classifier") == "READY"
        screenshot(browser, "models-control-none")
        assert axe_violations(browser) == []
    finally:
        s.stop()



def test_system_page_lists_the_guards_jobs(browser, tmp_path):
    s = start_server(shipped_repo(tmp_path / "repo", ("defect-classifier",), recipes=False),
                     tmp_path,
                     "--guard", "--guard-db", str(tmp_path / "guard.sqlite"),
                     "--time-zone", "America/Chicago", grpc=False)
    try:
        job = httpx.post(s.url + "/v1/guard/jobs", timeout=30, json={
            "name": "retrain-housing", "command": ["sleep", "60"], "gpu_mem": "1GiB"})
        assert job.status_code == 201, job.text
        job_id = job.json()["id"]
        open_page(browser, s, "/ui/system")
        row = browser.find_element(By.XPATH, "//tr[td='retrain-housing']")
        cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        assert cells[0] == str(job_id) and cells[2] in ("queued", "running"), cells
        assert cells[3] == "1.0 GiB"
        assert "Times in America/Chicago." in page_text(browser)
        from datetime import datetime
        from zoneinfo import ZoneInfo

        submitted = datetime.fromtimestamp(job.json()["submitted_at"], ZoneInfo("America/Chicago"))
        assert cells[5] == submitted.strftime("%Y-%m-%d %H:%M:%S")
        screenshot(browser, "system-guard")
        assert axe_violations(browser) == []
        httpx.post(f"{s.url}/v1/guard/jobs/{job_id}/cancel", timeout=30)
    finally:
        s.stop()
