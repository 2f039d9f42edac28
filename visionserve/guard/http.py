"""The guard over HTTP: ``make_router(store, audit)`` for the server app (``serve --guard``); a
job submitted or cancelled is audited (:mod:`visionserve.audit`) under the caller's name.

  GET  /v1/guard/jobs                 list (optional ?state=queued&state=running)
  POST /v1/guard/jobs                 submit (JSON body, see JobRequest)
  GET  /v1/guard/jobs/{id}            one job
  POST /v1/guard/jobs/{id}/cancel     cancel (queued: at once; running: the supervisor stops it)
  GET  /v1/guard/jobs/{id}/logs       the log as text/plain (?tail_bytes=N for the end only)
  GET  /v1/guard/health               200 when the queue is usable and a supervisor heartbeats

Errors are ``{"error": "..."}``: 404 unknown id, 409 cancel of a finished job, 422 a body that is
not a valid job request, 400 a request the queue refuses (command not found, bad cwd ...), 503
with Retry-After while the job database cannot be used (disk full, read-only, I/O error).
Pydantic wire models live here only; the store speaks dataclasses.
"""

from __future__ import annotations

import os
import time
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..audit import AuditTrail, Entry
from ..config import parse_bytes
from ..errors import InvalidInput, NotFound, Unavailable, VisionServeError, describe_validation
from ..http.common import caller_of, error_response, parse_json
from .store import STATES, JobSpec, JobStateError, JobStore, StoreFault

#: the supervisor records a heartbeat every second; older than this, health says it is not working
HEARTBEAT_STALE_S = 10.0


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    command: list[str] = Field(..., min_length=1, description="argv of the job")
    name: str | None = Field(None, max_length=200)
    cwd: str | None = Field(None, description="working directory (default: the server's)")
    env: dict[str, str] = Field(default_factory=dict)
    gpu_mem: int | str = Field(0, description="bytes, or a size string such as 8GiB")
    priority: int = Field(0, ge=-1000, le=1000, description="higher starts first")
    policy: Literal["pause", "stop"] = "pause"

    @field_validator("gpu_mem")
    @classmethod
    def _size(cls, v: int | str) -> int:
        return parse_bytes(v)


class JobResponse(BaseModel):
    id: int
    name: str
    command: list[str]
    cwd: str
    env: dict[str, str]
    gpu_mem: int
    priority: int
    policy: str
    state: str
    reason: str | None
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    pid: int | None
    exit_code: int | None
    log_path: str | None
    cancel_requested: bool
    mechanism: str | None = Field(None, description="how the job shares the GPU: "
                                                    "mps | yield | process")
    sharing: dict | None = Field(None, description="yields, forced passes, waits, pauses, shares")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _validation_message(exc: ValidationError) -> str:
    return "invalid job request: " + "; ".join(describe_validation(exc, empty="body"))


def _job(job) -> dict:
    return JobResponse.model_validate(job.to_dict(), from_attributes=False).model_dump()


def make_router(store: JobStore, audit: AuditTrail) -> APIRouter:
    router = APIRouter(prefix="/v1/guard", tags=["guard"])

    async def call(fn, *args):
        # SQLite calls are short but blocking: keep them off the event loop
        try:
            return await run_in_threadpool(fn, *args)
        except JobStateError as exc:
            raise _Reply(_error(409, exc.message)) from None
        except VisionServeError as exc:  # StoreFault: 503 with Retry-After
            raise _Reply(error_response(exc)) from None

    @router.get("/jobs", response_model=list[JobResponse])
    async def list_jobs(state: list[str] | None = Query(None)):  # noqa: B008 (FastAPI idiom)
        if state and any(s not in STATES for s in state):
            return _error(400, f"unknown state in {state}; states are {', '.join(STATES)}")
        try:
            jobs = await call(store.list, tuple(state) if state else None)
        except _Reply as r:
            return r.response
        return [_job(j) for j in jobs]

    @router.post("/jobs", status_code=201, response_model=JobResponse, openapi_extra={
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": JobRequest.model_json_schema()}}}})
    async def submit(request: Request):
        try:
            body = parse_json(await request.body())
        except InvalidInput:  # not JSON, or nested too deeply to parse
            return _error(400, "body is not valid JSON")
        try:
            req = JobRequest.model_validate(body)
        except ValidationError as exc:
            return _error(422, _validation_message(exc))
        spec = JobSpec(command=req.command, name=req.name, cwd=req.cwd, env=req.env,
                       gpu_mem=int(req.gpu_mem), priority=req.priority, policy=req.policy)
        try:
            job = await call(store.submit, spec)
        except _Reply as r:
            return r.response
        entry = Entry("job-submit", "job", str(job.id), None,
                      {"command": spec.command, "name": spec.name, "gpu_mem": spec.gpu_mem,
                       "priority": spec.priority, "policy": spec.policy}, caller_of(request))
        await audit.arecord(entry, "guard job %d (%s) submitted by %s", job.id,
                            " ".join(spec.command), entry.by())
        return JSONResponse(_job(job), status_code=201)

    @router.get("/jobs/{job_id}", response_model=JobResponse)
    async def show(job_id: int):
        try:
            return _job(await call(store.get, job_id))
        except _Reply as r:
            return r.response

    @router.post("/jobs/{job_id}/cancel", response_model=JobResponse)
    async def cancel(request: Request, job_id: int):
        try:
            before = await call(store.get, job_id)
            job = await call(store.request_cancel, job_id)
        except _Reply as r:
            return r.response
        entry = Entry("job-cancel", "job", str(job_id), before.state, job.state,
                      caller_of(request))
        await audit.arecord(entry, "guard job %d cancelled by %s (%s -> %s)", job_id,
                            entry.by(), before.state, job.state)
        return _job(job)

    @router.get("/jobs/{job_id}/logs", response_class=PlainTextResponse)
    async def logs(job_id: int, tail_bytes: int | None = Query(None, ge=1)):
        try:
            job = await call(store.get, job_id)
            text = await call(_read_log, job.log_path, tail_bytes, job_id)
        except _Reply as r:
            return r.response
        return PlainTextResponse(text)

    @router.get("/health")
    async def health():
        """Whether queued jobs will run: the database answers and a supervisor heartbeats on it."""
        try:
            sup, counts = await call(_health_state, store)
        except _Reply as r:
            return r.response
        body = {"ok": False, "supervisor": None, "jobs": counts}
        if sup is None:
            problem = "no guard supervisor runs on this job database; queued jobs wait"
        else:
            age = max(0.0, time.time() - sup["heartbeat"])
            body["supervisor"] = {"pid": sup["pid"], "device": sup["device"],
                                  "heartbeat_age_s": round(age, 3)}
            if age <= HEARTBEAT_STALE_S:
                return {**body, "ok": True}
            problem = (f"the guard supervisor (pid {sup['pid']}) has recorded no heartbeat for "
                       f"{age:.0f} s: it is stuck, gone, or cannot write the job database")
        return error_response(Unavailable(problem, retry_after_s=StoreFault.RETRY_AFTER_S), body)

    return router


def _health_state(store: JobStore):
    return store.supervisor(), store.counts()


class _Reply(Exception):
    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


def _read_log(path: str | None, tail_bytes: int | None, job_id: int) -> str:
    if not path:
        raise NotFound(f"job {job_id} has no log")
    try:
        with open(path, "rb") as f:
            if tail_bytes:
                f.seek(max(0, os.path.getsize(path) - tail_bytes))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""  # not started yet
