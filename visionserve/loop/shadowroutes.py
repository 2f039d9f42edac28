"""A candidate's shadow over HTTP (docs/closed-loop.md, "Shadow"), quality work as the other
candidates' routes (role quality or admin, or the admin token):

  POST   /v1/models/{m}/candidates/{cid}/shadow   start it: {"frames": 1000, "minutes": 60}
                                                  (each optional; 60 minutes by default)
  DELETE /v1/models/{m}/candidates/{cid}/shadow   stop it
  GET    /v1/models/{m}/candidates/{cid}/shadow   its latest run: agreement with the live
                                                  version on live frames, disagreements,
                                                  frames dropped for load

Starting and stopping are audit entries. Refusals: 409 for a candidate not trained, a model
that runs another shadow, a server whose front ends run in processes of their own, a shadow
not running (DELETE); 404 for an unknown model or candidate, or a GET before any run; 400 for
a body not understood.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from ..audit import Entry
from ..errors import Conflict, VisionServeError
from ..guard.store import JobStore
from ..http.common import audit_of, caller_of, engine_of, error_response, read_json_object
from ..records.store import RecordStore
from ..repository import ModelEntry
from . import candidates as cands
from .shadow import Shadows, parse_request, report

MAX_BODY = 4096


class Loop(Protocol):
    """What the shadow's routes need of the candidates' routes (``.http.Loop``)."""

    store: RecordStore
    jobs: JobStore | None

    def entry(self, request: Request, model: str) -> ModelEntry: ...


def add_routes(router: APIRouter, loop: Loop, shadows: Shadows) -> None:
    """The shadow's routes on ``router``, running the process's ``shadows``."""
    path = "/v1/models/{model}/candidates/{cid}/shadow"

    def trained(entry, cid: str):
        folder = cands.Area(entry.path).folder(cid)
        state = cands.describe(folder, loop.jobs)["state"]
        if state != "done":
            raise Conflict(f"candidate {cid} is {state}: only a trained candidate runs in shadow")
        return folder

    @router.post(path, summary="Run a candidate in shadow beside the live version on live "
                 "frames (lowest priority, verdicts recorded, never sent to the PLC)")
    async def start(request: Request, model: str, cid: str) -> JSONResponse:
        try:
            body = await read_json_object(request, MAX_BODY, ' such as {"minutes": 60}',
                                          empty={})
            req = parse_request(body)
            caller = caller_of(request)
            by = str(caller.get("operator") or "?")
            entry = loop.entry(request, model)
            folder = await run_in_threadpool(trained, entry, cid)
            shown = await shadows.start(engine_of(request), model, entry.config,
                                        entry.default_version, cid, folder,
                                        entry.path / "model.toml", req, by)
        except VisionServeError as exc:
            return error_response(exc, {"model": model, "candidate": cid})
        await audit_of(request).arecord(
            Entry("candidate-shadow", "model", model, None,
                  {"candidate": cid, "run": shown["run"], "frames": req.frames,
                   "minutes": req.minutes}, caller),
            "closed loop: candidate %s of model %s in shadow (run %d), started by %s", cid,
            model, shown["run"], by)
        return JSONResponse(shown)

    @router.delete(path, summary="Stop a candidate's shadow")
    async def stop(request: Request, model: str, cid: str) -> JSONResponse:
        try:
            caller = caller_of(request)
            by = str(caller.get("operator") or "?")
            entry = loop.entry(request, model)
            cands.Area(entry.path).folder(cid)  # 404 for an unknown candidate
            shown = await shadows.stop(model, cid, f"stopped by {by}")
        except VisionServeError as exc:
            return error_response(exc, {"model": model, "candidate": cid})
        await audit_of(request).arecord(
            Entry("candidate-shadow-stop", "model", model, None,
                  {"candidate": cid, "run": shown["run"], "handed": shown["handed"],
                   "dropped": shown["dropped"]}, caller),
            "closed loop: shadow of candidate %s of model %s stopped by %s", cid, model, by)
        return JSONResponse(shown)

    @router.get(path, summary="A candidate's shadow: agreement with the live version on live "
                "frames, where they disagree, frames dropped for load")
    async def shown(request: Request, model: str, cid: str) -> JSONResponse:
        try:
            entry = loop.entry(request, model)
            folder = cands.Area(entry.path).folder(cid)
            return JSONResponse(await run_in_threadpool(
                report, folder, cid, model, shadows.live(model, cid), loop.store))
        except VisionServeError as exc:
            return error_response(exc, {"model": model, "candidate": cid})
