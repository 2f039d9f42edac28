"""The console's Audit log page in a real browser (Debian's headless Chromium through Selenium)
against a real server with users (docs/console.md, docs/security.md "The audit trail"): a quality
user changes a verdict rule through the Models page's form, then finds the change under their
name on the Audit log page, reached from the navigation and filtered with the keyboard; a
viewer's navigation has no Audit log. axe-core finds no WCAG 2.1 A/AA violation."""

from __future__ import annotations

import pytest
from browserkit import (
    MARKS,
    axe_violations,
    page_text,
    press,
    screenshot,
    sign_in,
    tab_to,
)
from conftest import make_tiny_model, start_server

from tests.browser.test_console_verdict import MODEL, TOML, _form, _said, _type_into
from tests.integration.test_console_users import PASSWORD, add_users

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped with the reason (pytestmark)
    pass

pytestmark = MARKS  # browser, slow, and skipped (with the reason) without Chromium

ZONE = "Europe/Berlin"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console-audit")
    make_tiny_model(tmp / "repo" / MODEL, TOML)
    add_users(tmp / "data")
    s = start_server(tmp / "repo", tmp, "--host", "0.0.0.0", "--time-zone", ZONE, grpc=False,
                     env={"XDG_DATA_HOME": str(tmp / "data")})
    yield s
    s.stop()


def _rows(driver) -> list[str]:
    return [r.text for r in driver.find_elements(By.CSS_SELECTOR, "table.audit tbody tr")]


def test_a_verdict_change_shows_on_the_audit_page_under_its_user(browser, server):
    sign_in(browser, server, "qe-anna", PASSWORD)  # quality: on the Models page
    form = _form(browser)
    _type_into(browser, form.find_element(By.CSS_SELECTOR, "input[data-field=ok_threshold]"),
               "0.25")
    tab_to(browser, form.find_element(By.CSS_SELECTOR, "button[data-verdict=preview]"))
    press(browser, Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: form.find_elements(By.CLASS_NAME, "preview-count"))
    tab_to(browser, form.find_element(By.CSS_SELECTOR, "button[data-verdict=save]"), 4)
    press(browser, Keys.ENTER)
    assert _said(form, "status").startswith(f"Saved: the rules of {MODEL}")

    # the navigation leads there, by keyboard
    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, browser.find_element(By.LINK_TEXT, "Audit log"))
    press(browser, Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: d.current_url.endswith("/ui/audit"))
    assert f"Time ({ZONE})" in page_text(browser)
    newest = _rows(browser)[0]
    assert "qe-anna" in newest and "Verdict rules changed" in newest, newest
    assert f"model {MODEL}" in newest and "ok_threshold: 0.0 → 0.25" in newest, newest

    # filter by user with the keyboard: type the name, Enter sends the form
    user = browser.find_element(By.ID, "audit-user")
    tab_to(browser, user)
    press(browser, "qe-anna", Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: "user=qe-anna" in d.current_url)
    rows = _rows(browser)
    assert rows and all("qe-anna" in r for r in rows), rows
    assert any("Signed in" in r for r in rows) and any("Verdict rules changed" in r for r in rows)
    assert not any("User added" in r for r in rows)  # those were by the OS user
    screenshot(browser, "audit")
    assert axe_violations(browser) == []

    sign_in(browser, server, "otto", PASSWORD)  # a viewer: no Audit log in the navigation
    assert browser.find_elements(By.LINK_TEXT, "Audit log") == []
    browser.delete_all_cookies()
