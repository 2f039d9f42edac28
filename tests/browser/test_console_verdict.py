"""Changing a model's verdict rules on the console's Models page, in a real browser (Debian's
headless Chromium through Selenium) against a real server (docs/console.md).

After inspect calls that make some frames NG, a threshold typed into the form is previewed: the
page names exactly the kept frames whose verdict the change flips (the server's preview, times in
the server's zone); Save, reached with the keyboard, PUTs it and the next frame sent gets the new
verdict. The server's refusal of a bad value is shown as it said it. A viewer signed in through
``/ui/login`` sees the rules but no form; a quality user gets it. axe-core finds no WCAG 2.1 A/AA
violation."""

from __future__ import annotations

import json
from datetime import datetime
from zoneinfo import ZoneInfo

import httpx
import pytest
from browserkit import (
    MARKS,
    axe_violations,
    open_page,
    page_text,
    press,
    screenshot,
    sign_in,
    tab_to,
)
from conftest import TINY_TOML, make_tiny_model, start_server

from tests.integration.test_console_users import PASSWORD, add_users

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped with the reason (pytestmark)
    pass

pytestmark = MARKS  # browser, slow, and skipped (with the reason) without Chromium

ZONE = "America/Chicago"
#: every frame OK to begin with: each label is a good one, any score will do
TOML = TINY_TOML + '[verdict]\nok_labels = ["ok", "dent", "scratch"]\nok_threshold = 0.0\n'
MODEL = "tiny"


def _images(n: int) -> list[bytes]:
    import cv2
    import numpy as np

    rng = np.random.default_rng(11)
    return [cv2.imencode(".png", rng.integers(0, 256, (32, 32, 3), np.uint8))[1].tobytes()
            for _ in range(n)]


def _inspect(server, png: bytes, part: str) -> dict:
    r = httpx.post(f"{server.url}/v1/models/{MODEL}/inspect", content=png, timeout=30,
                   headers={"Content-Type": "image/png", "X-Part-Id": part})
    assert r.status_code == 200, r.text
    return r.json()


def _form(driver):
    return driver.find_element(By.CSS_SELECTOR, f"form.verdict-form[data-model='{MODEL}']")


def _type_into(driver, element, text: str) -> None:
    """Tab to ``element``, select what it holds and type ``text`` (the keyboard only)."""
    driver.find_element(By.TAG_NAME, "body").click()
    tab_to(driver, element)
    press(driver, Keys.CONTROL, "a")
    press(driver, Keys.NULL, text)


def _said(form, which: str) -> str:
    """The form's status or alert region once it says something other than "Working…"."""
    region = form.find_element(By.CSS_SELECTOR, f"[data-verdict={which}]")
    return WebDriverWait(form.parent, 30).until(
        lambda d: (t := region.text.strip()) and t != "Working…" and t)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console-verdict")
    make_tiny_model(tmp / "repo" / MODEL, TOML)
    s = start_server(tmp / "repo", tmp, "--time-zone", ZONE, grpc=False)
    yield s
    s.stop()


def test_a_threshold_change_is_previewed_then_saved_with_the_keyboard(browser, server):
    images = _images(12)
    scores = {f"A-{i}": _inspect(server, png, f"A-{i}")["score"] for i, png in enumerate(images)}
    ranked = sorted(scores.values())
    # thresholds between two scores (rounded as a person types them): no frame sits on one
    low, high = (round((ranked[i] + ranked[i + 1]) / 2, 6) for i in (2, 8))
    # some frames NG: those scoring below the lower quartile
    r = httpx.put(f"{server.url}/v1/models/{MODEL}/verdict", json={"ok_threshold": low},
                  timeout=30)
    assert r.status_code == 200, r.text
    second = {f"B-{i}": _inspect(server, png, f"B-{i}")["verdict"] for i, png in enumerate(images)}
    assert "NG" in second.values() and "OK" in second.values()
    # the change: a higher threshold, so that more frames become NG
    threshold = high
    kept = {**{p: ("OK", s) for p, s in scores.items()},
            **{f"B-{i}": (second[f"B-{i}"], scores[f"A-{i}"]) for i in range(12)}}
    expected = {p for p, (old, s) in kept.items() if old != ("OK" if s >= threshold else "NG")}
    assert 0 < len(expected) < 24

    open_page(browser, server, "/ui/models")
    form = _form(browser)
    field = form.find_element(By.CSS_SELECTOR, "input[data-field=ok_threshold]")
    assert float(field.get_attribute("value")) == pytest.approx(low)
    labels = form.find_elements(By.CSS_SELECTOR, "fieldset[data-field=ok_labels] input")
    assert [c.get_attribute("value") for c in labels] == ["ok", "dent", "scratch"]
    assert all(c.is_selected() for c in labels)
    save = form.find_element(By.CSS_SELECTOR, "button[data-verdict=save]")
    preview = form.find_element(By.CSS_SELECTOR, "button[data-verdict=preview]")
    assert not save.is_enabled()

    # a value the server refuses: its message, as it said it; Save stays off
    _type_into(browser, field, "1.5")
    tab_to(browser, preview)
    press(browser, Keys.ENTER)
    said = _said(form, "alert")
    assert said.startswith("The server refused: [verdict] not changed:") and "ok_threshold" in \
        said and said.endswith("(HTTP 400)"), said
    assert not save.is_enabled()

    # the preview: the count and the frames are the server's
    _type_into(browser, field, str(threshold))
    tab_to(browser, preview)
    press(browser, Keys.ENTER)
    count = WebDriverWait(browser, 30).until(
        lambda d: form.find_elements(By.CLASS_NAME, "preview-count"))[0].text
    assert count == f"{len(expected)} of the last 24 frames would change verdict."
    assert form.find_element(By.CSS_SELECTOR, "[data-verdict=alert]").text == ""
    rows = form.find_elements(By.CSS_SELECTOR, "table.preview-frames tbody tr")
    cells = [[c.text for c in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    assert {c[0] for c in cells} == expected
    api = httpx.post(f"{server.url}/v1/models/{MODEL}/verdict/preview", timeout=30,
                     json={"ok_threshold": threshold}).json()
    zone = ZoneInfo(ZONE)
    assert [[f["part_id"], f"{f['old']} → {f['new']}",
             datetime.fromtimestamp(f["timestamp"], zone).strftime("%Y-%m-%d %H:%M:%S")]
            for f in api["frames_changed"]] == [[c[0], c[2], c[3]] for c in cells]
    rule = httpx.get(f"{server.url}/v1/models/{MODEL}/verdict", timeout=10).json()["verdict"]
    assert rule["ok_threshold"] == pytest.approx(low)  # a preview changes nothing
    screenshot(browser, "models-verdict-preview")
    assert axe_violations(browser) == []

    # Save, with the keyboard; the rule in force and the next frame follow
    assert save.is_enabled()
    tab_to(browser, save, limit=4)
    press(browser, Keys.ENTER)
    said = _said(form, "status")
    assert said.startswith(f"Saved: the rules of {MODEL} now in force are ") and \
        f"ok_threshold = {threshold}" in said, said
    rule = httpx.get(f"{server.url}/v1/models/{MODEL}/verdict", timeout=10).json()["verdict"]
    assert rule["ok_threshold"] == threshold
    flips = sorted(p for p in expected if p.startswith("A-"))
    png = images[int(flips[0][2:])]
    assert _inspect(server, png, "C-0")["verdict"] == "NG"
    assert not save.is_enabled()  # the next change is previewed first
    table = browser.find_element(By.XPATH, f"//section[h2='{MODEL}']//table[@class='rules']")
    assert str(threshold) in table.text

    # a changed value needs a new preview before Save
    _type_into(browser, field, "0.1")
    assert not save.is_enabled()


def test_a_viewer_sees_the_rules_but_no_form(browser, tmp_path):
    make_tiny_model(tmp_path / "repo" / MODEL, TOML)
    add_users(tmp_path / "data")
    s = start_server(tmp_path / "repo", tmp_path, "--host", "0.0.0.0", grpc=False,
                     env={"XDG_DATA_HOME": str(tmp_path / "data")})
    try:
        sign_in(browser, s, "otto", PASSWORD)  # a viewer
        text = page_text(browser)
        assert "ok_threshold" in text and "Your role may read these rules but not change" in text
        assert browser.find_elements(By.CSS_SELECTOR, "form.verdict-form") == []
        screenshot(browser, "models-verdict-viewer")
        assert axe_violations(browser) == []
        sign_in(browser, s, "qe-anna", PASSWORD)  # quality
        form = _form(browser)
        field = form.find_element(By.CSS_SELECTOR, "input[data-field=ok_threshold]")
        _type_into(browser, field, "0.25")
        tab_to(browser, form.find_element(By.CSS_SELECTOR, "button[data-verdict=preview]"))
        press(browser, Keys.ENTER)
        count = WebDriverWait(browser, 30).until(
            lambda d: form.find_elements(By.CLASS_NAME, "preview-count"))[0].text
        assert count == "0 of the last 0 frames would change verdict."
        tab_to(browser, form.find_element(By.CSS_SELECTOR, "button[data-verdict=save]"), 4)
        press(browser, Keys.ENTER)
        assert _said(form, "status").startswith(f"Saved: the rules of {MODEL}")
        audit = [ln for ln in s.log().splitlines() if "ok_threshold" in ln and "qe-anna" in ln]
        assert audit, s.log()[-3000:]
    finally:
        browser.delete_all_cookies()
        s.stop()


_FETCH = """
const [method, url, body, token, done] = arguments;
const headers = {"Content-Type": "application/json", "Accept": "application/json"};
if (token !== null) headers["X-CSRF-Token"] = token;
fetch(url, {method: method, headers: headers, body: body, credentials: "same-origin"})
  .then(async r => done([r.status, await r.text()]), e => done([0, String(e)]));
"""


def _fetch(driver, method: str, url: str, body: str | None = None,
           token: str | None = None) -> tuple[int, str]:
    """A request the page itself sends (its cookies, its origin), as the console's scripts do."""
    status, text = driver.execute_async_script(_FETCH, method, url, body, token)
    return status, text


def test_a_change_needs_the_sessions_token_and_signing_out_ends_the_session(
        browser, tmp_path):
    make_tiny_model(tmp_path / "repo" / MODEL, TOML)
    add_users(tmp_path / "data")
    s = start_server(tmp_path / "repo", tmp_path, "--host", "0.0.0.0", grpc=False,
                     env={"XDG_DATA_HOME": str(tmp_path / "data")})
    change = '{"ok_threshold": 0.3}'
    url = f"/v1/models/{MODEL}/verdict"
    try:
        sign_in(browser, s, "qe-anna", PASSWORD)  # quality: may change the rules
        assert "Signed in as qe-anna (quality)" in page_text(browser)
        assert axe_violations(browser) == []
        status, text = _fetch(browser, "GET", "/ui/session")
        token = json.loads(text)["csrf_token"]
        for wrong in (None, "not-the-token", token[:-1] + ("0" if token[-1] != "0" else "1")):
            status, text = _fetch(browser, "PUT", url, change, wrong)
            assert status == 403 and "CSRF" in text, (wrong, status, text)
        cookies = {c["name"]: c["value"] for c in browser.get_cookies()}  # HttpOnly ones too
        # the sign-out button, with the keyboard
        browser.find_element(By.TAG_NAME, "body").click()
        tab_to(browser, browser.find_element(By.ID, "sign-out"))
        press(browser, Keys.ENTER)
        WebDriverWait(browser, 30).until(lambda d: d.current_url.endswith("/ui/login"))
        assert not browser.get_cookies()  # the cookie is cleared
        # and the session is over on the server: its old cookie and token change nothing, and
        # open no page
        with httpx.Client(base_url=s.url, cookies=cookies, timeout=10,
                          headers={"X-CSRF-Token": token}) as old:
            r = old.put(url, content=change, headers={"Content-Type": "application/json"})
            assert r.status_code == 401, r.text
            assert old.get("/ui/session").status_code == 401
            assert old.get("/ui/models").status_code == 401
        rule = httpx.get(f"{s.url}{url}", timeout=10).json()
        assert "0.3" not in json.dumps(rule), rule
    finally:
        browser.delete_all_cookies()
        s.stop()
