"""The candidates of a model over HTTP (docs/closed-loop.md), quality work (role quality or
admin, or the admin token):

  POST /v1/models/{m}/candidates                     train one: {"from_version": 1, "steps": 40,
                                                     "original_share": 0.5} (each optional)
  GET  /v1/models/{m}/candidates                     every candidate: state, progress
  GET  /v1/models/{m}/candidates/{cid}               one, with candidate.json once done
  POST /v1/models/{m}/candidates/{cid}/evaluate      compare it with the live version on the
                                                     held-out labelled frames (a guard job)
  GET  /v1/models/{m}/candidates/{cid}/comparison    that comparison, per record and summed up

Creating one exports the model's labelled captures into the candidate's folder
(:mod:`.candidates`) and submits the fine-tune to the guard's queue (its Python API, the same
SQLite queue ``/v1/guard/jobs`` lists); both POSTs are audit entries. Refusals: 409 without the
guard (``--guard``), without labelled captures, for a model this server cannot train; 404 for an
unknown model, version or candidate; 400 for a body that is not understood.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from ..audit import Entry
from ..errors import Conflict, InvalidInput, NotFound, VisionServeError
from ..guard.store import JobSpec, JobStore
from ..http.common import audit_of, caller_of, engine_of, error_response, read_json_object
from ..records.images import ImageSource
from ..records.record import iso
from ..records.store import RecordStore
from ..repository import ModelEntry, parse_version
from ..tasks.classification import ClassificationConfig
from . import candidates as cands

MAX_BODY = 4096
#: a fine-tune's optimizer steps: the default, the most one request may ask
DEFAULT_STEPS, MAX_STEPS = 40, 2000
#: the share of the training set that is the model's original (synthetic) data, by default
DEFAULT_SHARE = 0.5
#: GPU memory a training job declares to the guard where the guard has a GPU
TRAIN_GPU_MEM = 2 << 30
TRAINABLE = ("the project's classifier (a classification model whose version folder holds the "
             "weights.pt of visionserve_tools.training.train)")


@dataclass(frozen=True)
class TrainRequest:
    from_version: int | None
    steps: int
    original_share: float


def parse_request(body: dict[str, Any]) -> TrainRequest:
    """The POST's body; InvalidInput names what is not understood."""
    unknown = sorted(set(body) - {"from_version", "steps", "original_share"})
    if unknown:
        raise InvalidInput(f"not understood: {', '.join(unknown)} (a candidate's body is "
                           '{"from_version": 1, "steps": 40, "original_share": 0.5}, each '
                           "optional)")
    v, steps, share = body.get("from_version"), body.get("steps", DEFAULT_STEPS), \
        body.get("original_share", DEFAULT_SHARE)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise InvalidInput(f"from_version {v!r}: a version number of the model")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise InvalidInput(f"steps {steps!r}: a whole number from 1 to {MAX_STEPS}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise InvalidInput(f"original_share {share!r}: the share of the training set that is "
                           "the model's original data, from 0 to below 1")
    return TrainRequest(v, steps, float(share))


def train_command(source: Path, data: Path, out: Path, req: TrainRequest,
                  device: str) -> list[str]:
    """The fine-tune: the last layer, from the source version's weights, on the exported frames
    with the synthetic original data mixed in, written exactly into the candidate's folder."""
    return [sys.executable, "-m", "visionserve_tools.training.train", "--data", str(data),
            "--init", str(source / "weights.pt"), "--out", str(out), "--steps", str(req.steps),
            "--freeze-backbone", "--mix-synthetic", str(req.original_share), "--batch-size", "16",
            "--sizes", "640x480", "--workers", "1", "--threads", "1", "--check-per-label", "2",
            "--device", device]


class Loop:
    """The routes' work: the record store and images (the labelled captures) and the guard's
    queue (None: the server runs without --guard)."""

    def __init__(self, store: RecordStore, images: ImageSource, jobs: JobStore | None) -> None:
        self.store, self.images, self.jobs = store, images, jobs

    def entry(self, request: Request, model: str) -> ModelEntry:
        entry = engine_of(request).entries.get(model)
        if entry is None:
            raise NotFound(f"no model {model!r} in the repository")
        return entry

    def guard(self) -> JobStore:
        if self.jobs is None:
            raise Conflict("a candidate is trained and evaluated as a guard job: start the "
                           "server with --guard (docs/guard.md)")
        return self.jobs

    def create(self, entry: ModelEntry, req: TrainRequest, by: str) -> dict[str, Any]:
        """(a worker thread) export, submit, write job.json; the candidate as described."""
        jobs = self.guard()
        if not isinstance(entry.config, ClassificationConfig):
            raise Conflict(f"model {entry.name!r} (task {entry.config.task!r}) cannot be "
                           f"trained here: candidates are trained for {TRAINABLE}")
        version = parse_version(entry, req.from_version)
        source = entry.versions[version].parent
        if not (source / "weights.pt").is_file():
            raise Conflict(f"model {entry.name!r} version {version} has no weights.pt to "
                           f"fine-tune from: candidates are trained for {TRAINABLE}")
        cid, folder = cands.Area(entry.path).create()
        try:
            exported = cands.export(self.store, self.images, entry.name,
                                    tuple(entry.config.output.labels), folder)
            if not exported.training:
                raise Conflict(f"model {entry.name!r} has no labelled captures to train on "
                               f"({len(exported.held_out)} held out for the comparison): label "
                               "captured frames first (GET /v1/review, PUT "
                               "/v1/records/{id}/label)")
            device = "cuda" if (jobs.supervisor() or {}).get("device") else "cpu"
            command = train_command(source, folder / "train", folder, req, device)
            job = jobs.submit(JobSpec(command=command, name=f"candidate {entry.name} {cid}",
                                      cwd=os.getcwd(),
                                      gpu_mem=TRAIN_GPU_MEM if device == "cuda" else 0))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        now = time.time()
        cands.write_json(folder / "job.json", {
            "id": cid, "model": entry.name, "from_version": version,
            "job": {"id": job.id, "command": command},
            "trained_on": cands.labelled_dicts(exported.training),
            "held_out": cands.labelled_dicts(exported.held_out),
            "recipe": {"labelled_frames": len(exported.training),
                       "original_data": "synthetic (visionserve_tools.synthetic, training "
                                        "parameters)",
                       "original_share": req.original_share, "steps": req.steps,
                       "trains": "the last layer (--freeze-backbone)",
                       "held_out": f"every {cands.HOLDOUT_EVERY}th labelled record by a stable "
                                   "hash of its id"},
            "created_by": by, "created": iso(now), "created_at": now})
        return cands.describe(folder, jobs)

    def candidates(self, entry: ModelEntry) -> list[dict[str, Any]]:
        return [cands.describe(folder, self.jobs) for folder in cands.Area(entry.path).started()]

    def candidate(self, entry: ModelEntry, cid: str) -> dict[str, Any]:
        return cands.describe(cands.Area(entry.path).folder(cid), self.jobs)

    def evaluate(self, entry: ModelEntry, cid: str, by: str) -> dict[str, Any]:
        """(a worker thread) submit the comparison of the candidate with the live version."""
        jobs = self.guard()
        folder = cands.Area(entry.path).folder(cid)
        shown = cands.describe(folder, jobs)
        if shown["state"] != "done":
            raise Conflict(f"candidate {cid} is {shown['state']}: only a trained candidate is "
                           "compared")
        if not shown["candidate"]["held_out"]:
            raise Conflict(f"candidate {cid} has no held-out labelled frames to compare on: "
                           "label more captures and train another")
        previous = cands.read_json(folder / "evaluation.json")
        if previous is not None and cands.job_state(jobs, previous["job"]["id"])[0] in (
                "queued", "running"):
            raise Conflict(f"candidate {cid} is being compared already (guard job "
                           f"{previous['job']['id']})")
        live = entry.default_version
        out = folder / "comparison.json"
        command = [sys.executable, "-m", "visionserve.loop.evaluate", "--model-toml",
                   str(entry.path / "model.toml"), "--live", str(entry.versions[live].parent),
                   "--candidate", str(folder), "--out", str(out)]
        out.unlink(missing_ok=True)
        job = jobs.submit(JobSpec(command=command, name=f"compare {entry.name} {cid}",
                                  cwd=os.getcwd()))
        now = time.time()
        evaluation = {"job": {"id": job.id, "command": command}, "live_version": live,
                      "requested_by": by, "requested": iso(now), "requested_at": now}
        cands.write_json(folder / "evaluation.json", evaluation)
        return {"id": cid, "state": "queued", "evaluation": evaluation}

    def comparison(self, entry: ModelEntry, cid: str) -> dict[str, Any]:
        folder = cands.Area(entry.path).folder(cid)
        evaluation = cands.read_json(folder / "evaluation.json")
        if evaluation is None:
            raise NotFound(f"candidate {cid} has not been compared yet: POST "
                           f"/v1/models/{entry.name}/candidates/{cid}/evaluate")
        result = cands.read_json(folder / "comparison.json")
        if result is not None:
            disagree = set(result["summary"]["disagree"])
            return {"id": cid, "state": "done", "evaluation": evaluation, **result,
                    "disagreements": [r for r in result["records"] if r["record_id"] in disagree]}
        state, job, reason = cands.job_state(self.jobs, evaluation["job"]["id"])
        if state == "done":
            state, reason = "failed", "the comparison job ended without writing its result"
        return {"id": cid, "state": state, "evaluation": evaluation,
                "progress": cands.progress(job), **({"reason": reason} if reason else {})}


def make_router(store: RecordStore, images: ImageSource, jobs: JobStore | None) -> APIRouter:
    router = APIRouter(tags=["Closed loop"])
    loop = Loop(store, images, jobs)

    async def call(request: Request, model: str, work, *args) -> Any:
        return await run_in_threadpool(work, loop.entry(request, model), *args)

    @router.post("/v1/models/{model}/candidates", summary="Train a candidate on the labelled "
                 "captures (a guard job); it is never served")
    async def create(request: Request, model: str) -> JSONResponse:
        try:
            body = await read_json_object(request, MAX_BODY, ' such as {"steps": 40}', empty={})
            req = parse_request(body)
            caller = caller_of(request)
            by = str(caller.get("operator") or "?")
            shown = await call(request, model, loop.create, req, by)
        except VisionServeError as exc:
            return error_response(exc, {"model": model})
        entry = Entry("candidate", "model", model, None,
                      {"candidate": shown["id"], "job": shown["job"]["id"],
                       "from_version": shown["from_version"], "steps": req.steps,
                       "original_share": req.original_share}, caller)
        await audit_of(request).arecord(
            entry, "closed loop: candidate %s of model %s (from version %s, guard job %d) "
            "requested by %s", shown["id"], model, shown["from_version"], shown["job"]["id"],
            by)
        return JSONResponse(shown, status_code=202)

    @router.get("/v1/models/{model}/candidates", summary="A model's candidates and their state")
    async def listing(request: Request, model: str) -> JSONResponse:
        try:
            rows = await call(request, model, loop.candidates)
        except VisionServeError as exc:
            return error_response(exc, {"model": model})
        return JSONResponse({"model": model, "count": len(rows), "candidates": rows})

    @router.get("/v1/models/{model}/candidates/{cid}", summary="One candidate")
    async def one(request: Request, model: str, cid: str) -> JSONResponse:
        try:
            return JSONResponse(await call(request, model, loop.candidate, cid))
        except VisionServeError as exc:
            return error_response(exc, {"model": model, "candidate": cid})

    @router.post("/v1/models/{model}/candidates/{cid}/evaluate", summary="Compare a candidate "
                 "with the live version on the held-out labelled frames (a guard job)")
    async def evaluate(request: Request, model: str, cid: str) -> JSONResponse:
        try:
            await read_json_object(request, MAX_BODY, " (none needed)", empty={})
            caller = caller_of(request)
            by = str(caller.get("operator") or "?")
            shown = await call(request, model, loop.evaluate, cid, by)
        except VisionServeError as exc:
            return error_response(exc, {"model": model, "candidate": cid})
        evaluation = shown["evaluation"]
        entry = Entry("candidate-evaluate", "model", model, None,
                      {"candidate": cid, "job": evaluation["job"]["id"],
                       "live_version": evaluation["live_version"]}, caller)
        await audit_of(request).arecord(
            entry, "closed loop: candidate %s of model %s compared with version %s (guard job "
            "%d), requested by %s", cid, model, evaluation["live_version"],
            evaluation["job"]["id"], by)
        return JSONResponse(shown, status_code=202)

    @router.get("/v1/models/{model}/candidates/{cid}/comparison", summary="A candidate against "
                "the live version on the held-out labelled frames")
    async def comparison(request: Request, model: str, cid: str) -> JSONResponse:
        try:
            return JSONResponse(await call(request, model, loop.comparison, cid))
        except VisionServeError as exc:
            return error_response(exc, {"model": model, "candidate": cid})

    from .shadowroutes import add_routes as shadow_routes

    shadow_routes(router, loop)
    return router
