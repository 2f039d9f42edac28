"""The closed loop on one box, measured (issue 51): the time from labels submitted to a promoted
version, and what the loop's training costs the live answers.

    python -m visionserve_tools.benchloop --device cuda --out loop.json [--log-dir DIR]
    python -m visionserve_tools.benchloop --device cpu --quick --out loop.json   # dry run
    python -m visionserve_tools.benchloop --model defect-detector --out loop-det.json

1. Starts ``visionserve serve --guard --records --capture learn --model-control-mode explicit``
   (a plant's capture: NG, uncertain and 1 % of OK frames kept; the others stay among the
   recent frames in memory, ``--capture-recent``, for a flag) with the shipped classifier, or
   with ``--model defect-detector`` the shipped detector (cuda: its ``model.pt2`` on the torch
   backend, and ``--gpu-memory-budget``) and measures its
   saturation (closed loop, JPEGs of 640x480, :data:`LOAD_MIX`: a line's parts, one in ten
   with a defect). Each model's frames and request are its :data:`PROFILES` entry: a
   detector's flagged frames are labelled with their boxes.
2. Sends the new look of a scratch (:data:`NEW_LOOK`, which the shipped model passes) and good
   parts, the profile's ``flagged`` of each, and labels them through the API ("scratch" with
   "this OK was wrong" where the line passed it, "ok"; a detector's: the scratch's box, none):
   the frames not captured are captured by their flag or label, from the recent frames.
3. Starts the open-loop paced load at ``--load-fraction`` of saturation
   (:class:`.benchguard.PacedLoad`; its deadline: ``--deadline-ms``, by default the model's takt
   on cuda and 1000 ms on the CPU) and measures ``--baseline-s`` of it alone.
4. Runs the loop's steps beside that load, each through the API as a user would: the candidate
   (the profile's ``train``: the loop's fine-tune, a guard job on the server's device), the
   comparison on the held-out labelled frames, ``--shadow-s`` of shadow on live frames, the
   promotion. Each step's wall time, and the load's latency in each step's window (phase
   ``train``: from the request to the candidate's state ``done``).
5. Stops the load and sends the fixed-seed held-out sets (``held``: the new look, good parts)
   before and after the promotion: the new look's recall, the good parts' false-reject rate.

The JSON (``--out``) has the saturation, the load's rate, per phase its latency percentiles
(:func:`.benchguard.phase_stats`), the p99 ratio of ``train`` over ``baseline`` against
``P99_RATIO_LIMIT`` (1.5), each step's seconds and ``labels_to_promoted_s`` (from the candidate's
request to the promotion's answer, the shadow's fixed window included), and the recall and
false-reject rates. Exit 0: completed (see ``pass``); 1: aborted; 2: bad arguments.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import synthetic

MODEL, DETECTOR = "defect-classifier", "defect-detector"
#: the new look of a scratch: 3-5 % of the short side wide (the shipped model knows 0.4-0.9 %),
#: and a quarter to 40 % as far from the surface's tone as the scratches it knows
NEW_LOOK = synthetic.SurfaceParams(scratch_width=(0.03, 0.05), scratch_contrast=(0.25, 0.4))
#: frames flagged on the line and labelled: the new look ("scratch"), good parts ("ok"); one
#: labelled record in five is held out of training for the comparison
FLAGGED = (500, 1250)
#: the candidate's request: the loop's fine-tune (every layer, lr 0.001, half original data),
#: with steps for that many labelled frames
TRAIN = {"steps": 800}
#: the fixed-seed held-out sets: the new look, good parts
HELD = (500, 1000)


@dataclass(frozen=True)
class Profile:
    """One model's loop: the frames flagged (the new look, good parts), the candidate's request,
    the held-out sets; ``boxes``: a detector's, whose frames are labelled with boxes (the new
    look's scratch, none on a good part) instead of a label."""

    flagged: tuple[int, int]
    train: dict[str, Any]
    held: tuple[int, int]
    boxes: bool = False


PROFILES = {MODEL: Profile(FLAGGED, TRAIN, HELD),
            DETECTOR: Profile((250, 375), {"steps": 400}, HELD, boxes=True)}
#: the paced load's frames: good parts and, one in ten, a part with a defect of each kind
LOAD_MIX = ("ok",) * 36 + tuple(synthetic.LABELS[1:])
#: the first seed of each set of frames
SEEDS = {"flagged_new": 3_000_000, "flagged_good": 4_000_000, "held_new": 1_000_000,
         "held_good": 2_000_000}
P99_RATIO_LIMIT = 1.5


def log(msg: str) -> None:  # CLI progress output
    print(f"[benchloop {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def jpeg(item: tuple[str, int, synthetic.SurfaceParams, tuple[int, int]]) -> bytes:
    """One JPEG of the generator: (label, seed, look, size)."""
    label, seed, params, size = item
    return synthetic.encode(synthetic.generate(label, seed, size, params))


def jpegs(pool: ProcessPoolExecutor, label: str, first_seed: int, n: int,
          params: synthetic.SurfaceParams = synthetic.TRAIN_PARAMS,
          size: tuple[int, int] = (640, 480)) -> list[bytes]:
    """``n`` JPEGs of ``label`` with seeds from ``first_seed``, made in ``pool``."""
    return list(pool.map(jpeg, [(label, first_seed + i, params, size) for i in range(n)],
                         chunksize=16))


def boxed(item: tuple[str, int, synthetic.SurfaceParams, tuple[int, int]]
          ) -> tuple[bytes, list[dict[str, Any]]]:
    """One JPEG of the generator with the boxes of its defect, as a detector's label gives
    them: (label, seed, look, size)."""
    label, seed, params, size = item
    img, defects = synthetic.generate_annotated(label, seed, size, params)
    return synthetic.encode(img), [{"label": d.label, "box": [round(float(v), 1) for v in d.box]}
                                   for d in defects]


def boxed_jpegs(pool: ProcessPoolExecutor, label: str, first_seed: int, n: int,
                params: synthetic.SurfaceParams = synthetic.TRAIN_PARAMS,
                size: tuple[int, int] = (640, 480)) -> list[tuple[bytes, list[dict[str, Any]]]]:
    """``n`` JPEGs of ``label`` with their boxes (:func:`boxed`), seeds from ``first_seed``."""
    return list(pool.map(boxed, [(label, first_seed + i, params, size) for i in range(n)],
                         chunksize=16))


class Steps:
    """The loop's steps for one model over HTTP, as a user takes them: ``client`` is an
    ``httpx.Client`` on the server's URL that may label and train (a quality user's session with
    its CSRF token, or the admin token)."""

    def __init__(self, client: Any, model: str) -> None:
        self.client, self.model = client, model
        self.base = f"/v1/models/{model}/candidates"

    def ok(self, r: Any, status: int = 200) -> dict:
        if r.status_code != status:
            raise AssertionError(f"{r.request.method} {r.request.url.path}: {r.status_code} "
                                 f"{r.text[:500]}")
        return r.json()

    def records(self, *prefixes: str, count: int | None = None, timeout: float = 60,
                captured: bool = True) -> dict[str, dict]:
        """The model's records of parts ``<prefix>-*`` (``captured``: only those with an image),
        by part id (every page); with ``count``, once that many are there (the records are
        written apart from the answers)."""
        deadline = time.monotonic() + timeout
        while True:
            out: dict[str, dict] = {}
            before = None
            while True:
                params = {"limit": 500, "model": self.model,
                          **({"captured": "true"} if captured else {}),
                          **({"before": before} if before else {})}
                page = self.ok(self.client.get("/v1/records", params=params))
                out.update({r["part_id"]: r for r in page["records"]
                            if (r["part_id"] or "").split("-")[0] in prefixes})
                before = page["next"]
                if before is None:
                    break
            if count is None or len(out) >= count:
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(out)} of {count} records of parts {prefixes} after "
                                     f"{timeout} s")
            time.sleep(0.2)

    def flag(self, record_id: int, label: str | list[dict[str, Any]],
             verdict_was_wrong: bool) -> None:
        """An operator's flag: the frame's label (a detector's: its boxes), and whether the
        line's verdict was wrong."""
        self.ok(self.client.post(f"/v1/records/{record_id}/flag", json={
            "verdict_was_wrong": verdict_was_wrong, **self.body(label)}))

    def label(self, record_id: int, label: str | list[dict[str, Any]]) -> None:
        """A label from the review queue (a detector's: the frame's boxes)."""
        self.ok(self.client.put(f"/v1/records/{record_id}/label", json=self.body(label)))

    @staticmethod
    def body(label: str | list[dict[str, Any]]) -> dict[str, Any]:
        return {"boxes": label} if isinstance(label, list) else {"label": label}

    def settled(self, path: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            body = self.ok(self.client.get(path))
            if body["state"] in ("done", "failed"):
                if body["state"] == "failed":
                    raise AssertionError(f"{path} failed: {json.dumps(body)[:2000]}")
                return body
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {path} to finish")

    def train(self, body: dict, timeout: float = 1200) -> tuple[str, dict]:
        """A candidate trained on the labelled captures: its id and its description."""
        cid = self.ok(self.client.post(self.base, json=body), 202)["id"]
        return cid, self.settled(f"{self.base}/{cid}", timeout)

    def request(self, body: dict) -> str:
        """A candidate requested, not waited for: its id."""
        return self.ok(self.client.post(self.base, json=body), 202)["id"]

    def trained(self, cid: str, timeout: float = 1200) -> dict:
        return self.settled(f"{self.base}/{cid}", timeout)

    def compare(self, cid: str, timeout: float = 300) -> dict:
        """The candidate compared with the live version on the held-out labelled frames."""
        self.ok(self.client.post(f"{self.base}/{cid}/evaluate"), 202)
        return self.settled(f"{self.base}/{cid}/comparison", timeout)

    def shadow(self, cid: str, while_running: Callable[[], Any], frames: int | None = None,
               timeout: float = 120) -> dict:
        """The candidate in shadow while ``while_running()`` runs (it sends live frames),
        until it judged ``frames`` (by default every frame handed to it by the end of
        ``while_running``); its report."""
        path = f"{self.base}/{cid}/shadow"
        self.ok(self.client.post(path, json={"minutes": 60}))
        try:
            while_running()
            if frames is None:
                frames = self.ok(self.client.get(path))["handed"]
            deadline = time.monotonic() + timeout
            while (judged := self.ok(self.client.get(path))["judged"]) < frames:
                if time.monotonic() > deadline:
                    raise AssertionError(f"the shadow judged {judged} frames of {frames} in "
                                         f"{timeout} s")
                time.sleep(0.1)
        finally:
            self.ok(self.client.delete(path))
        return self.ok(self.client.get(path))

    def promote(self, cid: str) -> dict:
        return self.ok(self.client.post(f"{self.base}/{cid}/promote"))


def ng_share(verdicts: list[str]) -> float:
    return round(sum(v == "NG" for v in verdicts) / len(verdicts), 4) if verdicts else 0.0


def inspect_all(client: Any, model: str, bodies: list[bytes], prefix: str,
                workers: int = 4) -> list[dict]:
    """Each of ``bodies`` inspected as part ``<prefix>-<i>`` by ``workers`` threads; the
    answers in order (200 asserted)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> dict:
        r = client.post(f"/v1/models/{model}/inspect", content=bodies[i],
                        headers={"Content-Type": "image/jpeg", "X-Part-Id": f"{prefix}-{i}",
                                 "X-Deadline-Ms": "30000"})
        if r.status_code != 200:
            raise AssertionError(f"{prefix}-{i}: {r.status_code} {r.text[:300]}")
        return r.json()
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(bodies))))


def repo_for(root: Path, device: str, model: str = MODEL) -> Path:
    """A repository with the shipped ``model``; on a GPU its model.pt2 on the torch backend
    (the device's onnxruntime may have no CUDA provider)."""
    here = Path(__file__).resolve().parents[1] / "models" / model
    shutil.copytree(here, root / model)
    if device.startswith("cuda"):
        toml = root / model / "model.toml"
        toml.write_text(toml.read_text().replace('backend = "onnxruntime"', 'backend = "torch"'))
    for path in [root, *root.rglob("*")]:  # the server refuses a repository others can write
        path.chmod(path.stat().st_mode & 0o755)
    return root


def run(args: argparse.Namespace, res: dict, save: Callable[[], None]) -> None:
    import httpx

    from .benchgpu import Server, saturation
    from .benchguard import PacedLoad, paced_deadline_ms, phase_stats

    token = "benchloop-admin-token-0123456789"
    work = Path(tempfile.mkdtemp(prefix="benchloop-"))
    log_dir = args.log_dir or work
    log_dir.mkdir(parents=True, exist_ok=True)
    model, profile = args.model, PROFILES[args.model]
    flagged, held = ((40, 40), (100, 200)) if args.quick else (profile.flagged, profile.held)
    log("making the frames")
    with ProcessPoolExecutor(args.gen_workers) as pool:
        load_jpegs = [jpeg((label, 9000 + i, synthetic.TRAIN_PARAMS, (640, 480)))
                      for i, label in enumerate(LOAD_MIX)]
        boxed = boxed_jpegs(pool, "scratch", SEEDS["flagged_new"], flagged[0], NEW_LOOK)
        new = [body for body, _ in boxed]
        good = jpegs(pool, "ok", SEEDS["flagged_good"], flagged[1])
        held_new = jpegs(pool, "scratch", SEEDS["held_new"], held[0], NEW_LOOK)
        held_good = jpegs(pool, "ok", SEEDS["held_good"], held[1])
    res["frames"] = {"flagged_new": flagged[0], "flagged_good": flagged[1],
                     "held_new": held[0], "held_good": held[1], "size": "640x480"}
    server = Server(repo_for(work / "repo", args.device, model), log_dir / "benchloop-server.log",
                    "--admin-token", token, "--records", "--records-dir", str(work / "data"),
                    "--capture", "learn",
                    "--model-control-mode", "explicit",
                    "--guard", "--guard-db", str(work / "guard.sqlite"),
                    *(("--gpu-memory-budget", args.gpu_memory_budget)
                      if args.device.startswith("cuda") else ()), device=args.device)
    client = httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {token}"})
    load = None
    try:
        steps = Steps(client, model)
        log("saturation")
        sat = saturation(server, model, load_jpegs, args.processes, args.threads,
                         args.saturation_s, None)
        res["saturation"] = sat
        rate = round(sat["throughput_per_s"] * args.load_fraction, 1)
        res["load"] = {"fraction": args.load_fraction, "rate_per_s": rate}
        log(f"saturation {sat['throughput_per_s']}/s; the load: {rate}/s")

        log("the new look on the line, flagged and labelled")
        first = inspect_all(client, model, new, "N") + inspect_all(client, model, good, "G")
        res["flagged_escaped"] = 1 - ng_share([a["verdict"] for a in first[:flagged[0]]])
        recs = steps.records("N", "G", count=sum(flagged), captured=False)
        for part, rec in recs.items():
            if part.startswith("N-"):  # "this OK was wrong: a scratch (here)"
                steps.flag(rec["id"], boxed[int(part[2:])][1] if profile.boxes else "scratch",
                           rec["verdict"] == "OK")
            else:
                steps.label(rec["id"], [] if profile.boxes else "ok")
        res["labelled"] = len(recs)
        # of them, captured by their flag or label from the recent frames in memory
        res["captured_by_label"] = sum(r["image"] is None for r in recs.values())
        before = {"recall": ng_share([a["verdict"] for a in inspect_all(
                      client, model, held_new, "HN")]),
                  "false_reject_rate": ng_share([a["verdict"] for a in inspect_all(
                      client, model, held_good, "HG")])}
        res["before"] = before
        save()

        deadline_ms = paced_deadline_ms(args.deadline_ms, args.device.startswith("cuda"))
        res["load"]["deadline_ms"] = deadline_ms
        load = PacedLoad(server.port, model, load_jpegs, rate, args.processes, args.threads,
                         deadline_ms, args.max_s)
        marks: dict[str, float] = {"baseline": time.monotonic()}
        time.sleep(args.baseline_s)
        marks["train"] = time.monotonic()
        log("training the candidate beside the load")
        cid = steps.request(profile.train if args.steps is None else {"steps": args.steps})
        requested = time.monotonic()  # the labelled frames exported, the job queued
        trained = steps.trained(cid)
        marks["compare"] = time.monotonic()
        log("comparing")
        compared = steps.compare(cid)
        marks["shadow"] = time.monotonic()
        log("shadow")
        shadow = steps.shadow(cid, lambda: time.sleep(args.shadow_s))
        marks["promote"] = time.monotonic()
        log("promoting")
        promoted = steps.promote(cid)
        marks["after"] = time.monotonic()
        time.sleep(min(5.0, args.baseline_s))
        marks["end"] = time.monotonic()
        records = load.stop()
        load = None
        names = list(marks)
        res["phases"] = {name: phase_stats(records, marks[name], marks[names[i + 1]])
                         for i, name in enumerate(names[:-1])}
        res["steps_s"] = {name: round(marks[names[i + 1]] - marks[name], 1)
                          for i, name in enumerate(names[1:-2], start=1)}
        res["labels_to_promoted_s"] = round(marks["after"] - marks["train"], 1)
        # the training phase in its parts (the request exports the labelled frames in the
        # serving process; then the guard job) and in windows of 5 s
        res["train_parts"] = {"request": phase_stats(records, marks["train"], requested),
                              "job": phase_stats(records, requested, marks["compare"])}
        edges = [marks["train"] + 5.0 * i
                 for i in range(int((marks["compare"] - marks["train"]) // 5.0) + 1)]
        res["train_windows"] = [{k: w.get(k) for k in ("count", "errors", "p99_ms")}
                                for w in (phase_stats(records, a, b)
                                          for a, b in itertools.pairwise(edges))]
        job_id = trained.get("candidate", {}).get("job", {}).get("id")
        if job_id is not None:
            job_info = steps.ok(client.get(f"/v1/guard/jobs/{job_id}"))
            res["guard_job"] = {k: job_info.get(k) for k in ("mechanism", "state", "sharing",
                                                               "gpu_mem", "policy")}
        job = trained.get("candidate", {}).get("metrics") or {}
        res["training"] = {k: job.get(k) for k in ("device", "seconds", "steps")}
        res["comparison"] = compared["summary"] | {"disagree": len(compared["summary"]
                                                                   ["disagree"])}
        res["shadow"] = {k: shadow.get(k) for k in ("handed", "dropped", "judged", "agree",
                                                    "disagree", "live_ng", "candidate_ng")}
        res["promoted"] = {"version": promoted["version"], "approved_by": promoted["approved_by"]}
        base_p99, train_p99 = (res["phases"][p].get("p99_ms") for p in ("baseline", "train"))
        res["p99_ratio_train"] = round(train_p99 / base_p99, 3) if base_p99 and train_p99 \
            else None
        res["after"] = {"recall": ng_share([a["verdict"] for a in inspect_all(
                            client, model, held_new, "AN")]),
                        "false_reject_rate": ng_share([a["verdict"] for a in inspect_all(
                            client, model, held_good, "AG")])}
        errors = sum(p["errors"] for p in res["phases"].values())
        res["conditions"] = {
            "no_errors": errors == 0,
            "p99_train_within_limit": res["p99_ratio_train"] is not None
            and res["p99_ratio_train"] <= P99_RATIO_LIMIT,
            "recall_at_least_0.9": res["after"]["recall"] >= 0.9,
            "false_rejects_up_at_most_1_point":
                res["after"]["false_reject_rate"] - before["false_reject_rate"] <= 0.01}
        res["pass"] = all(res["conditions"].values())
    finally:
        if load is not None:
            load.stop()
        client.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 epilog="See the module's docstring for the phases.")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default=MODEL, choices=sorted(PROFILES),
                    help="the shipped model whose loop runs (:data:`PROFILES`)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--log-dir", type=Path, help="the server's log (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="fewer frames: a dry run")
    ap.add_argument("--steps", type=int, help="the fine-tune's steps (default: the loop's)")
    ap.add_argument("--load-fraction", type=float, default=0.5)
    ap.add_argument("--baseline-s", type=float, default=20.0)
    ap.add_argument("--shadow-s", type=float, default=10.0)
    ap.add_argument("--saturation-s", type=float, default=8.0)
    ap.add_argument("--processes", type=int, default=4, help="client processes")
    ap.add_argument("--threads", type=int, default=8, help="senders per client process")
    ap.add_argument("--gen-workers", type=int, default=4, help="processes making the frames")
    ap.add_argument("--gpu-memory-budget", default="4GiB", help="the server's, on a GPU")
    ap.add_argument("--deadline-ms", type=float, default=None,
                    help="X-Deadline-Ms of the paced load (default: the model's takt on cuda, "
                         "1000 on cpu)")
    ap.add_argument("--max-s", type=float, default=1800.0, help="the paced load's longest run")
    args = ap.parse_args(argv)
    if not 0 < args.load_fraction < 1 or args.baseline_s <= 0 or args.shadow_s < 0:
        print("error: --load-fraction from 0 to 1, --baseline-s above 0, --shadow-s 0 or more",
              file=sys.stderr)
        return 2
    res: dict[str, Any] = {"tool": "benchloop", "device": args.device, "model": args.model,
                           "date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:]}

    def save() -> None:
        args.out.write_text(json.dumps(res, indent=1))
    try:
        run(args, res, save)
    except Exception as exc:  # noqa: BLE001 -- a benchmark reports what stopped it
        res["error"] = f"{type(exc).__name__}: {exc}"
        save()
        log(f"aborted: {res['error']}")
        return 1
    save()
    log(json.dumps({k: res.get(k) for k in ("p99_ratio_train", "labels_to_promoted_s",
                                              "before", "after", "pass")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
