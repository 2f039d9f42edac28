"""Wire models (pydantic), used at the edge only: response shapes and the OpenAPI document."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ErrorResponse(BaseModel):
    error: str


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str] = []
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class RequestInput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = Field(
        None, description="Row-major values. BYTES: base64 strings of image files. UINT8: "
        "integers. Omitted when parameters.binary_data_size says the tensor follows the JSON "
        "header.")


class RequestOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = None


class InferenceRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="timeout (microseconds: the request's deadline), priority (higher "
        "first), binary_data_output (bool).")
    inputs: list[RequestInput]
    outputs: list[RequestOutput] | None = None


class ResponseOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[Any] | None = None


class InferenceResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[ResponseOutput]


class Timing(BaseModel):
    queue_ms: float
    compute_ms: float
    total_ms: float


class InspectResult(BaseModel):
    """These fields for every model, and after ``verdict`` those of the model's task
    (classification: ``label``, ``score``, ``scores``; docs/architecture.md)."""

    model_config = ConfigDict(extra="allow")

    part_id: str | None
    camera_id: str | None = None
    model: str
    version: str
    verdict: str = Field(..., description="OK or NG. A frame whose answer is not ready by its "
                         "deadline gets no verdict: status 504 with verdict LATE (InspectError)")
    label: str | None = Field(None, description="Classification: the top label")
    score: float | None = Field(None, description="Classification: the top label's score")
    scores: dict[str, float] | None = Field(None, description="Classification: every label's score")
    detections: list[dict[str, Any]] | None = Field(
        None, description="Detection, segmentation: what was found, highest score first: label, "
        "class, score, box [x1, y1, x2, y2] and area in the frame's pixels (size_mm, area_mm2 "
        "with verdict.pixels_per_mm; segmentation: mask as COCO RLE)")
    reasons: list[Any] | None = Field(
        None, description="Why the part is NG. Detection, segmentation: each rule that made it "
        "NG (rule, message, detections: indices into detections); anomaly: one sentence each")
    station: str | None = Field(None, description="The station the frame belongs to (only "
                                "for frames of a station: X-Station-Id, its camera, or the URL)")
    recipe: str | None = Field(None, description="The recipe it was decided under (with station)")
    batch_size: int
    deadline_met: bool = Field(..., description="Always true in a 200 answer (a late frame is "
                               "answered 504 LATE); kept for clients that read it")
    timing: Timing


class InspectError(BaseModel):
    error: str
    part_id: str | None = None
    model: str | None = None
    verdict: str | None = Field(None, description="LATE when the deadline passed (504): in the "
                                "queue, during decode, or before the verdict was ready. No "
                                "decision for the part")
    deadline_met: bool | None = Field(None, description="false with verdict LATE (504)")
    late_ms: float | None = Field(None, description="With verdict LATE: how many ms after the "
                                  "deadline the server found it passed")


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Bad input"},
    404: {"model": ErrorResponse, "description": "Unknown model or version"},
    413: {"model": ErrorResponse, "description": "Body or image too large"},
    503: {"model": ErrorResponse, "description": "Not ready, shutting down, or overloaded "
                                                 "(Retry-After)"},
    504: {"model": ErrorResponse, "description": "Deadline exceeded: the answer was not ready by "
                                                 "the request's deadline (the message says how "
                                                 "late)"},
}

#: 409 for the routes that can answer it: the request contradicts the server's state (model
#: control mode, a model in use, the GPU memory budget, a station's recipe); nothing changed
CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorResponse, "description": "Conflicts with the server's state (the model "
          "control mode, a model in use, the GPU memory budget, a station's recipe); nothing "
          "was changed"}}

_ERROR_BODY = {"application/json": {"schema": {
    "type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}}}

#: what a protected route (docs/security.md) may answer before it runs
PROTECTED: dict[int | str, dict[str, Any]] = {
    401: {"description": "No admin token (the server binds a non-loopback address)",
          "content": _ERROR_BODY},
    403: {"description": "A foreign Host or Origin, or the inference token where the admin "
                         "token is needed", "content": _ERROR_BODY},
    415: {"description": "A body that is not JSON", "content": _ERROR_BODY}}

#: what the console's sign-in (POST /ui/login) may answer besides the session
SIGN_IN: dict[int | str, dict[str, Any]] = {
    303: {"description": "A browser's form: signed in, sent on to the console"},
    400: {"description": "No user name or password", "content": _ERROR_BODY},
    401: {"description": "Wrong user name or password (never which)", "content": _ERROR_BODY},
    403: {"description": "A foreign Host or Origin", "content": _ERROR_BODY},
    415: {"description": "A body that is neither a form nor JSON", "content": _ERROR_BODY},
    429: {"description": "Too many failed sign-ins: wait Retry-After seconds",
          "content": _ERROR_BODY},
    503: {"description": "The users file cannot be read", "content": _ERROR_BODY}}

#: what the console's session routes (GET /ui/session, POST /ui/logout) may refuse with
SESSION_ROUTES: dict[int | str, dict[str, Any]] = {
    401: {"description": "No session, or one that ended", "content": _ERROR_BODY},
    403: {"description": "A foreign Host or Origin, or a change without the session's CSRF "
                         "token", "content": _ERROR_BODY},
    503: {"description": "The users file cannot be read", "content": _ERROR_BODY}}
