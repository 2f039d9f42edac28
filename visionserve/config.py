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
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
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
        1, ge=1, le=16, description="Runner threads (model instances) per device.")
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


class ServerSettings(BaseSettings):
    """Every ``visionserve serve`` option; each is also ``VISIONSERVE_<NAME>`` in the
    environment."""

    model_config = SettingsConfigDict(env_prefix="VISIONSERVE_", extra="ignore", frozen=True)

    host: str = Field(
        "0.0.0.0", description="Address to bind (0.0.0.0: all interfaces, for line PCs on the "
                               "network).")
    http_port: int = Field(
        8000, ge=0, le=65535, description="HTTP port (OIP v2, inspect API, /metrics).")
    grpc_port: int = Field(8001, ge=-1, le=65535, description="gRPC port; -1 disables gRPC.")
    models: Path = Field(default_factory=default_models_dir, description="Model repository folder.",
                         json_schema_extra={"default_text": "shipped default model, else ./models"})
    model_control_mode: Literal["none", "poll", "explicit"] = Field(
        "none", description="Changing the served models while the server runs (Triton's model "
        "repository extension, docs/triton-compat.md): none: the models of the start are served "
        "until it stops, load/unload calls are refused (409); explicit: POST "
        "/v2/repository/models/{m}/load and .../unload (and the gRPC calls) load, swap and "
        "unload models; poll: the repository folder is read again every "
        "--repository-poll-secs, and a model whose model.toml or version files changed is "
        "swapped (a removed folder is unloaded). A swap loads and warms up the new versions beside "
        "the old, then switches traffic at once; frames already admitted finish on the old.")
    load_model: str | None = Field(
        None, description="With --model-control-mode explicit: the models loaded at start-up, "
                          "comma-separated (unset: every model of the repository; Triton would "
                          "load none). The others are loaded by a load call.")
    repository_poll_secs: float = Field(
        15.0, gt=0, le=86_400, description="With --model-control-mode poll: seconds between two "
                                           "reads of the model repository.")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N | GPU-<uuid> | PCI bus id.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Log level.")
    log_json: bool = Field(False, description="Structured JSON log lines.")
    max_body_bytes: int = Field(64 * 1024**2, ge=1024, description="Largest request body (bytes).")
    max_json_body_bytes: int = Field(
        16 * 1024**2, ge=1024, description="Largest OIP JSON inference request, or JSON header "
                                           "of a binary one (bytes); binary tensors and images "
                                           "are limited by max_body_bytes.")
    max_image_pixels: int = Field(
        40_000_000, ge=64, description="Largest decoded image (width*height).")
    max_batch_size: int | None = Field(
        None, ge=1, description="Override every model's batching.max_batch_size.")
    max_queue_delay_ms: float | None = Field(
        None, ge=0, description="Override batching.max_queue_delay_ms.")
    max_queue_size: int | None = Field(None, ge=1, description="Override batching.max_queue_size.")
    takt_ms: float | None = Field(
        None, gt=0, description="Override batching.takt_ms (default deadline).")
    drain_timeout_s: float = Field(
        20.0, ge=0, description="On SIGTERM: how long queued requests may finish.")
    hold_on_error: bool = Field(
        False, description="When start-up fails (no or unreadable model repository, a model that "
                           "does not load): say why once, then stay up serving nothing until "
                           "stopped (exit 2 or 3 then) instead of exiting at once. For containers "
                           "under a restart policy, which would otherwise restart into the same "
                           "error over and over; the image sets it, and its health check shows the "
                           "container unhealthy.")
    gpu_memory_budget: str | None = Field(
        None, description="GPU memory the server reserves, e.g. 4GiB.")
    grpc_max_message_bytes: int = Field(64 * 1024**2, ge=1024, description="Largest gRPC message.")
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body must arrive within this (slow clients get 408).")
    min_body_rate_bytes_s: float = Field(
        16384.0, ge=0, description="A request body slower than this on average (bytes/s, after "
                                   "its first 2 s) gets 408 and its connection closed; 0: no "
                                   "minimum.")
    header_timeout_s: float = Field(
        5.0, gt=0, le=300,
        description="A request's head (request line and headers) must arrive within this, from the "
                    "connection's start or the request's first byte; slower connections are closed "
                    "(slowloris).")
    max_connections: int | None = Field(
        1000, ge=1, description="Open HTTP connections per process. When full, the one waiting "
                                "longest for a request head (then the longest idle) is closed to "
                                "make room; when every one has a request in progress, new requests "
                                "get 503 with Retry-After (health checks are still answered).")
    auth_token: str | None = Field(
        None, description="Require 'Authorization: Bearer <token>' (HTTP) / 'authorization' "
                          "metadata (gRPC).")
    auth_token_file: Path | None = Field(
        None, description="Read the bearer token from this file instead.")
    auth_health_open: bool = Field(True, description="Health endpoints stay open when auth is on.")
    auth_metrics_open: bool = Field(
        True, description="/metrics stays open when auth is on, for Prometheus scrapers that send "
                          "no token (the Kubernetes scrape annotations). It shows model names and "
                          "traffic, no frames.")
    admin_token: str | None = Field(
        None, description="The token protected routes (state changes, guard jobs, records, API "
                          "docs: docs/security.md) need off a loopback bind. Unset: made at the "
                          "first start in $XDG_DATA_HOME/visionserve/admin-token.")
    admin_token_file: Path | None = Field(
        None, description="Read the admin token from this file instead (a mounted secret).")
    allowed_hosts: str = Field(
        "", description="Names, besides localhost, this machine's names and the bind address, "
                        "that protected requests may give in Host (comma-separated; * any). IP "
                        "addresses always pass.")
    allowed_origins: str = Field(
        "", description="Web origins (http://name:port, comma-separated; * any) besides the "
                        "server's own that may call protected routes. Default: none.")
    trusted_proxies: str = Field(
        "", description="Reverse proxies (addresses or networks, comma-separated) whose "
                        "X-Forwarded-For/-Proto give the client's address. Default: none, the "
                        "headers are ignored.")
    api_docs: bool = Field(
        False, description="Serve the API pages /docs, /redoc and /openapi.json (protected "
                           "routes; the pages load their scripts from a CDN).")
    tls_cert: Path | None = Field(
        None, description="PEM certificate: serve HTTPS and gRPC over TLS.")
    tls_key: Path | None = Field(None, description="PEM private key for --tls-cert.")
    switch_interval_ms: float | None = Field(
        None, gt=0, le=100,
        description="Python's thread switch interval in the serving process: how long one thread "
                    "(the busy event loop) may hold the interpreter while the decode/compute "
                    "threads wait for it. Default: 0.5 ms with the front end in this process, "
                    "whose loop parses HTTP in long stretches of Python that starved the runner "
                    "threads at Python's own 5 ms; 5 ms with --frontends, where the loop lets go "
                    "of the interpreter at every I/O callback and forced switches only cost; "
                    "there, below saturation, the p99.9 comes about 5 ms later (docs/gpu.md).")
    load_switch_interval_ms: float = Field(
        0.05, gt=0, le=100,
        description="Python's thread switch interval while a model version loads beside the "
                    "serving ones: deserialising a model is pure Python, and each time a serving "
                    "thread wants the interpreter back it waits up to this long for the loading "
                    "thread to let go of it (docs/gpu.md, swaps under load).")
    isolated_loads: bool = Field(
        True,
        description="Read a model file that is slow to read in Python (a torch.export program) "
                    "in a child process when the version loads beside serving ones (a swap): "
                    "reading ResNet-50's program in the serving process held frames for up to a "
                    "second (docs/benchmarks.md, model swaps on the H200). Start-up reads in "
                    "the serving process.")
    gpu_prep_one_call: bool = Field(
        True,
        description="On the GPU, prepare a batch of JPEGs of one size (decode, resize, "
                    "normalise) in one TorchScript call that releases the interpreter once, "
                    "instead of some 40 torch calls that each wait behind the busy event loop "
                    "to take it back (docs/gpu.md). Other batches take the eager path.")
    frontend_zero_copy: bool = Field(
        False,
        description="With --frontends: the engine reads each frame where its front end wrote "
                    "it (the shared-memory arena) instead of copying it out first, and the front "
                    "end reuses the space once the engine has let the frame go, not at its "
                    "answer. The copy holds the serving process's interpreter: 22% of its event "
                    "loop's time at 1080p saturation on the H200 (docs/gpu.md). Off: with "
                    "--gpu-graph-fetch, no gain measurable on the H200 (docs/benchmarks.md, "
                    "session 18).")
    gpu_graph_fetch: bool = Field(
        False,
        description="On the GPU (torch backend), capture the copies of the model's outputs to "
                    "the host in its CUDA graphs, so that a batch costs the compute thread three "
                    "torch calls instead of five, each a wait behind the busy event loop to take "
                    "the interpreter back (docs/gpu.md). Checked at warm-up: a graph whose "
                    "captured copy does not work is served with the copy after it. Off: with "
                    "--frontend-zero-copy, no gain measurable on the H200 (docs/benchmarks.md, "
                    "session 18).")
    gpu_cudnn_autotune: bool = Field(
        False,
        description="On the GPU (torch backend), time the convolution kernels cuDNN offers for "
                    "each preferred batch size at warm-up and capture the CUDA graphs with the "
                    "fastest (cuDNN's benchmark mode, on for the warm-up only), instead of its "
                    "heuristic's first choice. It adds seconds to a load, and the kernels it "
                    "picks may round differently from the heuristic's (scores within the "
                    "agreement tolerance of docs/gpu.md). Off: for a ResNet-50 on an H100 the "
                    "tuned kernels were no faster than the heuristic's (docs/gpu.md, \"cuDNN's "
                    "kernels\").")
    gpu_prep_processes: int = Field(
        0, ge=0, le=8,
        description="On the GPU, this many worker processes per model instance prepare its "
                    "batches (decode, resize, normalise) into device buffers the serving process "
                    "holds, instead of the instance's thread in the serving process (0): their "
                    "interpreters do nothing else, and each has a JPEG decoder of its own (one "
                    "process has one, behind a lock). A worker that fails is logged and the "
                    "others, or the serving process, prepare its batches. The event loop sends "
                    "the batches and reads the answers, so no thread of the serving process "
                    "waits for the interpreter to prepare one. Slower than 0 on the H200 in "
                    "both designs measured (this one: 0.34-0.37x the bare model at 640x480 "
                    "against 0.40-0.46x), so 0 (docs/benchmarks.md, session 19).")
    gpu_batch_processes: int = Field(
        0, ge=0, le=8,
        description="On the GPU, this many worker processes per model instance prepare and run "
                    "its batches (decode, resize, normalise, the model), each with the model "
                    "loaded and its CUDA graphs captured, and answer with the model's outputs; "
                    "the event loop sends the frames and reads the outputs, and the serving "
                    "process only applies the task's postprocessing. The batcher gives each "
                    "worker two batches, and a third only when it is full. A batch that finds "
                    "the instance idle (a lone frame) runs in the serving process, which saves "
                    "it the workers' socket hops. On an H100 (docs/benchmarks.md, session 21): "
                    "1 gave 0.58-0.62x the bare model at 640x480 and 192 clients against "
                    "0.42-0.44x in-process, 3 gave 0.67x at 640x480 and 0.41x at 1080p with 288 "
                    "clients; 0 until the GPU frame-integrity test and a comparison have run "
                    "with workers as the default (docs/gpu.md). Each worker's "
                    "allocator (the model, its graphs, one batch's preparation) comes out of "
                    "--gpu-memory-budget, beside the instance the serving process still loads; "
                    "where the budget cannot hold them the instance serves in-process (a "
                    "warning says so), and a worker that fails is logged and the serving process "
                    "prepares and runs its batches. Its CUDA context is outside the budget, as "
                    "the serving process's is. Not for tasks that read their outputs on the "
                    "device (detection's NMS). 0: in the serving process. Excludes "
                    "--gpu-prep-processes.")
    recipes: Path | None = Field(
        None, description="The recipes file: each product variant's model, version and verdict "
                          "settings, and the stations that run them (docs/recipes.md). Default: "
                          "recipes.toml in the model repository, when there is one.")
    worker_nice: int = Field(
        5, ge=0, le=19,
        description="Nice levels below the event loop for the model's threads in the serving "
                    "process (decode, compute, the runtime's thread pools; Linux): when the "
                    "loop wakes up for a request it runs first instead of waiting for a core "
                    "behind them. 0: all threads at one priority.")
    frontends: int = Field(
        0, ge=0, le=64,
        description="HTTP/gRPC front-end processes handing frames to this process's engine through "
                    "shared memory (one batch queue per model still); 0: the front end runs in the "
                    "engine process. Use several when one process cannot parse requests as fast as "
                    "the GPU serves them.")
    frontend_arena_bytes: int = Field(
        64 * 1024**2, ge=1024**2,
        description="Shared memory per front-end process for frames in flight; a frame that does "
                    "not fit travels in the message instead (slower, never refused).")
    guard: bool = Field(
        False, description="Also host the training-queue guard (and /v1/guard/jobs, which runs "
                           "commands: a protected route, docs/security.md).")
    guard_db: Path | None = Field(
        None, description="The guard's SQLite database (default: VISIONSERVE_GUARD_DB, else "
        "$XDG_DATA_HOME/visionserve/guard.sqlite, i.e. ~/.local/share/visionserve/guard.sqlite: "
        "the same one `visionserve guard` uses).")
    guard_latency_budget_ms: float | None = Field(
        None, gt=0, description="With --guard: pause running training jobs while the served p99 of "
                                "the last second is over this (ms); they resume under 80% of it. "
                                "Default: off.")
    guard_margin: str = Field(
        "1GiB", description="Safety margin the guard keeps above the server's budget.")
    guard_mps: bool = Field(
        True, description="With --guard on a GPU: share the GPU's time with training jobs through "
                          "CUDA MPS: the server and its jobs become clients of one MPS control "
                          "daemon (the one CUDA_MPS_PIPE_DIRECTORY names, else a private one "
                          "started and quit with the server), so their kernels run side by side, "
                          "each job on --guard-mps-job-sm-percent of the SMs at a lower client "
                          "priority and held to its declared memory. Where MPS cannot run, the "
                          "guard says why and jobs share by yielding; --no-guard-mps: never "
                          "(docs/guard.md).")
    guard_mps_job_sm_percent: int = Field(
        50, ge=1, le=100, description="With --guard-mps: the share of the GPU's SMs a training "
                                      "job's kernels may occupy (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE;"
                                      " a job's own value wins).")
    # --- results to the PLC (visionserve/plc, docs/plc.md) ---
    opcua: str | None = Field(
        None, description="Serve results to PLCs over OPC UA (OPC 40100 Machine Vision model) at "
                          "this endpoint, e.g. opc.tcp://0.0.0.0:4840. Default: off.")
    opcua_security: str = Field(
        "Basic256Sha256,Aes128Sha256RsaOaep",
        description="OPC UA security policies offered, comma-separated, each with Sign and "
                    "SignAndEncrypt: Basic256Sha256, Aes128Sha256RsaOaep; None (no security) only "
                    "when named.")
    opcua_anonymous: bool = Field(False, description="Let OPC UA clients in without a user name.")
    opcua_user: str | None = Field(None, description="The OPC UA user name PLCs log in with.")
    opcua_password_file: Path | None = Field(
        None, description="File holding --opcua-user's password.")
    modbus: str | None = Field(
        None, description="Serve results to PLCs over Modbus TCP at host:port, e.g. 0.0.0.0:5020 "
                          "(one unit id per station). Default: off.")
    plc_max_clients: int = Field(
        8, ge=1, le=256,
        description="PLC connections at once, per protocol (Modbus TCP, OPC UA). When all are "
                    "taken, a new one replaces one that never spoke or has long been idle.")
    plc_idle_timeout_s: float = Field(
        30.0, gt=0, le=3600,
        description="A Modbus connection that sends nothing for this long, or an OPC UA one "
                    "without an open session by then, is closed (default 30 s).")
    plc_stations: str = Field(
        "*", description="PLC stations, by camera id (X-Camera-Id, OIP parameter camera_id), "
                         "comma-separated; station N is OPC UA Station<N> and Modbus unit id N. "
                         "* takes every other camera and frames without one.")
    plc_buffer: int = Field(
        16, ge=1, le=1000,
        description="Results a Modbus station keeps until the PLC acknowledges them; one more "
                    "raises Fault.")
    plc_heartbeat_ms: float = Field(500.0, ge=10, le=60_000, description="The PLC heartbeat bit "
                                                                         "toggles at this period.")
    plc_watchdog_ms: float = Field(
        2000.0, ge=100, le=600_000,
        description="The engine counts as stalled (heartbeat stops, Fault) when frames have waited "
                    "this long with none computed, or its event loop has not run for this long.")
    plc_data_dir: Path | None = Field(
        None, description="Folder for the OPC UA server certificate (made on first start) and the "
                          "trusted/ and rejected/ client certificates (default "
                          "$XDG_DATA_HOME/visionserve/plc).")

    # --- traceability records and image capture (visionserve/records, docs/records.md) ---
    records: bool = Field(
        False, description="Keep a traceability record of every answered frame (part, station, "
                           "camera, time, model, version, verdict, scores or detections, timings, "
                           "request id), written off the hot path; GET /v1/parts/{part_id} reads "
                           "them.")
    records_dir: Path | None = Field(
        None, description="Folder of the records database (records.sqlite) and of captured "
                          "images (captures/) (default $XDG_DATA_HOME/visionserve).")
    records_url: str | None = Field(
        None, description="The record store: sqlite:///path/records.sqlite, or "
                          "postgresql://user@host/db (the records-pg extra; password from "
                          "PGPASSWORD or ~/.pgpass). Default: records.sqlite in --records-dir.")
    records_max_age_days: float = Field(
        365.0, gt=0, description="Records older than this are deleted.")
    records_max_bytes: str = Field(
        "10GiB", description="The record store's size limit: the oldest records are deleted past "
                             "it.")
    records_queue: int = Field(
        10_000, ge=100, le=10_000_000,
        description="Answered frames waiting for the record writer; past it records are dropped "
                    "and counted (visionserve_records_dropped_total), inference never waits.")
    capture: Literal["none", "ng", "uncertain", "sample", "all"] = Field(
        "none", description="Which frames are kept for retraining, with their record as a JSON "
                            "sidecar (needs --records): ng, uncertain (deciding score within "
                            "--capture-band of the threshold), sample (--capture-sample-percent "
                            "of frames), all.")
    capture_band: float = Field(
        0.1, gt=0, le=1, description="--capture uncertain: the band around the verdict's threshold "
                                     "(on the score's scale).")
    capture_sample_percent: float = Field(
        1.0, gt=0, le=100, description="--capture sample: the share of frames kept, in percent.")
    capture_target: str | None = Field(
        None, description="Where captured images go: a folder, or s3://bucket/prefix (the s3 "
                          "extra; endpoint --capture-s3-endpoint, credentials from "
                          "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY). Default: captures/ in "
                          "--records-dir.")
    capture_s3_endpoint: str | None = Field(
        None, description="The S3-compatible server of an s3:// target, e.g. "
                          "https://minio.plant:9000 (default: AWS S3).")
    capture_quota: str = Field(
        "20GiB", description="A capture folder's size limit: the oldest images are deleted past "
                             "it, so a full disk never stops the line.")
    capture_queue: int = Field(
        256, ge=1, le=100_000,
        description="Captured images waiting to be written; past it images are dropped and "
                    "counted, inference never waits.")

    @field_validator("guard_margin", "records_max_bytes", "capture_quota")
    @classmethod
    def _margin(cls, v: str) -> str:
        parse_bytes(v)
        return v

    @model_validator(mode="after")
    def _capture_needs_records(self) -> ServerSettings:
        if self.capture != "none" and not self.records:
            raise ValueError(f"capture {self.capture!r} needs records on (--records): each "
                             "captured image carries its record")
        return self

    @model_validator(mode="after")
    def _one_kind_of_worker(self) -> ServerSettings:
        if self.gpu_batch_processes and self.gpu_prep_processes:
            raise ValueError("gpu_batch_processes and gpu_prep_processes exclude each other: "
                             "the first prepares and runs the batches in worker processes, the "
                             "second only prepares them there")
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
                              tuple(map(str, choices))))
    return out


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A warning for each ``VISIONSERVE_*`` variable that is no setting (pydantic-settings ignores
    them silently: a typo would leave the default in force), naming the nearest setting."""
    settings = [n.upper() for n in ServerSettings.model_fields]
    known = set(settings) | set(OTHER_VARIABLES)
    out = []
    for key in sorted(environ):
        upper = key.upper()  # settings are read case-insensitively
        if not upper.startswith(ENV_PREFIX) or upper[len(ENV_PREFIX):] in known:
            continue
        near = difflib.get_close_matches(upper[len(ENV_PREFIX):], settings, n=1, cutoff=0.6)
        hint = (f"; did you mean {ENV_PREFIX}{near[0]} (--{near[0].lower().replace('_', '-')})?"
                if near else " (docs/settings.md lists the settings)")
        out.append(f"{key} is not a visionserve setting and is ignored{hint}")
    return out
