"""Flagging an escape on a part's console page, in a real browser (Debian's headless Chromium
through Selenium) against a real server with the shipped classifier, ``--capture learn`` at a
sample that keeps no OK frame (docs/console.md, docs/closed-loop.md): a quality user signed in
through ``/ui/login`` opens the part's page, opens "This OK was wrong" and flags the answer as a
scratch with the keyboard alone; the page then says so and shows the frame, which the flag
captured from the recent frames in memory; the store keeps the label under the user's name and
the record names the image (``kept_for`` ``flagged``); axe-core finds no WCAG 2.1 A/AA
violation."""

from __future__ import annotations

import httpx
import pytest
from browserkit import MARKS, axe_violations, learning_server, press, screenshot, sign_in, tab_to
from conftest import wait_for

from tests.integration.test_console_users import PASSWORD
from visionserve.records.store import SqliteStore
from visionserve_tools import synthetic

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped with the reason (pytestmark)
    pass

pytestmark = MARKS  # browser, slow, and skipped (with the reason) without Chromium

MODEL = "defect-classifier"
PART = "F-1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flag-browser")
    s = learning_server(tmp, MODEL, "--capture-sample-percent", "0.001")
    s.store = SqliteStore(tmp / "data" / "records.sqlite")
    # a good part's look: the shipped model passes it (the escape the operator saw)
    r = httpx.post(f"{s.url}/v1/models/{MODEL}/inspect", timeout=60,
                   content=synthetic.encode(synthetic.generate("ok", seed=3)),
                   headers={"Content-Type": "image/jpeg", "X-Part-Id": PART,
                            "X-Deadline-Ms": "10000"})
    assert r.status_code == 200 and r.json()["verdict"] == "OK", r.text
    wait_for(lambda: s.store.history(PART), 30, "the part's record")
    yield s
    s.stop()


def test_a_quality_user_flags_an_escape_with_the_keyboard(browser, server):
    (record,) = server.store.history(PART)
    assert record.image is None  # the policy did not keep it
    sign_in(browser, server, "qe-anna", PASSWORD, then=f"/ui/parts/{PART}")
    (answer,) = browser.find_elements(By.CSS_SELECTOR, "section.answer[data-record]")
    rid = int(answer.get_attribute("data-record"))
    summary = answer.find_element(By.CSS_SELECTOR, "details.flag summary")
    assert summary.text == "This OK was wrong"

    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, summary)
    press(browser, Keys.ENTER)  # opens the flag's form
    select = answer.find_element(By.CSS_SELECTOR, "details.flag select[name=label]")
    assert select.is_displayed() and select.get_attribute("value") == ""  # nothing chosen
    tab_to(browser, select, limit=3)
    press(browser, "scr")  # the select's type-ahead: scratch
    assert select.get_attribute("value") == "scratch"
    flag = answer.find_element(By.CSS_SELECTOR, "details.flag button[type=submit]")
    tab_to(browser, flag, limit=3)
    press(browser, Keys.ENTER)
    status = answer.find_element(By.CSS_SELECTOR, "[data-review=status]")
    said = WebDriverWait(browser, 30).until(
        lambda d: (t := status.text.strip()) and t != "Working…" and t)
    assert said == f"Record {rid} flagged: scratch. Its frame is kept for learning.", said
    assert answer.find_element(By.CSS_SELECTOR, "[data-review=alert]").text == ""
    # the frame, captured by the flag, is shown where the page said it was not captured
    img = WebDriverWait(browser, 30).until(
        lambda d: answer.find_elements(By.CSS_SELECTOR, "figure.picture img"))[0]
    WebDriverWait(browser, 30).until(
        lambda d: d.execute_script("return arguments[0].complete && arguments[0].naturalWidth",
                                   img))
    assert img.get_attribute("alt").startswith(f"Frame of part {PART}")

    (kept,) = server.store.history(PART)
    assert kept.image and kept.kept_for == "flagged"
    (label,) = server.store.labels(rid)
    assert label.label == {"label": "scratch", "verdict_was_wrong": True}
    assert (label.by, label.source) == ("qe-anna", "flag")
    screenshot(browser, "part-flagged")
    assert axe_violations(browser) == []
