"""The closed loop end to end (docs/closed-loop.md) on a real server with the shipped classifier
and anomaly model, ``--guard --records --capture learn --model-control-mode explicit``, and a line
that sends frames from the first step to the last.

The classifier: a new look of an existing NG class, scratches wider and fainter than the model was
trained on (:data:`.benchloop.NEW_LOOK`), comes down the line with its label unchanged, and the
shipped model passes most of them. The quality engineer flags those frames through the API with
their label ("scratch"; good parts of the same run labelled "ok"), a candidate is fine-tuned by a
real guard job on the CPU (every layer, 800 steps), compared on the held-out labelled frames, run in
shadow on live frames and promoted. On fixed-seed held-out sets (:data:`HELD_NEW` frames of the
new look, :data:`HELD_GOOD` good ones) sent through the server before and after: the new look is
rejected at :data:`MIN_RECALL` or more after the promotion, and the false rejects on good parts
rise by one point at most.

The anomaly model: a new good look of the surface that it rejects is flagged good, refitted,
compared, run in shadow and promoted: its false rejects fall, the usual good look and the defects
are judged as before.

Every frame of the line is answered 200, by the version in force at its time. About 11 minutes on
two cores, most of it the classifier's fine-tune (800 steps on one core)."""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Self

import httpx
import pytest
from conftest import wait_for

from tests.integration.test_console_users import quality_session
from tests.integration.test_loop_promote import start
from visionserve_tools import synthetic
from visionserve_tools.benchloop import FLAGGED, HELD, NEW_LOOK, SEEDS, TRAIN, Steps, jpeg, jpegs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

CLASSIFIER, ANOMALY = "defect-classifier", "surface-anomaly"
#: frames flagged on the line: the new look (labelled "scratch") and good parts ("ok")
FLAGGED_NEW, FLAGGED_GOOD = FLAGGED
#: the fixed-seed held-out sets the Done-when is measured on
HELD_NEW, HELD_GOOD = HELD
MIN_RECALL, MAX_FRR_RISE = 0.9, 0.01
#: what the line sends between the frames of interest: every look the model knows
BACKGROUND = [(look, seed) for seed in range(2) for look in synthetic.LABELS]
#: the anomaly model's new good look: a textile surface it was not fitted on, which it rejects
NEW_GOOD = synthetic.SurfaceParams(textures=("textile",), texture_contrast=(2.4, 2.8),
                                   grain_scale=(0.9, 1.2), brightness=(0.45, 0.6),
                                   saturation=(0.2, 0.3), max_rotation_deg=2)
#: its frames: flagged on the line ("this NG was wrong": good), and the held-out sets (new good
#: look, the usual good look, each defect)
ANOMALY_SIZE = (320, 240)
#: the CPU nice increment of this test's server and of the processes that make its frames
NICE = 10
FLAGGED_GOOD_LOOK, HELD_GOOD_LOOK, HELD_USUAL, HELD_DEFECTS = 60, 100, 100, 25


@dataclass
class Answer:
    part: str
    sent: float
    answered: float
    status: int
    version: str | None
    verdict: str | None
    text: str


class Line:
    """The production line: one client that sends, without a pause, the frames put into it
    (with their part ids) and, while there are none, the background frames, paced at about
    ``fps`` frames a second. Every answer is kept, in order."""

    def __init__(self, url: str, model: str, background: list[bytes], fps: float = 25.0) -> None:
        self.url, self.model, self.background, self.period = url, model, background, 1.0 / fps
        self.answers: list[Answer] = []
        self.todo: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        cycle = itertools.cycle(enumerate(self.background))
        n = 0
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                try:
                    part, body = self.todo.get_nowait()
                except queue.Empty:
                    i, body = next(cycle)
                    part, n = f"B-{n}-{i}", n + 1
                    time.sleep(self.period)
                sent = time.monotonic()
                r = client.post(f"{self.url}/v1/models/{self.model}/inspect", content=body,
                                headers={"Content-Type": "image/jpeg", "X-Part-Id": part,
                                         "X-Deadline-Ms": "30000"})
                ok = r.status_code == 200
                self.answers.append(Answer(
                    part, sent, time.monotonic(), r.status_code,
                    r.json().get("version") if ok else None,
                    r.json().get("verdict") if ok else None, r.text[:300]))

    def put(self, prefix: str, bodies: list[bytes]) -> list[str]:
        """Queue ``bodies`` for the line as parts ``<prefix>-<i>``: sent before any background
        frame, in this order; their part ids."""
        parts = [f"{prefix}-{i}" for i in range(len(bodies))]
        for part, body in zip(parts, bodies, strict=True):
            self.todo.put((part, body))
        return parts

    def send(self, prefix: str, bodies: list[bytes]) -> dict[str, Answer]:
        """Send ``bodies`` down the line as parts ``<prefix>-<i>``; their answers, by part."""
        return self.wait(prefix, self.put(prefix, bodies))

    def wait(self, prefix: str, parts: list[str]) -> dict[str, Answer]:
        wanted = set(parts)

        def answered():
            got = {a.part: a for a in list(self.answers) if a.part in wanted}
            return got if len(got) == len(wanted) else None
        return wait_for(answered, 60 + len(parts) * 0.5, f"the answers to {prefix}-*")

    def __enter__(self) -> Self:
        self._thread.start()
        wait_for(lambda: len(self.answers) >= 3, 60, "the line's first answers")
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def ng_share(answers: dict[str, Answer]) -> float:
    return sum(a.verdict == "NG" for a in answers.values()) / len(answers)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # at nice 10, its guard jobs at 19 and SCHED_IDLE: minutes of training and thousands of
    # frames must not slow the tests that run beside this one
    s = start(tmp_path_factory.mktemp("loop-e2e"), "--capture", "learn",
              "--capture-sample-percent", "100", "--model-control-mode", "explicit",
              guard=True, models=(CLASSIFIER, ANOMALY), nice=NICE)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def quality(server):
    yield from quality_session(server, "198.51.100.231")


def shadow_frames(line: Line, prefix: str, bodies: list[bytes]):
    """What sends live frames while a shadow runs: ``bodies`` down the line, their answers kept
    in the returned dict."""
    got: dict[str, Answer] = {}
    return got, lambda: got.update(line.send(prefix, bodies))


def test_a_new_look_of_a_scratch_is_learnt_on_the_line(server, quality):
    steps = Steps(quality, CLASSIFIER)
    with ProcessPoolExecutor(2, initializer=os.nice, initargs=(NICE,)) as pool:
        background = [jpeg((look, 9000 + seed, synthetic.TRAIN_PARAMS, (640, 480)))
                      for look, seed in BACKGROUND]
        flagged_new = jpegs(pool, "scratch", SEEDS["flagged_new"], FLAGGED_NEW, NEW_LOOK)
        flagged_good = jpegs(pool, "ok", SEEDS["flagged_good"], FLAGGED_GOOD)
        held_new = jpegs(pool, "scratch", SEEDS["held_new"], HELD_NEW, NEW_LOOK)
        held_good = jpegs(pool, "ok", SEEDS["held_good"], HELD_GOOD)

    line = Line(server.url, CLASSIFIER, background, fps=10)
    # the first frames down the line: their records are the first (the held-out split of the
    # labelled records goes by record id: the same frames are held out every run)
    new_parts, good_parts = line.put("N", flagged_new), line.put("G", flagged_good)
    with line:
        # 1. the new look comes down the line; the shipped model passes most of it
        escaped = line.wait("N", new_parts)
        line.wait("G", good_parts)
        assert ng_share(escaped) < 0.5  # the new look escapes
        assert {a.version for a in escaped.values()} == {"1"}

        # 2. flagged and labelled through the API: "this OK was wrong: a scratch"
        recs = steps.records("N", "G", count=FLAGGED_NEW + FLAGGED_GOOD)  # each one captured
        for part, rec in recs.items():
            if part.startswith("N-"):
                steps.flag(rec["id"], "scratch", escaped[part].verdict == "OK")
            else:
                steps.label(rec["id"], "ok")
        labelled_at = time.monotonic()

        # 3. trained through the guard (the loop's fine-tune), beside the line
        cid = steps.request(TRAIN)
        # the held-out sets, judged by the live version while the candidate trains
        before_recall = ng_share(line.send("HN", held_new))
        before_frr = ng_share(line.send("HG", held_good))
        done = steps.trained(cid)
        trained_at = time.monotonic()
        assert done["candidate"]["metrics"]["keep_batch_norm"] is True

        # 4. compared on the held-out labelled frames, then in shadow on live frames
        summary = steps.compare(cid)["summary"]
        live, cand = summary["live"], summary["candidate"]
        assert cand["ng_recall"] > live["ng_recall"], summary
        shadow_new, send = shadow_frames(line, "SN", held_new[:40])
        shadow = steps.shadow(cid, send)
        # the candidate rejects the new look the live version passes: they disagree there
        assert shadow["candidate_ng"] > shadow["live_ng"], shadow
        assert {a.version for a in shadow_new.values()} == {"1"}  # the live version answered

        # 5. promoted: the next version serves the line
        promoted, promote_sent, promoted_at, after, answers = promote_and_send(
            steps, cid, line, "A", {"N": held_new, "G": held_good})
        assert promoted["version"] == 2 and promoted["approved_by"] == "qe-anna"
        after_recall, after_frr = after["N"], after["G"]

    figures = (f"new look rejected {before_recall:.3f} -> {after_recall:.3f}; false rejects on "
               f"good parts {before_frr:.4f} -> {after_frr:.4f}; labels submitted to trained "
               f"{trained_at - labelled_at:.0f} s, to promoted {promoted_at - labelled_at:.0f} s;"
               f" held-out labelled frames: live {live}, candidate {cand}")
    learnt(figures, before_frr, after_recall, after_frr)

    # 6. every frame answered, by the version in force at its time
    switched_once(answers, promote_sent, promoted_at)

    # the candidate's trail names the labelled frames, who labelled them and the promotion
    trail = quality.get(f"{steps.base}/{cid}/trace").json()
    assert {f["labelled_by"] for f in trail["trained_on"] + trail["held_out"]} == {"qe-anna"}
    assert len(trail["trained_on"]) + len(trail["held_out"]) == FLAGGED_NEW + FLAGGED_GOOD
    (kept,) = trail["promotions"]
    assert kept["version"] == 2 and kept["approved_by"] == "qe-anna"


def test_a_new_good_look_is_refitted_into_the_anomaly_model(server, quality):
    """The anomaly model's loop: a new good look of the surface that it rejects comes down the
    line; the operator flags those NG as wrong (good); the refit with the good parts (no defect
    labels needed) is compared, run in shadow and promoted; on fixed-seed held-out sets the
    false rejects of the new look fall, the usual good look and the defects are judged as
    before; every frame answered, by the version in force at its time."""
    steps = Steps(quality, ANOMALY)
    size = ANOMALY_SIZE
    with ProcessPoolExecutor(2, initializer=os.nice, initargs=(NICE,)) as pool:
        background = jpegs(pool, "ok", 9100, 6, size=size)
        flagged = jpegs(pool, "ok", 5_000_000, FLAGGED_GOOD_LOOK, NEW_GOOD, size)
        held = {"new": jpegs(pool, "ok", 6_000_000, HELD_GOOD_LOOK, NEW_GOOD, size),
                "usual": jpegs(pool, "ok", 6_100_000, HELD_USUAL, size=size),
                "bad": [b for i, look in enumerate(synthetic.DEFECT_LABELS)
                        for b in jpegs(pool, look, 6_200_000 + 1000 * i, HELD_DEFECTS,
                                       size=size)]}

    line = Line(server.url, ANOMALY, background, fps=10)
    parts = line.put("AF", flagged)
    with line:
        flagged_answers = line.wait("AF", parts)
        assert ng_share(flagged_answers) >= 0.5  # the new good look is rejected
        recs = steps.records("AF", count=FLAGGED_GOOD_LOOK)
        for part, rec in recs.items():
            if flagged_answers[part].verdict == "NG":  # "this NG was wrong"
                steps.flag(rec["id"], "good", True)
        labelled_at = time.monotonic()

        cid = steps.request({})
        # the held-out sets, judged by the live version while the refit runs: sent after the
        # candidate took its good parts (the captured OK frames among them)
        before = {name: ng_share(line.send(f"A{name}", body)) for name, body in held.items()}
        done = steps.trained(cid, 600)
        assert done["candidate"]["kind"] == "refit"
        summary = steps.compare(cid)["summary"]
        assert summary["candidate"]["false_reject_rate"] < summary["live"]["false_reject_rate"]

        _, send = shadow_frames(line, "AS", held["new"][:30])
        shadow = steps.shadow(cid, send)
        # the candidate passes the new good look the live version rejects
        assert shadow["candidate_ng"] < shadow["live_ng"], shadow
        assert {d["candidate"]["label"] for d in shadow["disagreements"]} <= {"good", "defective"}

        promoted, promote_sent, promoted_at, after, answers = promote_and_send(
            steps, cid, line, "B", held)
        assert promoted["version"] == 2

    figures = (f"anomaly model, NG share before -> after: new good look {before['new']:.3f} -> "
               f"{after['new']:.3f}, usual good look {before['usual']:.3f} -> "
               f"{after['usual']:.3f}, defects {before['bad']:.3f} -> {after['bad']:.3f}; labels "
               f"submitted to promoted {promoted_at - labelled_at:.0f} s")
    print(figures)
    assert after["new"] <= before["new"] / 2, figures
    # the usual good look: at most 2 of its frames more rejected; the defects: at most 3 of them
    # more passed (a good look learnt resembles a few defects a little more)
    assert after["usual"] <= before["usual"] + 0.02 + 1e-9, figures
    assert after["bad"] >= before["bad"] - 0.03 - 1e-9, figures
    switched_once(answers, promote_sent, promoted_at)


def promote_and_send(steps: Steps, cid: str, line: Line, prefix: str,
                     held: dict[str, list[bytes]]
                     ) -> tuple[dict, float, float, dict[str, float], list[Answer]]:
    """The candidate promoted while the line runs, then each of the ``held`` sets sent down the
    line (parts ``<prefix><name>-<i>``): the promotion's answer, the times its request was sent
    and answered, each set's NG share, and every answer of the line by then."""
    sent = time.monotonic()
    promoted = steps.promote(cid)
    answered = time.monotonic()
    after = {name: ng_share(line.send(f"{prefix}{name}", bodies))
             for name, bodies in held.items()}
    return promoted, sent, answered, after, list(line.answers)


def learnt(figures: str, before_frr: float, after_recall: float, after_frr: float) -> None:
    """The loop's outcome (``figures`` printed): the new look rejected at :data:`MIN_RECALL` or
    more, the false rejects on good parts up by :data:`MAX_FRR_RISE` at most."""
    print(figures)
    assert after_recall >= MIN_RECALL, figures
    assert after_frr - before_frr <= MAX_FRR_RISE, figures


def switched_once(answers: list[Answer], promote_sent: float, promoted: float) -> None:
    """Every frame answered 200: by version 1 up to the promotion, by version 2 from it on."""
    failed = [a for a in answers if a.status != 200]
    assert not failed, failed[:3]
    assert all(a.version == "1" for a in answers if a.answered < promote_sent)
    assert all(a.version == "2" for a in answers if a.sent > promoted)
    versions = [a.version for a in answers]
    first = versions.index("2")
    assert set(versions[:first]) == {"1"} and set(versions[first:]) == {"2"}
