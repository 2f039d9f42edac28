"""Server settings (``VISIONSERVE_*`` environment variables) and the ``model.toml`` schema.

The sections every model has are here; a task's own sections (classification's ``[output]`` and
``[verdict]``) are in its module under ``visionserve/tasks``. Every field is documented in
``Field(description=...)``; ``docs/model-toml.md`` is the same reference for readers. Unknown
fields and bad values are refused with the file and the field named (see
:func:`load_model_config`).
"""

from __future__ import annotations

import difflib
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import tzinfo
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.config import JsonDict
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigError, describe_validation
from .plugins import BACKENDS, TASKS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: The shipped default model's repository inside an installed wheel (setup.py puts
#: models/defect-classifier there). An editable install has none.
SHIPPED_MODELS_DIR = Path(__file__).resolve().parent / "default_models"


def default_models_dir() -> Path:
    """The model repository shipped in the installed package, else ``./models`` (an editable
    install run from its checkout). Never a path of the source checkout."""
    return SHIPPED_MODELS_DIR if SHIPPED_MODELS_DIR.is_dir() else Path("models")


def data_home() -> Path:
    """``$XDG_DATA_HOME/visionserve`` (``~/.local/share/visionserve``): where the server keeps
    what it writes (guard queue, PLC certificates, records) unless told otherwise."""
    import os

    data = os.environ.get("XDG_DATA_HOME", "")
    if not os.path.isabs(data):  # the XDG spec: unset or relative means the default
        data = os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data) / "visionserve"


USERS_DB_ENV = "VISIONSERVE_USERS_DB"


def users_db_path(configured: Path | None = None) -> Path:
    """The console's users file: ``configured`` (the setting users_db), else
    ``$VISIONSERVE_USERS_DB``, else ``$XDG_DATA_HOME/visionserve/users.sqlite``: the same for the
    server and the CLI. The audit trail is kept beside it (:mod:`visionserve.audit`)."""
    import os

    if configured:
        return Path(configured)
    return Path(os.environ.get(USERS_DB_ENV) or data_home() / "users.sqlite")


def time_zone(name: str = "") -> tuple[str, tzinfo]:
    """(IANA name, zone) of the time zone ``name``; "" is the machine's local zone (``TZ``, else
    the zone ``/etc/localtime`` links to, else ``/etc/timezone``; UTC when none says).
    ValueError names a zone the system's tz database lacks."""
    import os
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    if not name:
        name = os.environ.get("TZ", "").lstrip(":")
        if not name:
            target = os.path.realpath("/etc/localtime")
            name = target.split("/zoneinfo/", 1)[1] if "/zoneinfo/" in target else ""
        if not name:
            try:
                name = Path("/etc/timezone").read_text(encoding="utf-8").strip()
            except OSError:
                name = "UTC"
    try:
        return name, ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"unknown time zone {name!r}: use an IANA name such as Europe/Berlin "
                         "or UTC") from None


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_bytes(value: str | float) -> int:
    """``"4GiB"`` -> 4294967296, ``"512MB"`` -> 512000000, ``1024`` -> 1024.

    Raises ``ValueError`` naming the bad value.
    """
    if isinstance(value, bool):  # a ValueError, as for every bad size (pydantic reports those)
        raise ValueError(f"not a size: {value!r}")  # noqa: TRY004
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"size must not be negative: {value!r}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"not a size: {value!r} (use e.g. 4GiB, 512MiB, 800MB or a byte count)")
    unit = (m.group(2) or "").upper().rstrip("B") if (m.group(2) or "").upper() != "B" else "B"
    return int(float(m.group(1)) * _UNITS[unit])


#: the task of a model.toml that names none
DEFAULT_TASK = "classification"


def _unique_labels(v: tuple[str, ...]) -> tuple[str, ...]:
    if len(set(v)) != len(v):
        raise ValueError("labels must be unique")
    return v


#: a model's class labels, in its output order: each once
Labels = Annotated[tuple[str, ...], AfterValidator(_unique_labels)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Strict):
    name: str = Field("image", description="OIP input tensor name clients use.")
    width: int = Field(..., ge=8, le=8192, description="Model input width in pixels.")
    height: int = Field(..., ge=8, le=8192, description="Model input height in pixels.")
    channels: Literal[1, 3] = Field(
        3, description="1 (grey) or 3 (colour) channels the model takes.")
    color_order: Literal["RGB", "BGR", "GRAY"] = Field(
        "RGB", description="Channel order the model was trained on. Decoding yields BGR; converted "
                           "as needed.")
    resize: Literal["stretch", "letterbox", "center_crop"] = Field(
        "stretch", description="stretch: resize to WxH ignoring aspect; letterbox: keep aspect, "
        "pad with `pad_value`; center_crop: resize the short side, crop the centre.")
    interpolation: Literal["area", "linear", "nearest", "cubic"] = Field(
        "area", description="Interpolation for downscaling (area is the anti-aliased choice).")
    scaled_decode: bool = Field(
        False, description="CPU path: decode a JPEG at 1/2, 1/4 or 1/8 of its size (libjpeg's "
        "scaled IDCT, which averages like `area`) when that is still at least the resize's "
        "size, then resize: 1.2-1.4x faster at 640x480 and 2.1-2.4x at 1280x1024 for the "
        "shipped model; its scores moved by 0.036 at p99 (0.083 at most) on the held-out set "
        "(docs/benchmarks.md), so a near tie can flip. Only with `area`, "
        "and only for frames whose sides divide by the scale, so the geometry is the full "
        "frame's. The GPU path always decodes in full.")
    pad_value: int = Field(114, ge=0, le=255, description="Grey level for letterbox padding.")
    layout: Literal["NCHW", "NHWC"] = Field("NCHW", description="Tensor layout the model takes.")
    dtype: Literal["float32", "float16", "uint8"] = Field(
        "float32", description="Input tensor dtype.")
    scale: float = Field(
        1.0 / 255.0, gt=0, description="Pixels are multiplied by this first (uint8 -> [0,1]).")
    mean: tuple[float, ...] = Field(
        (0.0, 0.0, 0.0), description="Per-channel mean subtracted after scaling.")
    std: tuple[float, ...] = Field(
        (1.0, 1.0, 1.0), description="Per-channel std divided after the mean.")
    tensor_name: str | None = Field(
        None, description="Model graph input name; default: the first input.")
    raw_max_value: int | None = Field(
        None, ge=1, le=65535, description="Camera frames deeper than 8 bits: the sample value "
        "that becomes 255 (e.g. 4095 for a 12-bit sensor in a Mono16 container); values above "
        "it saturate. Default: the pixel format's maximum (Mono12: 4095). docs/cameras.md.")

    @model_validator(mode="after")
    def _check_channels(self) -> InputSpec:
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"mean and std need {self.channels} values (one per channel)")
        if any(s <= 0 for s in self.std):
            raise ValueError("std values must be > 0")
        if (self.channels == 1) != (self.color_order == "GRAY"):
            raise ValueError("color_order GRAY goes with channels = 1, RGB/BGR with channels = 3")
        return self


class BatchingSpec(_Strict):
    max_batch_size: int = Field(32, ge=1, le=4096, description="Largest micro-batch.")
    preferred_batch_sizes: tuple[int, ...] = Field(
        (1, 2, 4, 8, 16, 32), description="Shapes warmed up before ready; a batch is padded up to "
                                          "the next one.")
    max_queue_delay_ms: float = Field(
        2.0, ge=0, le=10_000, description="Longest a request waits for others to join its batch, "
        "from the first queued request.")
    max_queue_size: int = Field(
        256, ge=1, description="Queued frames beyond this are refused with 503.")
    takt_ms: float = Field(
        200.0, gt=0, le=3_600_000,
        description="The line's takt budget: default deadline (ms from arrival) when the client "
                    "sends none.")
    priority_levels: int = Field(
        3, ge=1, le=100, description="Priorities 0..levels-1; higher runs first.")
    pad_to_preferred: Literal["auto", "always", "never"] = Field(
        "auto", description="Pad a batch up to the next preferred size: always (static shapes: "
        "CUDA graphs, TensorRT), never (dynamic-shape CPU runtimes gain nothing from extra rows), "
        "or auto: on a GPU only.")
    dispatch_when_idle: bool = Field(
        False, description="Send what is queued at once when the model is idle instead of waiting "
        "max_queue_delay_ms for company: lowest latency at light load, batches still form under "
        "load (requests queue while the model is busy).")

    @model_validator(mode="after")
    def _check_sizes(self) -> BatchingSpec:
        ps = self.preferred_batch_sizes
        if ps and (list(ps) != sorted(set(ps)) or ps[0] < 1):
            raise ValueError("preferred_batch_sizes must be increasing positive integers")
        if ps and ps[-1] > self.max_batch_size:
            raise ValueError(
                f"preferred_batch_sizes {list(ps)} exceed max_batch_size {self.max_batch_size}")
        return self


class RuntimeSpec(_Strict):
    backend: str = Field(
        "onnxruntime", description="What runs the model, and so which file of a version folder "
        "serves: `onnxruntime` (`model.onnx`) or `torch` (`model.pt2`); more from installed "
        "packages (entry point group `visionserve.backends`, docs/architecture.md).")
    precision: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="Compute precision on the GPU.")
    instances: int = Field(
        1, ge=1, le=16, description="Model instances per device, each with its own executor.")
    intra_op_threads: int = Field(
        0, ge=0, le=256, description="CPU threads per inference; 0 = library default.")
    gpu_memory_budget: str | None = Field(
        None, description="GPU memory this model may reserve (e.g. 2GiB); the server setting caps "
                          "the total.")

    @field_validator("gpu_memory_budget")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_bytes(v)
        return v

    @field_validator("backend")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in BACKENDS:
            raise PydanticCustomError("unknown_backend", "{problem}",
                                      {"problem": BACKENDS.unknown(v)})
        return v


class VersionPolicy(_Strict):
    """Which version folders of the model are served (Triton's `version_policy`): the newest
    `latest` of them, the `specific` ones, or `all`. Set one; none set serves all of them.
    Changed while the server runs, it takes effect at the model's next load (a load call, or
    the next poll with `--model-control-mode poll`), as a swap."""

    latest: int | None = Field(
        None, ge=1, le=1000, description="Serve the newest N version folders (e.g. 1: only the "
        "newest, so that a new folder replaces the old version).")
    specific: tuple[int, ...] | None = Field(
        None, min_length=1, description="Serve exactly these versions; each must have its folder "
        "with the model file.")
    all: bool = Field(False, description="Serve every version folder (also what an empty section "
                                         "means).")

    @model_validator(mode="after")
    def _one(self) -> VersionPolicy:
        given = [n for n, v in (("latest", self.latest), ("specific", self.specific),
                                ("all", self.all or None)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"set one of latest, specific, all (got {' and '.join(given)})")
        if self.specific is not None and (any(v < 1 for v in self.specific)
                                          or len(set(self.specific)) != len(self.specific)):
            raise ValueError("specific versions must be distinct integers >= 1")
        return self

    def select(self, versions: typing.Iterable[int]) -> list[int]:
        """The versions of ``versions`` (the folders there are) it serves, ascending; a specific
        version without its folder is left out (the caller names it)."""
        have = sorted(versions)
        if self.latest is not None:
            return have[-self.latest:]
        if self.specific is not None:
            return sorted(v for v in self.specific if v in have)
        return have


#: what a ``[training] command`` may name (docs/closed-loop.md, "A training command of your own")
TRAINING_PLACEHOLDERS = {
    "data": "the labelled set: a folder in the loop's export layout",
    "out": "the candidate's folder, where the command leaves the model file (and metrics.json)",
    "from": "the folder of the version the candidate is trained from",
    "model": "the model's folder (its model.toml)",
    "device": "cuda where the guard has a GPU, else cpu",
    "steps": "the request's steps",
    "python": "the server's Python interpreter",
}


def _training_command(v: tuple[str, ...] | None) -> tuple[str, ...] | None:
    import string

    if v is None:
        return v
    if not v or not v[0].strip():
        raise ValueError("command needs the program to run first, e.g. [\"{python}\", "
                         "\"train.py\", \"{data}\", \"{out}\"]")
    named: set[str] = set()
    for arg in v:
        try:
            named |= {f for _, f, _, _ in string.Formatter().parse(arg) if f is not None}
        except ValueError as exc:
            raise ValueError(f"command argument {arg!r}: {exc} (a literal brace is written "
                             "twice: {{ or }})") from None
    def braced(names) -> list[str]:
        return ["{" + n + "}" for n in names]

    unknown = sorted(named - set(TRAINING_PLACEHOLDERS))
    if unknown:
        raise ValueError(f"command names {', '.join(braced(unknown))}; the placeholders are "
                         f"{', '.join(braced(TRAINING_PLACEHOLDERS))}")
    missing = [k for k in ("data", "out") if k not in named]
    if missing:
        raise ValueError(f"command must name {' and '.join(braced(missing))}: where the "
                         "labelled set is and where the model it trains goes")
    return v


class TrainingSpec(_Strict):
    """How the closed loop trains a candidate of this model (docs/closed-loop.md)."""

    command: Annotated[tuple[str, ...] | None, AfterValidator(_training_command)] = Field(
        None, description="A training command of your own, run as a guard job for `POST "
        "/v1/models/{m}/candidates`, e.g. `[\"{python}\", \"train.py\", \"{data}\", \"{out}\", "
        "\"--init\", \"{from}\"]`, in the model's folder. Placeholders: `{data}` (the labelled "
        "set), `{out}` (where it must leave the version's model file and, optionally, "
        "`metrics.json`), `{from}`, `{model}`, `{device}`, `{steps}`, `{python}`.")
    gpu_memory: str | None = Field(
        None, description="GPU memory the command declares to the guard (e.g. `4GiB`); default "
        "2GiB. Where the guard has no GPU the command runs on the CPU.")
    approvers: int = Field(
        1, ge=1, le=2, description="How many users approve the promotion of a candidate of "
        "this model: 1, or 2 for a second approver (another user than the first; the first "
        "approval waits, the second promotes).")
    good: str | None = Field(
        None, description="Anomaly models: the folder of good images the model was fitted on "
        "(relative to the model's folder, or absolute), refitted with the captured good parts; "
        "default: the `--good` folder the version's `fit.json` names, where it still exists.")

    @field_validator("gpu_memory")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_bytes(v)
        return v


class ModelConfig(_Strict):
    """Schema of ``models/<name>/model.toml``: the sections every task shares.

    It is a union on ``task``: each task (``visionserve/tasks``) subclasses it with its own
    sections (classification: ``[output]``, ``[verdict]``), and ``ModelConfig.model_validate``
    validates a file by the schema its ``task`` names.
    """

    name: str | None = Field(
        None, description="Model name; defaults to the folder name (must match if set).")
    description: str = Field("", description="Free text for humans.")
    task: str = Field(
        DEFAULT_TASK, description="What the outputs mean: the task that turns them into answers "
        "and verdicts, with its own sections below (`classification`: `[output]`, `[verdict]`); "
        "more from installed packages (entry point group `visionserve.tasks`, "
        "docs/architecture.md).")
    default_version: int | None = Field(
        None, ge=1, description="Version served when none is asked; default: highest.")
    version_policy: VersionPolicy = VersionPolicy()
    input: InputSpec
    batching: BatchingSpec = BatchingSpec()
    runtime: RuntimeSpec = RuntimeSpec()
    training: TrainingSpec = TrainingSpec()

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> ModelConfig:
        """On ``ModelConfig`` itself, the union: ``obj`` validated by the schema of the task it
        names; on a task's schema, as pydantic does."""
        if cls is not ModelConfig or not isinstance(obj, Mapping):
            return super().model_validate(obj, **kwargs)
        return task_schema(obj.get("task", DEFAULT_TASK)).model_validate(obj, **kwargs)


def task_schema(task: object) -> type[ModelConfig]:
    """The ``model.toml`` schema of ``task``; a ValidationError on field ``task`` when no task of
    that name is registered, or its plug-in cannot be imported."""
    problem = TASKS.unknown(task) if task not in TASKS else None
    if problem is None:
        try:
            schema = TASKS.load(str(task)).schema  # a registered name: a str
        except Exception as exc:  # noqa: BLE001 - a plug-in's import may fail in any way
            problem = f"task {task!r} cannot be loaded: {type(exc).__name__}: {exc}"
        else:
            if isinstance(schema, type) and issubclass(schema, ModelConfig) \
                    and schema is not ModelConfig:
                return schema
            problem = f"task {task!r} has no model.toml schema (a ModelConfig subclass)"
    raise ValidationError.from_exception_data("ModelConfig", [{
        "type": PydanticCustomError("unknown_task", "{problem}", {"problem": problem}),
        "loc": ("task",), "input": task}])


def load_model_config(path: Path) -> ModelConfig:
    """Parse and validate one ``model.toml``; ConfigError names the file and field on failure."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    try:
        return ModelConfig.model_validate(data)
    except ValidationError as exc:
        errs = "; ".join(describe_validation(exc, empty="(top level)", field=True, got=True))
        raise ConfigError(f"{path}: {errs}") from None


#: The groups of ``serve --help`` and the sections of docs/settings.md, in their order: each
#: setting names its own in ``json_schema_extra={"group": ...}``.
SETTING_GROUPS: dict[str, str] = {
    "network": "Where the server listens, and its front-end processes.",
    "request limits": "What one request or connection may take; past it the request is refused.",
    "security": "Who may call what (docs/security.md).",
    "models and batching": "The model repository, how it changes while serving, and batching.",
    "GPU": "The device and what runs on it (docs/gpu.md).",
    "PLC": "Results to PLCs over OPC UA and Modbus TCP (docs/plc.md).",
    "records": "Traceability records and image capture (docs/records.md).",
    "guard": "Sharing the GPU with training jobs (docs/guard.md).",
    "console": "The operator console in the browser at /ui (docs/console.md).",
    "cameras": "Cameras the server acquires from itself (docs/cameras.md).",
    "logging and process": "Logging, shutdown and the serving process's threads.",
}
_NETWORK: JsonDict = {"group": "network"}
_LIMITS: JsonDict = {"group": "request limits"}
_SECURITY: JsonDict = {"group": "security"}
_MODELS: JsonDict = {"group": "models and batching"}
_GPU: JsonDict = {"group": "GPU"}
_PLC: JsonDict = {"group": "PLC"}
_RECORDS: JsonDict = {"group": "records"}
_GUARD: JsonDict = {"group": "guard"}
_CONSOLE: JsonDict = {"group": "console"}
_CAMERAS: JsonDict = {"group": "cameras"}
_OTHER: JsonDict = {"group": "logging and process"}


class ServerSettings(BaseSettings):
    """Every ``visionserve serve`` option; each is also ``VISIONSERVE_<NAME>`` in the
    environment."""

    model_config = SettingsConfigDict(env_prefix="VISIONSERVE_", extra="ignore", frozen=True)

    host: str = Field(
        "0.0.0.0", description="Address to bind: 0.0.0.0 all interfaces (line PCs on the plant "
                               "network), 127.0.0.1 this machine only.",
        json_schema_extra=_NETWORK)
    http_port: int = Field(
        8000, ge=0, le=65535, description="HTTP port (OIP v2, inspect API, /metrics).",
        json_schema_extra=_NETWORK)
    grpc_port: int = Field(8001, ge=-1, le=65535, description="gRPC port; -1 disables gRPC.",
                           json_schema_extra=_NETWORK)
    models: Path = Field(default_factory=default_models_dir, description="Model repository folder.",
                         json_schema_extra={**_MODELS,
                                            "default_text": "shipped default model, else ./models"})
    model_control_mode: Literal["none", "poll", "explicit"] = Field(
        "none", description="Changing models while serving: none (the start's models), explicit "
                            "(load/unload calls), poll (re-read the repository, swap what "
                            "changed); docs/triton-compat.md.",
        json_schema_extra=_MODELS)
    load_model: str | None = Field(
        None, description="With --model-control-mode explicit: the models loaded at start-up, "
                          "comma-separated; unset: every model of the repository.",
        json_schema_extra=_MODELS)
    repository_poll_secs: float = Field(
        15.0, gt=0, le=86_400, description="With --model-control-mode poll: seconds between two "
                                           "reads of the model repository.",
        json_schema_extra=_MODELS)
    device: str = Field("auto", description="auto (the first GPU, else the CPU) | cpu | cuda | "
                                            "cuda:N | GPU-<uuid> | PCI bus id.",
                        json_schema_extra=_GPU)
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level.", json_schema_extra=_OTHER)
    log_json: bool = Field(False, description="Structured JSON log lines.",
                           json_schema_extra=_OTHER)
    max_body_bytes: int = Field(64 * 1024**2, ge=1024, description="Largest request body (bytes).",
                                json_schema_extra=_LIMITS)
    max_json_body_bytes: int = Field(
        16 * 1024**2, ge=1024, description="Largest OIP JSON inference request, or JSON header "
                                           "of a binary one (bytes); binary tensors and images "
                                           "are limited by --max-body-bytes.",
        json_schema_extra=_LIMITS)
    max_image_pixels: int = Field(
        40_000_000, ge=64, description="Largest decoded image (width*height).",
        json_schema_extra=_LIMITS)
    max_batch_size: int | None = Field(
        None, ge=1, description="Override every model's batching.max_batch_size.",
        json_schema_extra=_MODELS)
    max_queue_delay_ms: float | None = Field(
        None, ge=0, description="Override batching.max_queue_delay_ms.", json_schema_extra=_MODELS)
    max_queue_size: int | None = Field(None, ge=1, description="Override batching.max_queue_size.",
                                       json_schema_extra=_MODELS)
    takt_ms: float | None = Field(
        None, gt=0, description="Override batching.takt_ms (default deadline).",
        json_schema_extra=_MODELS)
    drain_timeout_s: float = Field(
        20.0, ge=0, description="On SIGTERM: how long queued requests may finish.",
        json_schema_extra=_OTHER)
    hold_on_error: bool = Field(
        False, description="When start-up fails, say why once and stay up serving nothing until "
                           "stopped, instead of exiting: for containers under a restart policy "
                           "(the image sets it).",
        json_schema_extra=_OTHER)
    gpu_memory_budget: str | None = Field(
        None, description="GPU memory the server reserves, e.g. 4GiB (docs/gpu.md).",
        json_schema_extra=_GPU)
    grpc_max_message_bytes: int = Field(64 * 1024**2, ge=1024, description="Largest gRPC message.",
                                        json_schema_extra=_LIMITS)
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body must arrive within this (slow clients get 408).",
        json_schema_extra=_LIMITS)
    min_body_rate_bytes_s: float = Field(
        16384.0, ge=0, description="A request body slower than this on average (bytes/s, after "
                                   "its first 2 s) gets 408 and its connection closed; 0: no "
                                   "minimum.",
        json_schema_extra=_LIMITS)
    header_timeout_s: float = Field(
        5.0, gt=0, le=300,
        description="A request's head must arrive within this, from the connection's start or the "
                    "request's first byte; slower connections are closed (slowloris).",
        json_schema_extra=_LIMITS)
    max_connections: int | None = Field(
        1000, ge=1, description="Open HTTP connections per process; when full, the longest idle "
                                "one is closed, or new requests get 503 if all are busy "
                                "(docs/security.md).",
        json_schema_extra=_LIMITS)
    max_live_streams: int = Field(
        32, ge=1, description="Open live result streams (GET /v1/live) in the whole server; "
                              "past it 503. They do not count against --max-connections.",
        json_schema_extra=_LIMITS)
    auth_token: str | None = Field(
        None, description="Require 'Authorization: Bearer <token>' (HTTP) / 'authorization' "
                          "metadata (gRPC).",
        json_schema_extra=_SECURITY)
    auth_token_file: Path | None = Field(
        None, description="Read the bearer token from this file instead.",
        json_schema_extra=_SECURITY)
    auth_health_open: bool = Field(True, description="Health endpoints stay open when auth is on.",
                                   json_schema_extra=_SECURITY)
    auth_metrics_open: bool = Field(
        True, description="/metrics stays open when auth is on, for scrapers that send no token; "
                          "it shows model names and traffic, no frames.",
        json_schema_extra=_SECURITY)
    admin_token: str | None = Field(
        None, description="The token protected routes need off a loopback bind "
                          "(docs/security.md); unset: made at the first start in "
                          "$XDG_DATA_HOME/visionserve/admin-token.",
        json_schema_extra=_SECURITY)
    admin_token_file: Path | None = Field(
        None, description="Read the admin token from this file instead (a mounted secret).",
        json_schema_extra=_SECURITY)
    allowed_hosts: str = Field(
        "", description="Names, besides localhost, this machine's and the bind address, that "
                        "protected requests may give in Host (comma-separated; * any).",
        json_schema_extra=_SECURITY)
    allowed_origins: str = Field(
        "", description="Web origins (http://name:port, comma-separated; * any) besides the "
                        "server's own that may call protected routes.",
        json_schema_extra=_SECURITY)
    trusted_proxies: str = Field(
        "", description="Reverse proxies (addresses or networks, comma-separated) whose "
                        "X-Forwarded-For/-Proto give the client's address.",
        json_schema_extra=_SECURITY)
    api_docs: bool = Field(
        False, description="Serve the API pages /docs, /redoc and /openapi.json (protected "
                           "routes; the pages load their scripts from a CDN).",
        json_schema_extra=_SECURITY)
    users_db: Path | None = Field(
        None, description="The console's users and their sessions (visionserve users manages "
                          "them); with no user in it, access is as without the console.",
        json_schema_extra={**_SECURITY, "default_text": "$XDG_DATA_HOME/visionserve/users.sqlite"})
    audit_db: Path | None = Field(
        None, description="The audit trail: who changed what, when (docs/security.md).",
        json_schema_extra={**_SECURITY, "default_text": "audit.sqlite beside the users file"})
    audit_retention_days: float = Field(
        365.0, ge=0, description="Audit entries older than this many days are deleted; 0 keeps "
                                 "every entry.", json_schema_extra=_SECURITY)
    session_ttl_s: float = Field(
        8 * 3600.0, ge=60, le=30 * 86_400,
        description="A console sign-in lasts this long (seconds), then the user signs in again.",
        json_schema_extra=_SECURITY)
    tls_cert: Path | None = Field(
        None, description="PEM certificate: serve HTTPS and gRPC over TLS.",
        json_schema_extra=_SECURITY)
    tls_key: Path | None = Field(None, description="PEM private key for --tls-cert.",
                                 json_schema_extra=_SECURITY)
    switch_interval_ms: float | None = Field(
        None, gt=0, le=100,
        description="Python's thread switch interval in the serving process (ms); 0.5 trims "
                    "the p99.9 with --frontends at some throughput (docs/gpu.md).",
        json_schema_extra={**_OTHER, "default_text": "0.5, or 5 with --frontends"})
    isolated_loads: bool = Field(
        True,
        description="Read a torch model loaded beside serving ones (a swap) in a child process, "
                    "so that its deserialisation does not hold the serving threads.",
        json_schema_extra=_MODELS)
    gpu_prep_one_call: bool = Field(
        True,
        description="On the GPU, prepare a batch of same-size JPEGs in one TorchScript call "
                    "instead of some 40 torch calls; off: the eager path (docs/gpu.md).",
        json_schema_extra=_GPU)
    gpu_batch_processes: int | None = Field(
        None, ge=0, le=8,
        description="On the GPU, worker processes per model instance that prepare and run its "
                    "batches, each with a model copy inside --gpu-memory-budget (docs/gpu.md).",
        json_schema_extra={**_GPU, "default_text": "on a GPU a quarter of the cores, at most 3; "
                                                   "0 on the CPU"})
    recipes: Path | None = Field(
        None, description="The recipes file (docs/recipes.md); default: recipes.toml in the "
                          "model repository, when there is one.",
        json_schema_extra=_MODELS)
    worker_nice: int = Field(
        5, ge=0, le=19,
        description="Nice levels below the event loop for the model's threads in the serving "
                    "process (Linux), so the loop runs first; 0: all at one priority.",
        json_schema_extra=_OTHER)
    frontends: int | None = Field(
        None, ge=0, le=64,
        description="HTTP/gRPC front-end processes handing frames to the engine through shared "
                    "memory; 0: the front end runs in the engine's process (docs/gpu.md).",
        json_schema_extra={**_NETWORK, "default_text": "on a GPU half the cores, at most 8; 0 "
                                                       "on the CPU"})
    frontend_arena_bytes: int = Field(
        64 * 1024**2, ge=1024**2,
        description="Shared memory per front-end process for frames in flight; a larger frame "
                    "travels in the message instead (slower, never refused).",
        json_schema_extra=_NETWORK)
    guard: bool = Field(
        False, description="Also host the training-queue guard (and /v1/guard/jobs, which runs "
                           "commands: a protected route, docs/security.md).",
        json_schema_extra=_GUARD)
    guard_db: Path | None = Field(
        None, description="The guard's SQLite database (the one `visionserve guard` uses).",
        json_schema_extra={**_GUARD, "default_text": "$VISIONSERVE_GUARD_DB, else "
                                                     "$XDG_DATA_HOME/visionserve/guard.sqlite"})
    guard_latency_budget_ms: float | None = Field(
        None, gt=0, description="With --guard: pause training jobs while the served p99 of the "
                                "last second is over this (ms); they resume under 80% of it.",
        json_schema_extra=_GUARD)
    guard_margin: str = Field(
        "1GiB", description="Safety margin the guard keeps above the server's budget.",
        json_schema_extra=_GUARD)
    guard_mps: bool = Field(
        True, description="With --guard on a GPU: the server and its jobs share the GPU as "
                          "clients of one CUDA MPS daemon; where MPS cannot run, jobs yield "
                          "(docs/guard.md).",
        json_schema_extra=_GUARD)
    guard_mps_job_sm_percent: int = Field(
        50, ge=1, le=100, description="With --guard-mps: the share of the SMs a training job's "
                                      "kernels may occupy (a job's own value wins).",
        json_schema_extra=_GUARD)
    # --- results to the PLC (visionserve/plc, docs/plc.md) ---
    opcua: str | None = Field(
        None, description="Serve results to PLCs over OPC UA (OPC 40100 Machine Vision) at this "
                          "endpoint, e.g. opc.tcp://0.0.0.0:4840.",
        json_schema_extra=_PLC)
    opcua_security: str = Field(
        "Basic256Sha256,Aes128Sha256RsaOaep",
        description="OPC UA security policies offered (Sign and SignAndEncrypt each), "
                    "comma-separated; None (no security) only when named.",
        json_schema_extra=_PLC)
    opcua_anonymous: bool = Field(False, description="Let OPC UA clients in without a user name.",
                                  json_schema_extra=_PLC)
    opcua_user: str | None = Field(None, description="The OPC UA user name PLCs log in with.",
                                   json_schema_extra=_PLC)
    opcua_password_file: Path | None = Field(
        None, description="File holding --opcua-user's password.", json_schema_extra=_PLC)
    modbus: str | None = Field(
        None, description="Serve results to PLCs over Modbus TCP at host:port, e.g. 0.0.0.0:5020 "
                          "(one unit id per station).",
        json_schema_extra=_PLC)
    plc_max_clients: int = Field(
        8, ge=1, le=256,
        description="PLC connections at once, per protocol; when all are taken, a new one "
                    "replaces one that never spoke or has long been idle.",
        json_schema_extra=_PLC)
    plc_idle_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="A Modbus connection silent this long, or an OPC UA one without an open "
                    "session by then, is closed.",
        json_schema_extra=_PLC)
    plc_stations: str = Field(
        "*", description="PLC stations by camera id, comma-separated: station N is OPC UA "
                         "Station<N> and Modbus unit id N; * takes every other camera.",
        json_schema_extra=_PLC)
    plc_buffer: int = Field(
        16, ge=1, le=1000,
        description="Results a Modbus station keeps until the PLC acknowledges them; one more "
                    "raises Fault.",
        json_schema_extra=_PLC)
    plc_heartbeat_ms: float = Field(500.0, ge=10, le=60_000, description="The PLC heartbeat bit "
                                                                         "toggles at this period.",
                                    json_schema_extra=_PLC)
    plc_watchdog_ms: float = Field(
        2000.0, ge=100, le=600_000,
        description="The engine counts as stalled (heartbeat stops, Fault) when frames have waited "
                    "this long with none computed, or its event loop has not run for this long.",
        json_schema_extra=_PLC)
    plc_data_dir: Path | None = Field(
        None, description="Folder for the OPC UA server certificate and the trusted/ and "
                          "rejected/ client certificates.",
        json_schema_extra={**_PLC, "default_text": "$XDG_DATA_HOME/visionserve/plc"})

    # --- traceability records and image capture (visionserve/records, docs/records.md) ---
    records: bool = Field(
        False, description="Keep a traceability record of every answered frame, written off the "
                           "hot path; GET /v1/parts/{part_id} reads them (docs/records.md).",
        json_schema_extra=_RECORDS)
    records_dir: Path | None = Field(
        None, description="Folder of the records database (records.sqlite) and of captured "
                          "images (captures/).",
        json_schema_extra={**_RECORDS, "default_text": "$XDG_DATA_HOME/visionserve"})
    records_url: str | None = Field(
        None, description="The record store: sqlite:///path/records.sqlite, or "
                          "postgresql://user@host/db (password from PGPASSWORD or ~/.pgpass).",
        json_schema_extra={**_RECORDS, "default_text": "records.sqlite in --records-dir"})
    records_max_age_days: float = Field(
        365.0, gt=0, description="Records older than this are deleted.",
        json_schema_extra=_RECORDS)
    records_max_bytes: str = Field(
        "10GiB", description="The record store's size limit: the oldest records are deleted past "
                             "it.",
        json_schema_extra=_RECORDS)
    records_queue: int = Field(
        10_000, ge=100, le=10_000_000,
        description="Answered frames waiting for the record writer; past it records are dropped "
                    "and counted, inference never waits.",
        json_schema_extra=_RECORDS)
    capture: Literal["none", "ng", "uncertain", "sample", "all", "learn"] = Field(
        "none", description="Which frames are kept for retraining, with their record (needs "
                            "--records): ng, uncertain (see --capture-band), sample (see "
                            "--capture-sample-percent), all; learn: ng, uncertain and sample.",
        json_schema_extra=_RECORDS)
    capture_band: float = Field(
        0.1, gt=0, le=1,
        description="--capture uncertain, learn: the band around the verdict's threshold (on "
                    "the score's scale).",
        json_schema_extra=_RECORDS)
    capture_sample_percent: float = Field(
        1.0, gt=0, le=100,
        description="--capture sample, learn: the share of frames kept, in percent.",
        json_schema_extra=_RECORDS)
    capture_target: str | None = Field(
        None, description="Where captured images go: a folder, or s3://bucket/prefix (the s3 "
                          "extra; credentials from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).",
        json_schema_extra={**_RECORDS, "default_text": "captures/ in --records-dir"})
    capture_s3_endpoint: str | None = Field(
        None, description="The S3-compatible server of an s3:// target, e.g. "
                          "https://minio.plant:9000.",
        json_schema_extra={**_RECORDS, "default_text": "AWS S3"})
    capture_quota: str = Field(
        "20GiB", description="A capture folder's size limit: the oldest images are deleted past "
                             "it, so a full disk never stops the line.",
        json_schema_extra=_RECORDS)
    capture_queue: int = Field(
        256, ge=1, le=100_000,
        description="Captured images waiting to be written; past it images are dropped and "
                    "counted, inference never waits.",
        json_schema_extra=_RECORDS)
    capture_recent: str = Field(
        "256MiB", description="Frames the capture policy did not keep, held in memory (the "
                              "newest, up to this size) so that a flag still captures one "
                              "(POST /v1/records/{id}/flag: an escape); 0: none.",
        json_schema_extra=_RECORDS)
    preview_frames: int = Field(
        200, ge=0, le=100_000,
        description="Last answered frames kept per model (ids and outputs, no images) for the "
                    "verdict preview (POST /v1/models/{m}/verdict/preview); 0: none kept.",
        json_schema_extra=_MODELS)
    console: bool = Field(
        True, description="Serve the operator console at /ui (same port and access rules).",
        json_schema_extra=_CONSOLE)
    time_zone: str = Field(
        "", description="The time zone the console shows times in (IANA name, e.g. "
                        "Europe/Berlin); empty: the machine's local zone.",
        json_schema_extra={**_CONSOLE, "default_text": "the machine's local zone"})
    camera: list[str] = Field(
        default_factory=list,
        description="A camera as NAME=URI (folder:PATH, gige://DEVICE, rtsp://HOST/PATH), "
                    "repeatable; beside [camera.NAME] of the recipes file. No password in a URI.",
        json_schema_extra={**_CAMERAS, "default_text": "none"})
    camera_credentials: Path | None = Field(
        None, description="TOML file of camera NAME -> user, password (mode 0600); else "
                          "VISIONSERVE_CAMERA_<NAME>_USER and _PASSWORD.",
        json_schema_extra=_CAMERAS)

    @field_validator("camera")
    @classmethod
    def _cameras(cls, v: list[str]) -> list[str]:
        names = [parse_camera_option(text)[0] for text in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"--camera names {', '.join(twice)} more than once")
        return v

    @field_validator("guard_margin", "records_max_bytes", "capture_quota", "capture_recent")
    @classmethod
    def _margin(cls, v: str) -> str:
        parse_bytes(v)
        return v

    @field_validator("time_zone")
    @classmethod
    def _zone(cls, v: str) -> str:
        if v:
            time_zone(v)
        return v

    @model_validator(mode="after")
    def _capture_needs_records(self) -> ServerSettings:
        if self.capture != "none" and not self.records:
            raise ValueError(f"capture {self.capture!r} needs records on (--records): each "
                             "captured image carries its record")
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        return self

    @model_validator(mode="after")
    def _load_model(self) -> ServerSettings:
        if self.load_model is not None and self.model_control_mode != "explicit":
            raise ValueError("load_model goes with model_control_mode explicit (the other modes "
                             "load every model of the repository)")
        return self

    def serving_switch_interval_s(self) -> float:
        """The serving process's thread switch interval (``switch_interval_ms``, or its default
        for this number of front ends), in seconds."""
        ms = self.switch_interval_ms
        if ms is None:
            ms = 5.0 if self.frontends else 0.5
        return ms / 1000

    def startup_models(self) -> set[str] | None:
        """The models to load at start-up (None: all of them)."""
        if self.load_model is None:
            return None
        return {n.strip() for n in self.load_model.split(",") if n.strip()}

    @field_validator("gpu_memory_budget")
    @classmethod
    def _size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_bytes(v)
        return v


ENV_PREFIX = "VISIONSERVE_"

#: a camera's name (``[camera.NAME]``, ``--camera NAME=URI``): also a metrics label and part of
#: its credentials' variable names
CAMERA_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$"

#: why a camera URI with a password in it is refused
PASSWORD_IN_URI = ("the camera URI holds a password: a URI is shown in logs and process lists; "
                   "give the user and password in --camera-credentials or in "
                   "VISIONSERVE_CAMERA_<NAME>_USER / _PASSWORD (docs/cameras.md)")


#: ``VISIONSERVE_CAMERA_<NAME>_USER`` / ``_PASSWORD``: a camera's credentials, no setting
CAMERA_SECRET = re.compile(r"^CAMERA_[A-Z0-9_]+_(USER|PASSWORD)$")


def has_password(uri: str) -> bool:
    """True when ``uri`` carries a password (``scheme://user:password@host``)."""
    try:
        return urlsplit(uri.strip()).password is not None
    except ValueError:
        return False


def parse_camera_option(text: str) -> tuple[str, str]:
    """``NAME=URI`` of ``--camera`` -> (name, uri); ValueError says what is wrong."""
    name, sep, uri = text.partition("=")
    name, uri = name.strip(), uri.strip()
    if not sep or not name or not uri:
        raise ValueError(f"--camera {text!r}: expected NAME=URI, e.g. cam-1=folder:/srv/drop")
    if not re.match(CAMERA_NAME, name):
        raise ValueError(f"--camera {name!r}: use letters, digits and _.:- (at most 64)")
    if has_password(uri):
        raise ValueError(f"--camera {name}: {PASSWORD_IN_URI}")
    return name, uri



#: ``VISIONSERVE_*`` variables that are not server settings, and what reads them. The start-up
#: check for misspelt settings leaves them alone; docs/settings.md lists them.
OTHER_VARIABLES: dict[str, str] = {
    "GPU": "deploy/docker-compose.yml: the GPU (UUID or index) passed to the containers",
    "IMAGE": "deploy/docker-compose.yml: the image the containers run",
    "MODELS_DIR": "deploy/docker-compose.yml: the host folder mounted as the model repository",
    "GUARD_DEVICE": "deploy/docker-compose.yml: the guard container's `--device`",
    "ADMIN_TOKEN_SECRET": "deploy/docker-compose.yml: the host file holding the admin token "
                          "(a Compose secret; docs/security.md)",
    "ORT_SPIN": "onnxruntime on the CPU: `1` lets idle intra-op threads spin (default: they sleep)",
    "IMAGE_CACHE": "`visionserve bench`: where generated image sets are cached (`off`: not at all)",
    "GUARD_JOB_ID": "set by the training-queue guard for its jobs (docs/guard.md)",
    "GUARD_POLICY": "set by the training-queue guard for its jobs (docs/guard.md)",
    "GPU_MEM_LIMIT": "set by the training-queue guard for its jobs (docs/guard.md)",
    "GUARD_ALLOCATOR_CAP": "set by the training-queue guard for its jobs (docs/guard.md)",
    "GPU_MEM_FRACTION": "set by the training-queue guard for its jobs (docs/guard.md)",
    "GUARD_SHARE": "the server's busy word for cooperative yielding (docs/guard.md): set for a "
                   "server and a `guard run` that are separate processes; the guard sets it for "
                   "jobs",
    "GUARD_YIELD": "a guard job's `0` turns cooperative yielding off for it (docs/guard.md)",
    "GUARD_YIELD_STATS": "set by the training-queue guard for its jobs (docs/guard.md)",
    "GUARD_YIELD_MAX_WAIT_MS": "set by the guard for its jobs; a job may set its own "
                               "(docs/guard.md)",
    "GUARD_YIELD_MIN_SHARE": "set by the guard for its jobs; a job may set its own (docs/guard.md)",
    "GUARD_YIELD_QUEUE_MS": "set by the guard for its jobs; a job may set its own (docs/guard.md)",
    "GUARD_YIELD_DEPTH": "set by the guard for its jobs; a job may set its own (docs/guard.md)",
    "GUARD_YIELD_MODE": "set by the guard for its jobs; a job may set its own (docs/guard.md)",
}


@dataclass(frozen=True)
class SettingDoc:
    """One server setting as ``serve --help`` and docs/settings.md show it."""

    name: str
    flags: tuple[str, ...]  # ("--log-json", "--no-log-json") for a switch
    env: str
    default: str
    help: str
    group: str
    choices: tuple[str, ...] = ()


def setting_docs() -> list[SettingDoc]:
    """Every :class:`ServerSettings` field: its flags, variable, default and help text."""
    out = []
    for name, field in ServerSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        switch = field.annotation is bool
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "default_text" in extra:  # computed defaults (default_factory) say what they are
            default = str(extra["default_text"])
        elif field.default is None:
            default = "unset"
        elif switch:
            default = "true" if field.default else "false"
        else:
            default = str(field.default)
        literal = typing.get_origin(field.annotation) is Literal
        choices = typing.get_args(field.annotation) if literal else ()
        out.append(SettingDoc(name, (flag, "--no-" + flag[2:]) if switch else (flag,),
                              ENV_PREFIX + name.upper(), default, field.description or "",
                              str(extra.get("group", "")), tuple(map(str, choices))))
    return out


def grouped_setting_docs() -> list[tuple[str, list[SettingDoc]]]:
    """:func:`setting_docs` by group, in :data:`SETTING_GROUPS` order."""
    docs = setting_docs()
    return [(g, [d for d in docs if d.group == g]) for g in SETTING_GROUPS]


#: Settings that were removed, and why: their variables get a warning that says so.
REMOVED_SETTINGS: dict[str, str] = {
    "GPU_PREP_PROCESSES": "preparing batches in worker processes measured slower; "
                          "--gpu-batch-processes prepares and runs them there",
    "GPU_CUDNN_AUTOTUNE": "cuDNN's tuned kernels measured no faster than its heuristic's",
    "GPU_GRAPH_FETCH": "capturing the output copies in the CUDA graphs measured no faster",
    "FRONTEND_ZERO_COPY": "reading frames in place in the front ends' memory measured no faster",
    "LOAD_SWITCH_INTERVAL_MS": "the switch interval during a load is fixed",
}


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``VISIONSERVE_*`` variable that is no setting (pydantic-settings ignores
    them silently: a typo would leave the default in force), naming the nearest setting, or
    saying that the setting was removed."""
    settings = [n.upper() for n in ServerSettings.model_fields]
    known = set(settings) | set(OTHER_VARIABLES)
    out = []
    for key in sorted(environ):
        upper = key.upper()  # settings are read case-insensitively
        if not upper.startswith(ENV_PREFIX) or upper[len(ENV_PREFIX):] in known \
                or CAMERA_SECRET.match(upper[len(ENV_PREFIX):]):
            continue
        removed = REMOVED_SETTINGS.get(upper[len(ENV_PREFIX):])
        if removed is not None:
            out.append(f"{key}: this setting was removed and is ignored ({removed})")
            continue
        near = difflib.get_close_matches(upper[len(ENV_PREFIX):], settings, n=1, cutoff=0.6)
        hint = (f"; did you mean {ENV_PREFIX}{near[0]} (--{near[0].lower().replace('_', '-')})?"
                if near else " (docs/settings.md lists the settings)")
        out.append(f"{key} is not a visionserve setting and is ignored{hint}")
    return out
