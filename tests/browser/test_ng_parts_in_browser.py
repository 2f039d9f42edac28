"""The NG parts pages (``/ui/parts``, ``/ui/parts/{part}``, docs/console.md) in Debian's headless
Chromium against a real server on the shipped detector with ``--records --capture ng``: the
gallery shows each captured NG frame with the detector's boxes drawn (the overlay image loaded),
newest first, and marks its first data for the Performance API; a filter by part id typed with
the keyboard narrows it; the part's page shows its record; axe-core finds no WCAG 2.1 A/AA
violation on either; screenshots go to ``build/console-screenshots/``."""

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
from conftest import start_server, wait_for

from visionserve_tools import synthetic

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped by the marks below, with the reason
    pass

pytestmark = MARKS

MODEL = "defect-detector"
#: part id -> the defect its frame shows (each one the shipped detector finds: NG)
PARTS = {"NG-101": "scratch", "NG-102": "crack", "NG-103": "scratch"}


@pytest.fixture(scope="module")
def line(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ngparts")
    s = start_server(shipped_repo(tmp / "repo", (MODEL,), recipes=False), tmp, "--records",
                     "--records-dir", str(tmp / "data"), "--capture", "ng", "--time-zone", ZONE,
                     grpc=False)
    for seed, (part, label) in enumerate(PARTS.items()):
        r = httpx.post(f"{s.url}/v1/models/{MODEL}/inspect", timeout=60,
                       content=synthetic.encode(synthetic.generate(label, seed=seed)),
                       headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                                "X-Deadline-Ms": "10000"})  # a loaded machine is no takt's
        assert r.status_code == 200 and r.json()["verdict"] == "NG", r.text
    wait_for(lambda: httpx.get(f"{s.url}/v1/records", params={"verdict": "NG"}, timeout=10)
             .json()["count"] == len(PARTS), 20, "the NG records")
    yield s
    s.stop()


def _loaded_images(browser) -> list[dict]:
    """Every image of the page once each has loaded: its source and natural width."""
    script = ("return Array.from(document.images).map(i => ({src: i.currentSrc, "
              "complete: i.complete, width: i.naturalWidth}))")
    WebDriverWait(browser, 30).until(
        lambda d: all(i["complete"] for i in d.execute_script(script)))
    return browser.execute_script(script)


def _cards(browser) -> list[str]:
    """The part ids of the gallery's cards, in order."""
    return [a.text for a in browser.find_elements(By.CSS_SELECTOR, "#gallery .card dd a")]


def test_the_gallery_shows_each_ng_frame_with_its_boxes_and_filters_by_part(browser, line):
    open_page(browser, line, "/ui/parts")
    assert _cards(browser) == list(reversed(PARTS))  # newest first
    images = _loaded_images(browser)
    assert len(images) == len(PARTS)
    for image in images:  # the overlay variant, loaded
        assert image["width"] > 0 and "/overlay?size=" in image["src"], image
    first = images[0]["src"]
    drawn = httpx.get(first, timeout=30).content
    plain = httpx.get(first.replace("/overlay?", "/image?"), timeout=30).content
    assert drawn != plain
    marks = browser.execute_script(
        "return performance.getEntriesByName('visionserve:first-data', 'mark').length")
    assert marks == 1
    text = page_text(browser)
    assert f"Times in {ZONE}." in text and f"{MODEL}:1" in text and "crack" in text
    nav = browser.find_element(By.CSS_SELECTOR, "nav a[aria-current='page']")
    assert nav.get_attribute("href").endswith("/ui/parts")
    screenshot(browser, "parts")
    assert axe_violations(browser) == []
    # the filter, with the keyboard: Tab to the part id, type it, Enter submits the form
    field = browser.find_element(By.ID, "parts-part")
    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, field)
    press(browser, "NG-102", Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: "part_id=NG-102" in d.current_url)
    assert _cards(browser) == ["NG-102"]
    assert browser.find_element(By.ID, "parts-part").get_attribute("value") == "NG-102"
    assert all(i["width"] > 0 for i in _loaded_images(browser))


def test_the_parts_page_shows_its_record_and_image(browser, line):
    open_page(browser, line, "/ui/parts?part_id=NG-101")
    link = browser.find_element(By.LINK_TEXT, "NG-101")
    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, link)
    press(browser, Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: d.current_url.endswith("/ui/parts/NG-101"))
    assert browser.find_element(By.TAG_NAME, "h1").text == "Part NG-101"
    record = httpx.get(f"{line.url}/v1/parts/NG-101", timeout=10).json()["records"][0]
    text = page_text(browser)
    for words in (MODEL, record["request_id"], "NG", "batch of 1", "scratch"):
        assert words in text, (words, text)
    images = _loaded_images(browser)
    assert len(images) == 1 and images[0]["width"] > 0 and "/overlay?size=" in images[0]["src"]
    marks = browser.execute_script(
        "return performance.getEntriesByName('visionserve:first-data', 'mark').length")
    assert marks == 1
    screenshot(browser, "part")
    assert axe_violations(browser) == []


def test_the_line_live_page_shows_the_last_ng_parts_picture(browser, line):
    """(last in this file: it adds an NG record the gallery tests above do not expect)"""
    open_page(browser, line, "/ui/live")
    caption = (By.ID, "last-ng-caption")
    WebDriverWait(browser, 10).until(lambda d: "NG-103" in d.find_element(*caption).text)
    r = httpx.post(f"{line.url}/v1/models/{MODEL}/inspect", timeout=60,
                   content=synthetic.encode(synthetic.generate("crack", seed=7)),
                   headers={"Content-Type": "image/jpeg", "X-Part-Id": "NG-LIVE-1",
                            "X-Deadline-Ms": "10000"})
    assert r.status_code == 200 and r.json()["verdict"] == "NG", r.text
    WebDriverWait(browser, 5).until(lambda d: "NG-LIVE-1" in d.find_element(*caption).text)
    image = browser.find_element(By.ID, "last-ng-image")
    WebDriverWait(browser, 10).until(lambda d: d.execute_script(
        "const i = arguments[0]; return i.complete && i.naturalWidth > 0", image))
    record = httpx.get(f"{line.url}/v1/parts/NG-LIVE-1", timeout=10).json()["records"][0]
    assert image.get_attribute("src").endswith("/overlay?size=640") and "crack" in \
        browser.find_element(*caption).text, record
    assert image.get_attribute("alt").startswith("The captured frame of NG part NG-LIVE-1")
    assert browser.find_element(By.ID, "last-ng-link").get_attribute("href") \
        .endswith("/ui/parts/NG-LIVE-1")
    totals = (By.CSS_SELECTOR, "[data-summary] [data-part=totals]")  # read every 3 s
    WebDriverWait(browser, 10).until(lambda d: "NG 1" in d.find_element(*totals).text)
    screenshot(browser, "live-last-ng")
    assert axe_violations(browser) == []
