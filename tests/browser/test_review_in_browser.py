"""Labelling a captured frame on the console's Review page, in a real browser (Debian's headless
Chromium through Selenium) against a real server with the shipped classifier and
``--capture learn`` (docs/console.md): a quality user signed in through ``/ui/login`` picks a
label with the keyboard alone (the focus visible on the way), saves it, and sees the card say so;
the store keeps it under the user's name; axe-core finds no WCAG 2.1 A/AA violation."""

from __future__ import annotations

import httpx
import pytest
from browserkit import MARKS, axe_violations, learning_server, open_page, press, screenshot, tab_to
from conftest import wait_for

from tests.integration.test_console_users import PASSWORD
from visionserve_tools import synthetic

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped with the reason (pytestmark)
    pass

pytestmark = MARKS  # browser, slow, and skipped (with the reason) without Chromium

MODEL = "defect-classifier"
TOKEN = "review-browser-admin-token-0123"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("review-browser")
    s = learning_server(tmp, MODEL, "--admin-token", TOKEN, "--capture-sample-percent", "100")
    for i, look in enumerate(("ok", "scratch")):
        r = httpx.post(f"{s.url}/v1/models/{MODEL}/inspect", timeout=60,
                       content=synthetic.encode(synthetic.generate(look, seed=i)),
                       headers={"Content-Type": "image/jpeg", "X-Part-Id": f"R-{i}",
                                "X-Deadline-Ms": "10000"})
        assert r.status_code == 200, r.text
    wait_for(lambda: len(_queue(s)) == 2, 30, "both frames in the queue")
    yield s
    s.stop()


def _queue(server, state: str = "unlabelled") -> list[dict]:
    return httpx.get(f"{server.url}/v1/review", params={"model": MODEL, "state": state},
                     headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()["records"]


def _focus_visible(driver) -> bool:
    return driver.execute_script(
        "const s = getComputedStyle(document.activeElement);"
        "return s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) > 0;")


def test_a_quality_user_labels_a_frame_with_the_keyboard(browser, server):
    browser.delete_all_cookies()
    browser.get(server.url + "/ui/login")
    browser.find_element(By.ID, "user").send_keys("qe-anna")
    browser.find_element(By.ID, "password").send_keys(PASSWORD, Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: d.current_url.endswith("/ui/live"))
    nav = browser.find_element(By.CSS_SELECTOR, "nav a[href='/ui/review']")
    assert nav.text == "Review"
    open_page(browser, server, f"/ui/review?model={MODEL}")
    cards = browser.find_elements(By.CSS_SELECTOR, "li.card[data-record]")
    assert len(cards) == 2
    card = cards[0]
    rid = int(card.get_attribute("data-record"))
    select = card.find_element(By.CSS_SELECTOR, "select[name=label]")
    save = card.find_element(By.CSS_SELECTOR, "form.review-form button[type=submit]")

    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, select)
    assert _focus_visible(browser)
    press(browser, "spo")  # the select's type-ahead: spot
    assert select.get_attribute("value") == "spot"
    tab_to(browser, save, limit=3)
    assert _focus_visible(browser)
    press(browser, Keys.ENTER)
    status = card.find_element(By.CSS_SELECTOR, "[data-review=status]")
    said = WebDriverWait(browser, 30).until(
        lambda d: (t := status.text.strip()) and t != "Working…" and t)
    assert said == f"Record {rid} labelled: spot", said
    assert card.find_element(By.CSS_SELECTOR, "[data-review=current]").text == "spot"
    assert card.find_element(By.CSS_SELECTOR, "[data-review=alert]").text == ""

    (done,) = _queue(server, "labelled")
    assert done["id"] == rid and done["labelled"]["label"] == "spot"
    assert (done["labelled"]["labelled_by"], done["labelled"]["source"]) == ("qe-anna", "review")
    screenshot(browser, "review-labelled")
    assert axe_violations(browser) == []
