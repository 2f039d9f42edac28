"""Open Inference Protocol v2 over HTTP/REST, with the binary tensor data extension and Triton's
model repository extension (index, load, unload)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from .. import oip
from ..errors import InvalidInput, PayloadTooLarge, VisionServeError, describe_validation
from .common import (
    engine_of,
    read_body,
    read_json_object,
    settings_of,
    unless_disconnected,
)
from .schemas import (
    CONFLICT,
    ERRORS,
    InferenceRequest,
    InferenceResponse,
    ModelMetadata,
    ServerMetadata,
)

router = APIRouter(tags=["Open Inference Protocol v2"])

T = TypeVar("T")

_HEADER_LEN = "inference-header-content-length"


def _inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` inlined. The infer routes read the body
    themselves, so FastAPI never puts InferenceRequest into ``components``; a ``$ref`` to it
    would dangle and OpenAPI tools (schemathesis, code generators) could not resolve it."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.split("/")[-1]])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


_INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": _inline_schema(InferenceRequest)},
            "application/octet-stream": {
                "schema": {"type": "string", "format": "binary"},
                "description": "Binary tensor extension: a JSON InferenceRequest of "
                               "Inference-Header-Content-Length bytes, then the tensors' bytes.",
            },
        },
    },
    "parameters": [{"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                    "schema": {"type": "integer", "minimum": 0},
                    "description": "Length of the JSON header when binary tensor data follows "
                                   "it."}],
}


#: how long readiness waits for the cameras' states (from the engine process, with --frontends)
READY_DETAIL_S = 0.5


@router.get("/v2/health/live", summary="Server live", responses={200: {"description": "Live"}})
async def live(request: Request) -> JSONResponse:
    return JSONResponse({"live": True})


@router.get("/v2/health/ready", summary="Server ready",
            responses={200: {"description": "Ready"}, 503: {"description": "Not ready"}})
async def ready(request: Request) -> JSONResponse:
    engine = engine_of(request)
    ok = engine.ready
    body: dict[str, Any] = {"ready": ok}
    if engine.recipes.sources:  # the detail: a camera that is down leaves the rest serving
        try:
            states = await asyncio.wait_for(engine.camera_states(), READY_DETAIL_S)
        except (VisionServeError, asyncio.TimeoutError):
            states = []
        body["cameras"] = {c["name"]: c["state"] if c["state"] == "up"
                           else f"{c['state']}: {c['last_error']}" for c in states}
    return JSONResponse(body, status_code=200 if ok else 503)


@router.get("/v2", response_model=ServerMetadata, summary="Server metadata")
async def server_metadata() -> dict[str, Any]:
    return oip.server_metadata()


@router.get("/v2/models/stats", summary="Statistics of every model",
            responses={200: {"description": "OK"}})
async def all_stats(request: Request) -> dict[str, Any]:
    return {"model_stats": [oip.model_statistics(s) for s in await engine_of(request).statistics()]}


@router.get("/v2/models/{model_name}", response_model=ModelMetadata, responses=ERRORS,
            summary="Model metadata")
@router.get("/v2/models/{model_name}/versions/{model_version}", response_model=ModelMetadata,
            responses=ERRORS, summary="Model version metadata")
async def model_metadata(request: Request, model_name: str,
                         model_version: str = "") -> dict[str, Any]:
    return oip.model_metadata(engine_of(request).get(model_name, model_version))


@router.get("/v2/models/{model_name}/ready", responses=ERRORS, summary="Model ready")
@router.get("/v2/models/{model_name}/versions/{model_version}/ready", responses=ERRORS,
            summary="Model version ready")
async def model_ready(request: Request, model_name: str, model_version: str = "") -> JSONResponse:
    engine = engine_of(request)
    engine.entry(model_name)
    if model_version:
        from ..repository import parse_version

        parse_version(engine.entry(model_name), model_version)
    ok = engine.model_ready(model_name, model_version)
    return JSONResponse({"name": model_name, "ready": ok}, status_code=200 if ok else 503)


@router.get("/v2/models/{model_name}/config", responses=ERRORS,
            summary="Model configuration (Triton shape)")
@router.get("/v2/models/{model_name}/versions/{model_version}/config", responses=ERRORS,
            summary="Model version configuration")
async def model_config(request: Request, model_name: str,
                       model_version: str = "") -> dict[str, Any]:
    return oip.model_config(engine_of(request).get(model_name, model_version))


@router.get("/v2/models/{model_name}/stats", responses=ERRORS, summary="Model statistics")
@router.get("/v2/models/{model_name}/versions/{model_version}/stats", responses=ERRORS,
            summary="Model version statistics")
async def model_stats(request: Request, model_name: str, model_version: str = "") -> dict[str, Any]:
    served = await engine_of(request).statistics(model_name, model_version)
    return {"model_stats": [oip.model_statistics(s) for s in served]}


@router.post("/v2/models/{model_name}/infer", response_model=InferenceResponse, responses=ERRORS,
             openapi_extra=_INFER_BODY, summary="Inference")
@router.post("/v2/models/{model_name}/versions/{model_version}/infer",
             response_model=InferenceResponse, responses=ERRORS, openapi_extra=_INFER_BODY,
             summary="Inference on a version")
async def infer(request: Request, model_name: str, model_version: str = "") -> Response:
    try:
        return await _infer(request, model_name, model_version)
    except VisionServeError as exc:
        if not exc.counted:  # refused here, before the engine (which counts what it answers)
            engine_of(request).count_error(model_name, exc)
        raise


async def _infer(request: Request, model_name: str, model_version: str = "") -> Response:
    arrival = time.monotonic()
    engine, settings = engine_of(request), settings_of(request)
    engine.get(model_name, model_version)
    header_len = request.headers.get(_HEADER_LEN)
    # JSON has its own, smaller limit (binary tensors are the fast path for large frames)
    json_limit, json_setting = min((settings.max_json_body_bytes, "max_json_body_bytes"),
                                   (settings.max_body_bytes, "max_body_bytes"))
    if header_len is None:  # all JSON
        body = await read_body(request, json_limit, settings.body_timeout_s, setting=json_setting)
    else:
        body = await read_body(request, settings.max_body_bytes, settings.body_timeout_s)
    header, binary = _split(body, header_len)
    if len(header) > json_limit:
        raise PayloadTooLarge(f"the JSON header of {len(header)} bytes is over the limit of "
                              f"{json_limit} (setting {json_setting})")
    # a large JSON document is parsed and converted beside the event loop (in pieces, so that
    # the loop gets its turns: oip.loads_request)
    req = await _off_loop(_parse_request, header) if len(header) > oip.JSON_PIECE_BYTES \
        else _parse_request(header)
    route = oip.route(engine, model_name, model_version, req.parameters)
    model_name, model_version = route.model, route.version
    served = engine.get(model_name, model_version)
    if len(req.inputs) != 1:
        raise InvalidInput(f"model {served.name} takes exactly one input "
                           f"({served.config.input.name!r}), got {len(req.inputs)}")
    inp = req.inputs[0]
    oip.check_input(served, inp.name, inp.datatype, inp.shape)
    frames = _frames(inp, binary, settings.max_image_pixels) if inp.data is None \
        else await _off_loop(_frames, inp, binary, settings.max_image_pixels)
    names = oip.requested(served, [o.name for o in req.outputs] if req.outputs else None)
    deadline_ms, priority = oip.parameters(req.parameters)
    served, results = await unless_disconnected(
        request, engine.infer(model_name, model_version, frames, deadline_ms=deadline_ms,
                              priority=priority, arrival=arrival,
                              origin=oip.origin(req.parameters, req.id, route)))
    return _response(req, served, results, names, oip.answer_parameters(route))


# --- model repository extension (Triton's paths and bodies) ---------------------------------------

#: a repository call's body: a few parameters (a model sent in the body is refused anyway)
_REPOSITORY_BODY = 1024**2


async def _repository_body(request: Request) -> dict[str, Any]:
    """The JSON object a repository call carries ({} for an empty body, as tritonclient sends
    to the index)."""
    return await read_json_object(request, _REPOSITORY_BODY, empty={})


def _parameters(data: dict[str, Any]) -> dict[str, Any]:
    params = data.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput("'parameters' must be a JSON object")
    return params


@router.post("/v2/repository/index", responses=ERRORS, summary="Model repository index")
async def repository_index(request: Request) -> JSONResponse:
    ready = (await _repository_body(request)).get("ready", False)
    if not isinstance(ready, bool):
        raise InvalidInput(f"'ready' must be true or false, got {ready!r}")
    return JSONResponse(await engine_of(request).repository_index(ready))


@router.post("/v2/repository/models/{model_name}/load", responses={**ERRORS, **CONFLICT},
             summary="Load or reload a model (a swap: docs/triton-compat.md)")
async def repository_load(request: Request, model_name: str) -> JSONResponse:
    params = _parameters(await _repository_body(request))
    return JSONResponse(await engine_of(request).load_model(model_name, params))


@router.post("/v2/repository/models/{model_name}/unload", responses={**ERRORS, **CONFLICT},
             summary="Unload a model (parameters.force: even while in use)")
async def repository_unload(request: Request, model_name: str) -> JSONResponse:
    params = _parameters(await _repository_body(request))
    return JSONResponse(await engine_of(request).unload_model(model_name, params))


#: the threads that parse and convert large JSON requests: a few, so that a burst of them waits
#: its turn instead of taking every core and its memory at once
_JSON_THREADS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="oip-json")


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_JSON_THREADS, fn, *args)


def _split(body: bytes, header_len: str | None) -> tuple[bytes, memoryview]:
    if header_len is None:
        return body, memoryview(b"")
    try:
        n = int(header_len)
    except ValueError:
        raise InvalidInput(f"Inference-Header-Content-Length {header_len!r} is not an "
                           "integer") from None
    if n < 0 or n > len(body):
        raise InvalidInput(f"Inference-Header-Content-Length {n} does not fit the body of "
                           f"{len(body)} bytes")
    view = memoryview(body)
    return bytes(view[:n]), view[n:]


def _parse_request(header: bytes) -> InferenceRequest:
    """The request (with its tensors' JSON data parsed in pieces: :func:`oip.loads_request`)."""
    try:
        data, arrays = oip.loads_request(header)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise InvalidInput("malformed JSON: nested too deeply") from None
    req = _validate(data)
    if arrays and not oip.fill_in(req.inputs, arrays):  # a marker out of place: the slow way
        req = _validate(json.loads(header))
    return req


def _validate(data: Any) -> InferenceRequest:
    try:
        return InferenceRequest.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(describe_validation(exc, empty="body"))
        raise InvalidInput(f"bad inference request: {errs}") from None


def _frames(inp, binary: memoryview, max_pixels: int):
    params = inp.parameters or {}
    size = params.get("binary_data_size")
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidInput(f"binary_data_size {size!r} must be a non-negative integer")
        if size != len(binary):
            raise InvalidInput(f"binary_data_size {size} does not match the {len(binary)} binary "
                               "bytes sent")
        if inp.datatype == "BYTES":
            return oip.frames_from_bytes(oip.deserialize_bytes(binary), _n(inp.shape), max_pixels)
        expected = oip.byte_size("UINT8", inp.shape)
        if size != expected:
            raise InvalidInput(f"UINT8 input of shape {inp.shape} needs {expected} bytes, got "
                               f"{size}")
        return oip.frames_from_uint8(bytes(binary), inp.shape, max_pixels)
    if len(binary):
        raise InvalidInput("binary data follows the JSON header but no input declares "
                           "binary_data_size")
    if inp.data is None:
        raise InvalidInput(f"input {inp.name!r} has neither 'data' nor parameters.binary_data_size")
    if inp.datatype == "BYTES":
        return oip.frames_from_bytes(oip.json_elements_to_bytes(inp.data), _n(inp.shape),
                                     max_pixels)
    return oip.frames_from_uint8(oip.json_uint8(inp.data, inp.shape), inp.shape, max_pixels)


def _n(shape: list[int]) -> list[int]:
    return [shape[0]]


def _response(req: InferenceRequest, served, results, names: list[str],
              parameters: dict[str, str]) -> Response:
    tensors = oip.outputs(served, results)
    want_binary = bool((req.parameters or {}).get("binary_data_output", False))
    out_params = {o.name: (o.parameters or {}) for o in (req.outputs or [])}
    outputs, blobs = [], []
    for name in names:
        datatype, shape, arr = tensors[name]
        binary = out_params.get(name, {}).get("binary_data", want_binary)
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": shape}
        if binary:
            blob = oip.tensor_bytes(datatype, arr)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = [e.decode() for e in arr.reshape(-1)] if datatype == "BYTES" \
                else arr.reshape(-1).tolist()
        outputs.append(entry)
    body: dict[str, Any] = {"model_name": served.name, "model_version": str(served.version),
                            "outputs": outputs}
    if req.id is not None:
        body["id"] = req.id
    if parameters:
        body["parameters"] = parameters
    head = json.dumps(body, separators=(",", ":")).encode()
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


