"""What the console's browser tests share: Debian's headless Chromium and its chromedriver
driven by Selenium (the driver's path given, so nothing is downloaded), the marks that skip the
tests with the reason where either is absent, axe-core (vendored under ``vendor/axe-core``), and
the steps every page's test takes. The
``browser`` fixture (one Chromium per test module) is in tests/conftest.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from conftest import CHROMEDRIVER, CHROMIUM, REPO

try:
    from selenium import webdriver
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # the test extra not installed: skipped, with the reason
    webdriver = None

#: a browser test's marks: browser, slow, and skipped (with the reason) without Chromium
MARKS = [pytest.mark.browser, pytest.mark.slow]

AXE = Path(__file__).parent / "vendor" / "axe-core" / "axe.min.js"
SCREENSHOTS = REPO / "build" / "console-screenshots"
SHIPPED = ("defect-classifier", "defect-detector", "surface-anomaly")
#: the stations of the test's recipes file (the repository ships none)
RECIPES = """\
[recipe.housing-black]
description = "Housing, black ABS"
model = "defect-classifier"
version = 1
verdict = { ok_threshold = 0.5 }

[recipe.housing-white]
description = "Housing, white ABS"
model = "defect-classifier"
verdict = { ok_threshold = 0.7 }

[station.line1-st3]
recipe = "housing-black"
cameras = ["cam-7"]

[station.line1-st4]
"""
ZONE = "Europe/Berlin"


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"{path} is absent (apt-get install chromium chromium-driver)"
    if webdriver is None:
        return "selenium is not installed (the test extra)"
    return None


MARKS.append(pytest.mark.skipif(missing() is not None, reason=missing() or ""))


def shipped_repo(root: Path, models: tuple[str, ...] = SHIPPED, recipes: bool = True) -> Path:
    for name in models:
        shutil.copytree(REPO / "models" / name, root / name)
    if recipes:
        (root / "recipes.toml").write_text(RECIPES)
    for path in [root, *root.rglob("*")]:  # the server refuses a repository others can write
        path.chmod(path.stat().st_mode & 0o755)
    return root


def learning_server(tmp: Path, model: str, *extra: str):
    """A server of the shipped ``model`` bound to 0.0.0.0 with the test users (sessions),
    records and ``--capture learn`` (``extra``: its sample, an admin token, ...)."""
    from conftest import start_server

    from tests.integration.test_console_users import add_users

    add_users(tmp / "xdg")
    return start_server(shipped_repo(tmp / "repo", (model,), recipes=False), tmp,
                        "--host", "0.0.0.0", "--records", "--records-dir", str(tmp / "data"),
                        "--capture", "learn", *extra, grpc=False,
                        env={"XDG_DATA_HOME": str(tmp / "xdg")})


def open_page(browser, server, path: str) -> None:
    browser.get(server.url + path)
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.TAG_NAME, "h1"))


def sign_in(driver, server, user: str, password: str, then: str = "/ui/models") -> None:
    """Sign ``user`` in through the sign-in form (a fresh session), then open page ``then``."""
    driver.delete_all_cookies()
    driver.get(server.url + "/ui/login")
    driver.find_element(By.ID, "user").send_keys(user)
    driver.find_element(By.ID, "password").send_keys(password, Keys.ENTER)
    WebDriverWait(driver, 30).until(lambda d: d.current_url.endswith("/ui/live"),  # the home
                                     f"{user} was not signed in")
    open_page(driver, server, then)


def screenshot(browser, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, max(1000, min(int(height) + 200, 6000)))  # + the window frame
    browser.save_screenshot(str(SCREENSHOTS / f"{name}.png"))
    browser.set_window_size(1280, 1000)


def axe_violations(browser) -> list[dict]:
    browser.execute_script(AXE.read_text(encoding="utf-8"))
    result = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document, {runOnly: {type: 'tag', values: "
        "['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa']}})"
        ".then(r => done(r.violations.map(v => ({id: v.id, help: v.help, "
        "nodes: v.nodes.map(n => n.target.join(' '))}))))"
        ".catch(e => done([{id: 'axe failed', help: String(e), nodes: []}]));")
    return result


def page_text(browser) -> str:
    return browser.find_element(By.TAG_NAME, "body").text


def tab_to(browser, element, limit: int = 200) -> None:
    """Press Tab until ``element`` has the focus (it is reachable with the keyboard)."""
    for _ in range(limit):
        if browser.switch_to.active_element == element:
            return
        ActionChains(browser).send_keys(Keys.TAB).perform()
    raise AssertionError(f"{element.text or element.tag_name!r} is not reachable with Tab")


def press(browser, *keys: str) -> None:
    ActionChains(browser).send_keys(*keys).perform()
