"""The Line live page (``/ui/live``, docs/console.md) in Debian's headless Chromium against real
servers on the shipped classifier, in the serving process and with ``--frontends 2``: each part
id the test inspects shows on the page within a second, newest on top, with its verdict as text;
the counts and plots add up to what was sent; a filter by station shows only that station's
answers; a reconnect (the stream cut by the test) shows no row twice; the keyboard reaches the
filter; axe-core finds no WCAG 2.1 A/AA violation; a screenshot goes to
``build/console-screenshots/``."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from types import SimpleNamespace

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

from visionserve_tools import synthetic

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # skipped by the marks below, with the reason
    pass

pytestmark = MARKS

MODEL = "defect-classifier"
INSPECT = f"/v1/models/{MODEL}/inspect"
FRAMES = {label: synthetic.encode(synthetic.generate(label, seed=3)) for label in ("ok", "scratch")}


@pytest.fixture(scope="module", params=["0", "2"], ids=["serving-process", "frontends-2"])
def line(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("live")
    s = start_server(shipped_repo(tmp / "repo", (MODEL,)), tmp, "--frontends", request.param,
                     "--time-zone", ZONE, grpc=False)
    yield s
    s.stop()


def _inspect(server, part: str, label: str = "ok", **headers: str) -> dict:
    # a deadline a loaded test machine meets (the shipped model's takt is for a free one)
    r = httpx.post(server.url + INSPECT, content=FRAMES[label], timeout=30,
                   headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                            "X-Deadline-Ms": "10000", **headers})
    assert r.status_code == 200, r.text
    return r.json()


def _rows(browser) -> list[list[str]]:
    return browser.execute_script(
        "return [...document.querySelectorAll('#live-rows tr')]"
        ".map(tr => [...tr.cells].map(td => td.textContent))")


def _live(browser, server, query: str = "") -> None:
    open_page(browser, server, "/ui/live" + query)
    WebDriverWait(browser, 30).until(
        lambda d: d.find_element(By.ID, "live-state").text.startswith("Live:"))


def _part_shown_within(browser, part: str, sent: float, within_s: float = 1.0) -> list[str]:
    row = WebDriverWait(browser, 10, poll_frequency=0.02).until(
        lambda d: next((r for r in _rows(d) if part in r), None))
    took = time.monotonic() - sent
    assert took < within_s, f"part {part} showed after {took:.2f} s"
    return row


def test_each_part_shows_within_a_second_and_the_counts_add_up(browser, line):
    _live(browser, line)
    sent_verdicts = []
    for i in range(6):
        part = f"LIVE-{i}"
        sent = time.monotonic()
        answer = _inspect(line, part, "scratch" if i % 3 == 2 else "ok",
                          **{"X-Station-Id": "line1-st3"})
        row = _part_shown_within(browser, part, sent)
        assert answer["verdict"] in row, (answer, row)  # the verdict as text, not colour alone
        assert row[2] == "line1-st3" and row[1] == f"{MODEL} 1", row
        sent_verdicts.append(answer["verdict"])
    # a LATE answer: a deadline no frame can meet
    sent = time.monotonic()
    r = httpx.post(line.url + INSPECT, content=FRAMES["ok"], timeout=30, headers={
        "Content-Type": "image/jpeg", "X-Part-Id": "LIVE-late", "X-Deadline-Ms": "0.001"})
    assert r.status_code == 504, r.text
    late = _part_shown_within(browser, "LIVE-late", sent)
    assert "LATE" in late
    sent_verdicts.append("LATE")
    # newest on top
    parts = [r[3] for r in _rows(browser)]
    assert parts[:7] == ["LIVE-late"] + [f"LIVE-{i}" for i in reversed(range(6))], parts
    # the counts and the plots say what was sent
    totals = (f"Totals: OK {sent_verdicts.count('OK')}, NG {sent_verdicts.count('NG')}, "
              f"LATE 1, refused 0.")
    WebDriverWait(browser, 15).until(
        lambda d: d.find_element(By.CSS_SELECTOR, "[data-part=totals]").text == totals)
    title = browser.find_element(By.CSS_SELECTOR, "[data-part=counts] svg title")
    assert f"OK {sent_verdicts.count('OK')}, NG {sent_verdicts.count('NG')}, LATE 1" in \
        title.get_attribute("textContent")
    assert browser.find_elements(By.CSS_SELECTOR, "[data-part=counts] svg rect")
    assert browser.find_elements(By.CSS_SELECTOR, "[data-part=latency] svg line.takt")
    assert "takt 200 ms." in page_text(browser)
    assert f"Times in {ZONE}." in page_text(browser)
    screenshot(browser, f"live-{line.args[line.args.index('--frontends') + 1]}")
    assert axe_violations(browser) == []


class Cutter:
    """A TCP relay between the browser and the server whose connections the test can cut, as a
    network or a proxy would: the page's stream breaks and the browser reconnects."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            self.open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        for s in self.open:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.open.clear()

    def close(self) -> None:
        self.listener.close()
        self.cut()


def test_a_reconnect_shows_no_row_twice(browser, line):
    cutter = Cutter(line.http_port)
    try:
        via = SimpleNamespace(url=cutter.url)
        _live(browser, via)
        for i in range(3):
            _inspect(line, f"R-{i}")
        _part_shown_within(browser, "R-2", time.monotonic(), within_s=5.0)
        shown = len(_rows(browser))
        cutter.cut()  # the browser reconnects by itself, with the last event id it had
        WebDriverWait(browser, 10).until(
            lambda d: d.find_element(By.ID, "live-state").text.startswith("The connection"))
        WebDriverWait(browser, 15).until(
            lambda d: d.find_element(By.ID, "live-state").text.startswith("Live:"))
        _inspect(line, "R-3")
        _part_shown_within(browser, "R-3", time.monotonic(), within_s=5.0)
        ids = browser.execute_script(
            "return [...document.querySelectorAll('#live-rows tr')].map(tr => tr.dataset.id)")
        assert len(ids) == len(set(ids)) == min(shown + 1, 50), ids
    finally:
        cutter.close()


def test_the_filter_by_station_with_the_keyboard(browser, line):
    _live(browser, line)
    select = browser.find_element(By.ID, "live-station")
    browser.find_element(By.TAG_NAME, "body").click()
    tab_to(browser, browser.find_element(By.ID, "live-model"))
    tab_to(browser, select, limit=3)
    press(browser, Keys.ARROW_DOWN)  # the first station: line1-st3
    assert select.get_attribute("value") == "line1-st3"
    tab_to(browser, browser.find_element(By.CSS_SELECTOR, ".filter button"), limit=3)
    press(browser, Keys.ENTER)
    WebDriverWait(browser, 30).until(lambda d: "station=line1-st3" in d.current_url)
    WebDriverWait(browser, 30).until(
        lambda d: d.find_element(By.ID, "live-state").text.startswith("Live:"))
    sent = time.monotonic()
    _inspect(line, "F-other")  # no station: not this filter's
    _inspect(line, "F-st3", **{"X-Station-Id": "line1-st3"})
    _part_shown_within(browser, "F-st3", sent, within_s=5.0)
    stations = {r[2] for r in _rows(browser)}
    assert stations == {"line1-st3"}, stations
    assert not any("F-other" in r for r in _rows(browser))
    assert axe_violations(browser) == []


def test_an_unknown_model_or_station_is_a_clear_404(line):
    for query, words in (("?model=nope", "no model 'nope'"), ("?station=nope", "no station")):
        r = httpx.get(line.url + "/ui/live" + query, timeout=10)
        assert r.status_code == 404 and words in r.json()["error"], r.text
