"""The console's routes: ``GET /ui`` (to the first page), ``/ui/live``, ``/ui/parts`` (NG
parts) and ``/ui/parts/{part_id}``, ``/ui/models``, ``/ui/stations``, ``/ui/system``,
``/ui/audit``, ``/ui/review`` (captured frames to label), ``/ui/models/{m}/candidates`` (a
model's candidates, their comparison, promote and roll back) and the package's own files at
``/ui/static/{name}``.

Each page is rendered here from what the data plane says (the repository index, the served
versions, the verdict rules, the recipes, the server's Prometheus series) and the guard's job
store; nothing is cached, so a reload shows the server as it is. A page's buttons call the
server's existing JSON routes from the browser (``static/console.js``), under the access rules
every client meets (docs/security.md)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from ..audit import ACTIONS
from ..config import ServerSettings, time_zone
from ..errors import InvalidInput, NotFound, VisionServeError, http_status
from ..http.audit import AuditQuery, audit_page
from ..http.common import audit_of, engine_of
from ..http.signin import session_of
from ..loop import promote as promotion
from ..records import labels as labelling
from ..records.record import iso
from ..records.store import MAX_PAGE, RecordStore
from ..security import route_of
from ..users.store import role_covers
from . import auditview, parts, review, system, verdictform
from .strings import (
    STRINGS,
    live_strings,
    review_script_strings,
    script_strings,
    verdict_script_strings,
)

if TYPE_CHECKING:
    from ..dataplane import DataPlane, ServedModel
    from ..guard.store import JobStore
    from ..loop.shadow import Shadows

log = logging.getLogger(__name__)
T = TypeVar("T")

HERE = Path(__file__).resolve().parent
#: the files under /ui/static, by name, and their media types
STATIC_TYPES = {".css": "text/css; charset=utf-8", ".js": "text/javascript; charset=utf-8"}
#: the pages in the navigation, in order: (path, strings key of its name); each reader sees those
#: their role may open
PAGES = (("/ui/live", "nav_live"), ("/ui/parts", "nav_parts"), ("/ui/models", "nav_models"),
         ("/ui/stations", "nav_stations"), ("/ui/system", "nav_system"),
         (review.PATH, "nav_review"), (auditview.PATH, "nav_audit"))
#: the answers the Line live page keeps on screen (newest on top)
LIVE_ROWS = 50
#: the minutes of answers and latency the Line live page plots
LIVE_MINUTES = 10
#: the guard's jobs the System page lists
LIVE_JOB_STATES = ("queued", "running", "paused")
#: every page: scripts and styles from this server only, no frames, no inline script
HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'; "
                                      "form-action 'self'; base-uri 'none'",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
           "Cache-Control": "no-store"}


def make_router(settings: ServerSettings, guard_store: JobStore | None = None,
                records: RecordStore | None = None, shadows: Shadows | None = None) -> APIRouter:
    """The console's routes for a server with ``settings``; ``guard_store``: the hosted
    guard's job queue (``--guard``), listed on the System page; ``records``: the record store
    (``--records``), whose captured NG frames the NG parts pages show; ``shadows``: the
    candidates running in shadow, shown on the Candidates page."""
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    env = Environment(loader=FileSystemLoader(HERE / "templates"),
                      autoescape=select_autoescape(("html",)), undefined=StrictUndefined,
                      trim_blocks=True, lstrip_blocks=True)
    zone_name, zone = time_zone(settings.time_zone)
    env.filters["when"] = lambda t: (datetime.fromtimestamp(t, zone).strftime("%Y-%m-%d %H:%M:%S")
                                     if t else STRINGS["none"])
    env.filters["size"] = system.size
    env.filters["iso"] = iso
    static = {p.name: (p.read_bytes(), STATIC_TYPES[p.suffix])
              for p in sorted((HERE / "static").iterdir()) if p.suffix in STATIC_TYPES}
    router = APIRouter(include_in_schema=False)

    def render(request: Request, name: str, path: str, status_code: int = 200,
               **data: Any) -> HTMLResponse:
        pages = [(p, key) for p, key in PAGES if _may(request, "GET", p)]
        page = env.get_template(name).render(
            s=STRINGS, pages=pages, here=path, zone=zone_name, user=session_of(request),
            now=datetime.now(zone).strftime("%Y-%m-%d %H:%M:%S"),
            script_strings=script_strings(), **data)
        return HTMLResponse(page, status_code=status_code, headers=HEADERS)

    @router.get("/ui")
    async def home() -> RedirectResponse:
        return RedirectResponse(PAGES[0][0], status_code=303)

    @router.get("/ui/live")
    async def live(request: Request, model: str = "", station: str = "") -> HTMLResponse:
        engine = engine_of(request)
        stations = sorted(engine.recipes.stations)
        if model and model not in engine.entries:
            raise NotFound(f"no model {model!r} in the repository")
        if station and station not in stations:
            raise NotFound(f"no station {station!r} in the recipes")
        shown = [model] if model else sorted(engine.entries)
        return render(request, "live.html", "/ui/live", models=sorted(engine.entries),
                      stations=stations,
                      model=model, station=station, shown=shown,
                      live_strings=live_strings(), live_rows=LIVE_ROWS,
                      live_minutes=LIVE_MINUTES,
                      last_ng=records is not None and settings.capture != "none")

    @router.get("/ui/parts")
    async def ng_parts(request: Request, since: str = "", until: str = "", model: str = "",
                       label: str = "", part_id: str = "", before: str = "") -> HTMLResponse:
        filters = {"since": since, "until": until, "model": model, "label": label,
                   "part_id": part_id}
        models = sorted(set(engine_of(request).entries) | ({model} if model else set()))
        shown, error, status = await _read_records(
            records, parts.read_gallery, filters, before, zone)
        return render(request, "parts.html", "/ui/parts", status, models=models, error=error,
                      paged=bool(before),
                      gallery=shown or parts.Gallery(filters, [], None), thumb=parts.THUMB_SIDE)

    @router.get("/ui/parts/{part_id:path}")
    async def part(request: Request, part_id: str) -> HTMLResponse:
        answers, error, status = await _read_records(records, parts.read_part, part_id)
        if error is None and not answers:
            error, status = STRINGS["part_unknown"].format(part=part_id), 404
        return render(request, "part.html", "/ui/parts", status, part_id=part_id,
                      answers=answers or [],
                      error=error, picture=parts.PICTURE_SIDE,
                      most=len(answers or []) >= MAX_PAGE,
                      schemes=_schemes(engine_of(request)),
                      may_flag=records is not None and settings.capture != "none"
                      and _may(request, "POST", "/v1/records/{id}/flag"),
                      review_strings=review_script_strings())

    @router.get("/ui/models")
    async def models(request: Request) -> HTMLResponse:
        engine = engine_of(request)
        return render(request, "models.html", "/ui/models", models=await _models(engine),
                      control=settings.model_control_mode,
                      verdict_editable=_may(request, "PUT", "/v1/models/{m}/verdict"),
                      candidates_link=records is not None
                      and _may(request, "GET", "/ui/models/{m}/candidates"),
                      verdict_strings=verdict_script_strings())

    @router.get("/ui/models/{model}/candidates")
    async def candidates(request: Request, model: str) -> HTMLResponse:
        entry = engine_of(request).entries.get(model)
        if entry is None:
            raise NotFound(f"no model {model!r} in the repository")
        view, error, status = None, None, 200
        if records is None:
            error = STRINGS["records_off"]
        else:
            try:
                view = await run_in_threadpool(promotion.overview, entry, guard_store,
                                               shadows)
            except VisionServeError as exc:
                error, status = exc.message, http_status(exc)
        return render(request, "candidates.html", "/ui/models", status, model=model,
                      view=view, error=error, boxes=entry.config.task == "detection",
                      may_change=_may(request, "POST", "/v1/models/{m}/candidates/{c}/promote"))

    @router.get("/ui/stations")
    async def stations(request: Request) -> HTMLResponse:
        return render(request, "stations.html", "/ui/stations",
                      book=engine_of(request).recipes.view())

    @router.get("/ui/system")
    async def system_page(request: Request) -> HTMLResponse:
        engine = engine_of(request)
        figures = system.read((await engine.metrics_text()).decode("utf-8"))
        jobs, jobs_error = await _guard_jobs(guard_store)
        served = sum(1 for s in await engine.statistics() if s.ready)
        return render(request, "system.html", "/ui/system", figures=figures, settings=settings,
                      ready=engine.ready, served=served, jobs=jobs, jobs_error=jobs_error,
                      guard_on=guard_store is not None,
                      plc_on=bool(settings.opcua or settings.modbus))

    @router.get(auditview.PATH)
    async def audit(request: Request, user: str = "", action: str = "", since: str = "",
                    until: str = "", before: int | None = None,
                    after: int | None = None) -> HTMLResponse:
        query = AuditQuery(since, until, user, action, auditview.ROWS, before, after)
        error = None
        try:
            page = await audit_page(audit_of(request), query, settings.time_zone)
        except InvalidInput as exc:  # a filter the server cannot read: said on the page
            page, error = {"entries": [], "older": None, "newer": None}, exc.message
        return render(request, "audit.html", auditview.PATH, page=page, query=query,
                      actions=ACTIONS, error=error, changes=auditview.changes,
                      action_name=auditview.action_name,
                      since_input=auditview.local_input(since),
                      until_input=auditview.local_input(until),
                      older_link=page["older"] and auditview.page_link(query, before=page["older"]),
                      newer_link=page["newer"] and auditview.page_link(query, after=page["newer"]),
                      newest_link=auditview.page_link(query))

    @router.get(review.PATH)
    async def review_page(request: Request, model: str = "", state: str = "",
                          before: str = "") -> HTMLResponse:
        schemes = _schemes(engine_of(request))
        model = model or next(iter(schemes), "")
        queue, error, status = None, None, 200
        if model and model not in schemes:
            error, status = STRINGS["review_not_labelled_model"].format(model=model), 404
        elif model:
            queue, error, status = await _read_records(records, review.read_queue, model, state,
                                                       before, schemes[model])
        elif records is not None:
            error = STRINGS["review_no_models"]
        return render(request, "review.html", review.PATH, status, models=sorted(schemes),
                      error=error, paged=bool(before), thumb=parts.THUMB_SIDE,
                      queue=queue or review.empty(model, state),
                      review_strings=review_script_strings())

    @router.get("/ui/static/{name}")
    async def asset(name: str) -> Response:
        if name not in static:
            raise NotFound(f"no console file {name!r}")
        body, media = static[name]
        return Response(body, media_type=media, headers={"X-Content-Type-Options": "nosniff",
                                                          "Cache-Control": "no-cache"})

    return router


async def _models(engine: DataPlane) -> list[dict[str, Any]]:
    """Each model of the repository: its versions and their state, the versions served (backend,
    device, instances), its batching and the ``[verdict]`` in force."""
    rows = await engine.repository_index()
    served: dict[str, list[ServedModel]] = {}
    for s in engine.select():
        served.setdefault(s.name, []).append(s)
    out = []
    for name in sorted(engine.entries):
        config = engine.entries[name].config
        verdict, verdict_error = await _guarded(engine.verdict(name))
        out.append({
            "name": name, "task": config.task, "backend": config.runtime.backend,
            "instances": config.runtime.instances, "batching": config.batching,
            "versions": [r for r in rows if r["name"] == name],
            "served": sorted(served.get(name, []), key=lambda s: s.version),
            "verdict": verdict or {}, "verdict_error": verdict_error,
            "verdict_fields": verdictform.fields(config, verdict) if verdict else [],
        })
    return out


def _schemes(engine: DataPlane) -> dict[str, labelling.Scheme]:
    """The models whose frames can be labelled, and how."""
    out = {}
    for name in sorted(engine.entries):
        try:
            out[name] = labelling.scheme_of(name, engine.entries[name].config)
        except InvalidInput:
            continue  # a task without labels yet (a segmenter, a plug-in's)
    return out


def _may(request: Request, method: str, path: str) -> bool:
    """Whether the page's reader may send ``method path`` (the page shows that action's form):
    a signed-in user whose role covers the route's; without a session the page was opened with
    the admin token or on a loopback bind without users, which open every protected route."""
    session = session_of(request)
    route = route_of(method, path)
    return session is None or (route is not None and role_covers(session.role, route.role))


async def _read_records(store: RecordStore | None, read: Callable[..., T], *args: Any
                        ) -> tuple[T | None, str | None, int]:
    """(what ``read(store, *args)`` gives in a worker thread, None, 200), or (None, the
    message, its HTTP status) when the server keeps no records or refuses."""
    if store is None:
        return None, STRINGS["records_off"], 200
    try:
        return await run_in_threadpool(read, store, *args), None, 200
    except VisionServeError as exc:
        return None, exc.message, http_status(exc)


async def _guarded(read: Awaitable[T]) -> tuple[T | None, str | None]:
    """(what ``read`` gives, None), or (None, the server's message) when it refuses."""
    try:
        return await read, None
    except VisionServeError as exc:
        return None, exc.message


async def _guard_jobs(store: JobStore | None) -> tuple[list, str | None]:
    if store is None:
        return [], None
    try:
        return await run_in_threadpool(store.list, LIVE_JOB_STATES), None
    except Exception as exc:  # noqa: BLE001 - the page shows what the store said
        log.warning("console: the guard's jobs cannot be read: %s", exc)
        return [], str(exc)
