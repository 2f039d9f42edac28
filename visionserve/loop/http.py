"""The candidates of a model over HTTP (docs/closed-loop.md), quality work (role quality or
admin, or the admin token):

  POST /v1/models/{m}/candidates                     train one: {"from_version": 1, "steps": 500,
                                                     "original_share": 0.5, "layers": "all",
                                                     "lr": 0.001} (each optional)
  GET  /v1/models/{m}/candidates                     every candidate: state, progress
  GET  /v1/models/{m}/candidates/{cid}               one, with candidate.json once done
  POST /v1/models/{m}/candidates/{cid}/evaluate      compare it with the live version on the
                                                     held-out labelled frames (a guard job)
  GET  /v1/models/{m}/candidates/{cid}/comparison    that comparison, per record and summed up
  POST /v1/models/{m}/candidates/{cid}/promote       serve it as the model's next version
                                                     (:mod:`.promote`); 202 where it waits
                                                     for a second approver
  POST /v1/models/{m}/rollback                       serve again the version before the last
                                                     promotion
  GET  /v1/models/{m}/candidates/{cid}/trace         its trail for an audit (candidates.trace)
  GET  /v1/models/{m}/candidates?record=N            the candidates that used record N

Creating one exports the model's labelled captures into the candidate's folder
(:mod:`.candidates`) and submits its training to the guard's queue (its Python API, the same
SQLite queue ``/v1/guard/jobs`` lists): the project's classifier's or detector's fine-tune, an
anomaly model's refit with its good parts (:mod:`.refit`), or the model's own [training] command
(:mod:`.usercommand`); both POSTs are audit entries. Refusals: 409 without the
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
from ..tasks.anomaly import AnomalyConfig
from ..tasks.classification import ClassificationConfig
from . import candidates as cands
from . import promote as promotion
from . import refit, usercommand
from .plan import Plan
from .shadow import Shadows
from .shadowroutes import add_routes as shadow_routes

MAX_BODY = 4096
#: a fine-tune's optimizer steps: the default, the most one request may ask
DEFAULT_STEPS, MAX_STEPS = 500, 5000
#: the share of the training set that is the model's original (synthetic) data, by default
DEFAULT_SHARE = 0.5
#: which layers a fine-tune trains: every one (the backbone's batch-norm statistics kept), or
#: the last only; the first is the default: the last layer alone does not learn a new look of a
#: defect (docs/closed-loop.md)
LAYERS = ("all", "last")
#: the fine-tune's learning rate: the default, and the range a request may ask
DEFAULT_LR, LR_RANGE = 1e-3, (1e-6, 0.1)
#: the tasks the project's own models are fine-tuned for
FINETUNED = ("classification", "detection")
TRAINABLE = ("the project's classifier and detector (a version folder holding the weights.pt of "
             "visionserve_tools.training.train or .detect, fine-tuned) and anomaly models "
             "(refitted with the good parts)")


@dataclass(frozen=True)
class TrainRequest:
    from_version: int | None
    steps: int = DEFAULT_STEPS
    original_share: float = DEFAULT_SHARE
    layers: str = LAYERS[0]
    lr: float = DEFAULT_LR


def parse_request(body: dict[str, Any]) -> TrainRequest:
    """The POST's body; InvalidInput names what is not understood."""
    unknown = sorted(set(body) - {"from_version", "steps", "original_share", "layers", "lr"})
    if unknown:
        raise InvalidInput(f"not understood: {', '.join(unknown)} (a candidate's body is "
                           '{"from_version": 1, "steps": 500, "original_share": 0.5, '
                           '"layers": "all", "lr": 0.001}, each optional)')
    v, steps, share = body.get("from_version"), body.get("steps", DEFAULT_STEPS), \
        body.get("original_share", DEFAULT_SHARE)
    layers, lr = body.get("layers", LAYERS[0]), body.get("lr", DEFAULT_LR)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise InvalidInput(f"from_version {v!r}: a version number of the model")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise InvalidInput(f"steps {steps!r}: a whole number from 1 to {MAX_STEPS}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise InvalidInput(f"original_share {share!r}: the share of the training set that is "
                           "the model's original data, from 0 to below 1")
    if layers not in LAYERS:
        raise InvalidInput(f"layers {layers!r}: {' or '.join(map(repr, LAYERS))}")
    lo, hi = LR_RANGE
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lo <= lr <= hi:
        raise InvalidInput(f"lr {lr!r}: the fine-tune's learning rate, from {lo:g} to {hi:g}")
    return TrainRequest(v, steps, float(share), layers, float(lr))


def train_command(task: str, source: Path, data: Path, out: Path, req: TrainRequest,
                  device: str) -> list[str]:
    """The project's fine-tune of a classifier or a detector (``task``): the request's layers,
    from the source version's weights, on the exported frames with the synthetic original data
    mixed in, written exactly into the candidate's folder."""
    layers = "--keep-batch-norm" if req.layers == "all" else "--freeze-backbone"
    args = ["--data", str(data), "--init", str(source / "weights.pt"), "--out", str(out),
            "--steps", str(req.steps), layers, "--lr", repr(req.lr), "--mix-synthetic",
            str(req.original_share), "--batch-size", "16", "--workers", "1", "--threads", "1",
            "--device", device]
    if task == "detection":
        return [sys.executable, "-m", "visionserve_tools.training.detect", "finetune", *args]
    return [sys.executable, "-m", "visionserve_tools.training.train", *args, "--sizes",
            "640x480", "--check-per-label", "2"]


def training_way(entry: ModelEntry, source: Path) -> str:
    """How a candidate of the model is trained: ``command`` (its model.toml's [training]
    command), ``refit`` (an anomaly model), ``finetune`` (the project's classifier or detector);
    Conflict for a model with none of them."""
    if entry.config.training.command is not None:
        return "command"
    if isinstance(entry.config, AnomalyConfig):
        refit.check(entry, source)
        return "refit"
    if entry.config.task in FINETUNED:
        if (source / "weights.pt").is_file():
            return "finetune"
        why = f"version {source.name} has no weights.pt to fine-tune from"
    else:
        why = f"it is a {entry.config.task} model"
    raise Conflict(f"model {entry.name!r} cannot be trained here: {why}. Candidates are trained "
                   f"for {TRAINABLE}; for another model, register the command that trains it: "
                   "[training] command in its model.toml (docs/closed-loop.md)")


def nothing_labelled(entry: ModelEntry) -> Conflict:
    return Conflict(f"model {entry.name!r} has no labelled captures to train on: label captured "
                    "frames first (GET /v1/review, PUT /v1/records/{id}/label)")


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
        version = parse_version(entry, req.from_version)
        source = entry.versions[version].parent
        way = training_way(entry, source)
        cid, folder = cands.Area(entry.path).create()
        try:
            device = "cuda" if (jobs.supervisor() or {}).get("device") else "cpu"
            plan = self.plan(way, entry, source, folder, req, device)
            try:
                job = jobs.submit(JobSpec(command=plan.command,
                                          name=f"candidate {entry.name} {cid}", cwd=plan.cwd,
                                          gpu_mem=plan.gpu_mem if device == "cuda" else 0))
            except InvalidInput as exc:
                if plan.kind != "command":
                    raise
                raise Conflict(f"model {entry.name!r}: its model.toml's [training] command "
                               f"cannot run: {exc.message}") from None
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        now = time.time()
        cands.write_json(folder / "job.json", {
            "id": cid, "model": entry.name, "from_version": version,
            "job": {"id": job.id, "command": plan.command}, **plan.job_info(),
            "created_by": by, "created": iso(now), "created_at": now})
        return cands.describe(folder, jobs)

    def plan(self, way: str, entry: ModelEntry, source: Path, folder: Path, req: TrainRequest,
             device: str) -> Plan:
        """Export what the candidate is trained on into ``folder``; the guard job's plan."""
        if way == "refit":
            return refit.plan(self.store, self.images, entry, source, folder, device)
        if way == "command":
            made = usercommand.plan(self.store, self.images, entry, source, folder, device,
                                    req.steps)
            if made is None:
                raise nothing_labelled(entry)
            return made
        detector = entry.config.task == "detection"
        if detector:
            training, held = cands.export_boxes(self.store, self.images, entry.name, folder)
        else:
            assert isinstance(entry.config, ClassificationConfig)
            exported = cands.export(self.store, self.images, entry.name,
                                    tuple(entry.config.output.labels), folder)
            training, held = (cands.labelled_dicts(exported.training),
                              cands.labelled_dicts(exported.held_out))
        if not training:
            raise nothing_labelled(entry)
        original = "synthetic scenes (visionserve_tools.synthetic.generate_scene" if detector \
            else "synthetic (visionserve_tools.synthetic"
        recipe = {"labelled_frames": len(training),
                  "original_data": f"{original}, training parameters)",
                  "original_share": req.original_share, "steps": req.steps, "lr": req.lr,
                  "trains": "every layer, the backbone's batch-norm statistics kept "
                            "(--keep-batch-norm)" if req.layers == "all"
                            else "the layers after the backbone (--freeze-backbone)" if detector
                            else "the last layer (--freeze-backbone)",
                  "held_out": f"every {cands.HOLDOUT_EVERY}th labelled record by a stable hash "
                              "of its id"}
        return Plan("finetune", train_command(entry.config.task, source, folder / "train",
                                              folder, req, device),
                    ["weights.pt"], "metrics.json", training, held, recipe, os.getcwd())

    def candidates(self, entry: ModelEntry, record: int | None = None) -> list[dict[str, Any]]:
        area = cands.Area(entry.path)
        return [promotion.annotate(area, cands.describe(folder, self.jobs))
                for folder in area.started()
                if record is None or record in cands.used(folder)]

    def candidate(self, entry: ModelEntry, cid: str) -> dict[str, Any]:
        area = cands.Area(entry.path)
        return promotion.annotate(area, cands.describe(area.folder(cid), self.jobs))

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
        return cands.comparison(cands.Area(entry.path).folder(cid), self.jobs)

    def trace(self, entry: ModelEntry, cid: str) -> dict[str, Any]:
        """The candidate's trail (:func:`.candidates.trace`), with each of its promotions: who
        approved it, when, as which version, and its rollback."""
        area = cands.Area(entry.path)
        trail = cands.trace(area.folder(cid), self.jobs, self.store)
        return {**promotion.annotate(area, trail),
                "promotions": [p for p in promotion.history(area) if p["candidate"] == cid]}


async def no_body(request: Request) -> None:
    """A promotion's or rollback's body: none, or an empty JSON object (400 otherwise)."""
    body = await read_json_object(request, MAX_BODY, " (none needed)", empty={})
    if body:
        raise InvalidInput(f"not understood: {', '.join(sorted(body))} (this change takes no "
                           "body, or {})")


def make_router(store: RecordStore, images: ImageSource, jobs: JobStore | None,
                shadows: Shadows) -> APIRouter:
    """The loop's routes; ``shadows``: the process's shadows (the console shows them too)."""
    router = APIRouter(tags=["Closed loop"])
    loop = Loop(store, images, jobs)

    async def call(request: Request, model: str, work, *args) -> Any:
        return await run_in_threadpool(work, loop.entry(request, model), *args)

    @router.post("/v1/models/{model}/candidates", summary="Train a candidate on the labelled "
                 "captures (a guard job); it is never served")
    async def create(request: Request, model: str) -> JSONResponse:
        try:
            body = await read_json_object(request, MAX_BODY,  ' such as {"steps": 500}', empty={})
            req = parse_request(body)
            caller = caller_of(request)
            by = str(caller.get("operator") or "?")
            shown = await call(request, model, loop.create, req, by)
        except VisionServeError as exc:
            return error_response(exc, {"model": model})
        entry = Entry("candidate", "model", model, None,
                      {"candidate": shown["id"], "job": shown["job"]["id"],
                       "from_version": shown["from_version"], "steps": req.steps,
                       "original_share": req.original_share, "layers": req.layers,
                       "lr": req.lr}, caller)
        await audit_of(request).arecord(
            entry, "closed loop: candidate %s of model %s (from version %s, guard job %d) "
            "requested by %s", shown["id"], model, shown["from_version"], shown["job"]["id"],
            by)
        return JSONResponse(shown, status_code=202)

    @router.get("/v1/models/{model}/candidates", summary="A model's candidates and their state "
                "(record=N: those that used record N)")
    async def listing(request: Request, model: str, record: str | None = None) -> JSONResponse:
        try:
            rows = await call(request, model, loop.candidates, record_param(record))
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

    @router.post("/v1/models/{model}/candidates/{cid}/promote", summary="Promote a trained "
                 "and compared candidate: served as the model's next version, without a failed "
                 "frame")
    async def promote(request: Request, model: str, cid: str) -> JSONResponse:
        try:
            await no_body(request)
            caller = caller_of(request)
            by = str(caller.get("operator") or "?")
            done = await promotion.promote(engine_of(request), jobs, model, cid, by)
        except VisionServeError as exc:
            return error_response(exc, {"model": model, "candidate": cid})
        if done.get("state") == "awaiting-approval":
            entry = Entry("promote-approval", "model", model, None,
                          {"candidate": cid, "approved_by": by,
                           "approvals": len(done["approvals"]),
                           "approvers": done["approvers"]}, caller)
            await audit_of(request).arecord(
                entry, "closed loop: promotion of candidate %s of model %s approved by %s, "
                "waiting for another approver", cid, model, entry.by())
            return JSONResponse(done, status_code=202)
        entry = Entry("promote", "model", model, {"version": done["from_version"]},
                      {"version": done["version"], "candidate": cid, "approved_by": by,
                       **({"approvers": [a["by"] for a in done["approvals"]]}
                          if "approvals" in done else {})}, caller)
        await audit_of(request).arecord(
            entry, "closed loop: candidate %s of model %s promoted to version %d (from version "
            "%s), approved by %s", cid, model, done["version"], done["from_version"], entry.by())
        return JSONResponse(done)

    @router.post("/v1/models/{model}/rollback", summary="Serve again the version served before "
                 "the last promotion, without a failed frame")
    async def rollback(request: Request, model: str) -> JSONResponse:
        try:
            await no_body(request)
            caller = caller_of(request)
            by = str(caller.get("operator") or "?")
            done = await promotion.rollback(engine_of(request), model, by)
        except VisionServeError as exc:
            return error_response(exc, {"model": model})
        entry = Entry("rollback", "model", model, {"version": done["version"]},
                      {"version": done["from_version"], "candidate": done["candidate"]}, caller)
        await audit_of(request).arecord(
            entry, "closed loop: model %s rolled back from version %d (candidate %s) to version "
            "%s by %s", model, done["version"], done["candidate"], done["from_version"],
            entry.by())
        return JSONResponse(done)

    @router.get("/v1/models/{model}/candidates/{cid}/trace", summary="A candidate's trail for "
                "an audit: from which version, on which labels, by whom, evaluated how")
    async def trace(request: Request, model: str, cid: str) -> JSONResponse:
        try:
            return JSONResponse(await call(request, model, loop.trace, cid))
        except VisionServeError as exc:
            return error_response(exc, {"model": model, "candidate": cid})

    shadow_routes(router, loop, shadows)
    return router


def record_param(value: str | None) -> int | None:
    """``?record=N``: a record's id; InvalidInput for anything else."""
    if value is None:
        return None
    if not value.isdigit() or not 0 < int(value) < 2**63:
        raise InvalidInput(f"record {value!r}: a record's id (a listing's id)")
    return int(value)
