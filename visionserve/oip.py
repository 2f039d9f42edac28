"""Open Inference Protocol v2 semantics shared by the HTTP and gRPC front ends.

Wire-format free: the front ends turn JSON / protobuf into the plain values taken here. Vision
models expose one input, and the outputs of their task:

* input ``image``: ``BYTES`` of shape ``[N]`` (or ``[N, 1]``), each element one encoded image
  file (JPEG/PNG/BMP), or ``UINT8`` of shape ``[N, H, W, C]`` raw pixels (RGB, or grey if C=1);
* outputs: those the model's task declares (:mod:`visionserve.tasks`; classification: ``scores``
  ``FP32 [N, num_labels]``, ``label`` ``BYTES [N]``), then ``verdict`` ``BYTES [N]``.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from . import __version__, imaging
from .backends.base import backend_class
from .dataplane import Origin
from .errors import InvalidInput
from .imaging import Frame
from .tasks import VERDICT, OipOutput

if TYPE_CHECKING:
    from .dataplane import Route, ServedModel
    from .execution.results import FrameResult
    from .tasks import Task

EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics", "schedule_policy",
              "health", "metadata", "model_repository"]

DTYPE_SIZES = {"BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2,
               "INT32": 4, "INT64": 8, "FP16": 2, "FP32": 4, "FP64": 8, "BF16": 2, "BYTES": -1}


def server_metadata() -> dict[str, Any]:
    return {"name": "visionserve", "version": __version__, "extensions": list(EXTENSIONS)}


def _task(served: ServedModel) -> Task:
    assert served.task is not None  # every served version has its task (made when it loads)
    return served.task


def output_specs(served: ServedModel) -> tuple[OipOutput, ...]:
    """The model's OIP outputs: its task's, then ``verdict``."""
    return (*_task(served).oip_outputs(), VERDICT)


def model_metadata(served: ServedModel) -> dict[str, Any]:
    cfg = served.config
    return {
        "name": served.name,
        "versions": [str(v) for v in sorted(served.entry.versions)],
        "platform": backend_class(cfg.runtime.backend).platform,
        # Triton convention for a batching model: [-1] + the config's dims ([1]); perf_analyzer
        # drops the first dim as the batch and needs what remains to be non-empty.
        "inputs": [{"name": cfg.input.name, "datatype": "BYTES", "shape": [-1, 1]}],
        "outputs": [{"name": o.name, "datatype": o.datatype, "shape": [-1, *o.dims]}
                    for o in output_specs(served)],
    }


def _config_output(o: OipOutput) -> dict[str, Any]:
    """One output in Triton's model configuration: one value per frame is dims [1] reshaped
    to [] (as Triton shows a batching model's scalar outputs)."""
    kind = "STRING" if o.datatype == "BYTES" else o.datatype
    out: dict[str, Any] = {"name": o.name, "data_type": f"TYPE_{kind}"}
    if o.dims:
        return {**out, "dims": list(o.dims), "label_filename": ""}
    return {**out, "dims": [1], "reshape": {"shape": []}}


def model_config(served: ServedModel) -> dict[str, Any]:
    """Triton's model configuration shape (what perf_analyzer and Triton tools read)."""
    cfg = served.config
    b = cfg.batching
    return {
        "name": served.name,
        "platform": backend_class(cfg.runtime.backend).platform,
        "backend": cfg.runtime.backend,
        "version_policy": {"specific": {"versions": [str(v)
                                                     for v in sorted(served.entry.versions)]}},
        "max_batch_size": b.max_batch_size,
        "input": [{"name": cfg.input.name, "data_type": "TYPE_STRING", "format": "FORMAT_NONE",
                   "dims": [1], "reshape": {"shape": []}}],
        "output": [_config_output(o) for o in output_specs(served)],
        "dynamic_batching": {
            "preferred_batch_size": list(b.preferred_batch_sizes),
            "max_queue_delay_microseconds": int(b.max_queue_delay_ms * 1000),
            "preserve_ordering": True,
            "priority_levels": b.priority_levels,
            "default_priority_level": b.priority_levels // 2,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": int(b.takt_ms * 1000),
                "allow_timeout_override": True,
                "max_queue_size": b.max_queue_size,
            },
        },
        "instance_group": [{"count": cfg.runtime.instances,
                            "kind": "KIND_GPU"
                            if served.backend_info.get("device", "cpu").startswith("cuda")
                            else "KIND_CPU"}],
        "parameters": {k: {"string_value": v} for k, v in
                       {**_task(served).oip_parameters(), "takt_ms": str(b.takt_ms)}.items()},
    }


def _duration(d) -> dict[str, int]:
    return {"count": d.count, "ns": d.ns}


def model_statistics(served: ServedModel) -> dict[str, Any]:
    st = served.stats
    return {
        "name": served.name,
        "version": str(served.version),
        "last_inference": st.last_inference_ms,
        "inference_count": st.inference_count,
        "execution_count": st.execution_count,
        "inference_stats": {
            "success": _duration(st.success), "fail": _duration(st.fail),
            "queue": _duration(st.queue), "compute_input": _duration(st.compute_input),
            "compute_infer": _duration(st.compute_infer),
            "compute_output": _duration(st.compute_output),
            "cache_hit": {"count": 0, "ns": 0}, "cache_miss": {"count": 0, "ns": 0},
        },
        "batch_stats": [
            {"batch_size": size, "compute_input": _duration(i), "compute_infer": _duration(f),
             "compute_output": _duration(o)}
            for size, (i, f, o) in sorted(st.batch.items())
        ],
    }


def parameters(params: dict[str, Any] | None) -> tuple[float | None, int | None]:
    """OIP request parameters -> (deadline in ms, priority). ``timeout`` is in microseconds."""
    params = params or {}
    deadline_ms = priority = None
    if "timeout" in params and params["timeout"] not in (None, 0):
        t = params["timeout"]
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise InvalidInput(f"parameter 'timeout' must be a number of microseconds, got {t!r}")
        deadline_ms = float(t) / 1000.0
    if "priority" in params and params["priority"] not in (None, 0):
        p = params["priority"]
        if isinstance(p, bool) or not isinstance(p, int):
            raise InvalidInput(f"parameter 'priority' must be an integer, got {p!r}")
        priority = p
    return deadline_ms, priority


def route(engine, model: str, version: str, params: dict[str, Any] | None) -> Route:
    """Where an OIP request goes: parameter ``station_id`` (else ``camera_id``, when a station
    lists it) makes it a station's, decided under the recipe the station runs
    (:meth:`~visionserve.dataplane.ModelLookup.route`)."""
    params = params or {}
    station, camera = params.get("station_id"), params.get("camera_id")
    return engine.route(model, version, str(station) if station not in (None, "") else None,
                        str(camera) if camera not in (None, "") else None)


def answer_parameters(route: Route) -> dict[str, str]:
    """What an OIP answer says of its station and recipe (nothing for a frame of none)."""
    return {} if route.station is None else {"station_id": route.station,
                                             "recipe": route.recipe or ""}


def origin(params: dict[str, Any] | None, request_id: str | None,
           route: Route | None = None) -> Origin:
    """Part id, camera id, station id and recipe for the PLC result bus and the part's record:
    parameters ``part_id`` (else the request id), ``camera_id`` and ``station_id`` (the station
    the route found, else the parameter), what the inspect API's X-Part-Id, X-Camera-Id and
    X-Station-Id headers carry; the recipe the route decided under."""
    params = params or {}
    part = _text(params.get("part_id")) or request_id or None
    station = (route.station if route is not None else None) or _text(params.get("station_id"))
    return Origin(part, _text(params.get("camera_id")), station,
                  route.recipe if route is not None else None)


def _text(value: Any) -> str | None:
    return str(value) if value not in (None, "") else None


def check_input(served: ServedModel, name: str, datatype: str, shape: list[int]) -> None:
    want = served.config.input.name
    if name != want:
        raise InvalidInput(f"unknown input {name!r}; model {served.name} takes one input named "
                           f"{want!r}")
    if datatype not in ("BYTES", "UINT8"):
        raise InvalidInput(f"input {name!r} has datatype {datatype}; send BYTES (encoded images) "
                           "or UINT8 [N,H,W,C] (raw pixels)")
    if any((not isinstance(d, int)) or isinstance(d, bool) or d < 0 for d in shape):
        raise InvalidInput(f"input {name!r} shape {shape} has a bad dimension")
    if datatype == "BYTES" and not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
        raise InvalidInput(f"BYTES input {name!r} must have shape [N] (one encoded image per "
                           f"element), got {shape}")
    if datatype == "UINT8" and len(shape) != 4:
        raise InvalidInput(f"UINT8 input {name!r} must have shape [N,H,W,C], got {shape}")
    if shape[0] < 1:
        raise InvalidInput(f"input {name!r} holds no frame (shape {shape})")


def byte_size(datatype: str, shape: list[int]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[datatype]


def frames_from_bytes(elements: list[bytes], shape: list[int], max_pixels: int) -> list[Frame]:
    if len(elements) != shape[0]:
        raise InvalidInput(f"input shape {shape} declares {shape[0]} images but {len(elements)} "
                           "were sent")
    return [_encoded(e, i, max_pixels) for i, e in enumerate(elements)]


def _encoded(data: bytes, index: int, max_pixels: int) -> Frame:
    try:
        return imaging.encoded_frame(data, max_pixels=max_pixels)
    except InvalidInput as exc:
        raise InvalidInput(f"image {index}: {exc.message}") from None


def frames_from_uint8(pixels: bytes | np.ndarray, shape: list[int], max_pixels: int) -> list[Frame]:
    n, h, w, c = shape
    arr = np.frombuffer(pixels, dtype=np.uint8) \
        if isinstance(pixels, (bytes, bytearray, memoryview)) else np.asarray(pixels)
    if arr.size != n * h * w * c:
        raise InvalidInput(f"UINT8 input holds {arr.size} values but shape {shape} needs "
                           f"{n * h * w * c}")
    arr = arr.reshape(n, h, w, c)
    return [imaging.raw_frame(arr[i], (h, w, c), max_pixels=max_pixels) for i in range(n)]


def json_elements_to_bytes(data: list[Any]) -> list[bytes]:
    """JSON BYTES elements: base64 strings of image files (JSON cannot carry raw binary)."""
    import base64
    import binascii

    out = []
    for i, item in enumerate(_flatten(data)):
        if not isinstance(item, str):
            raise InvalidInput(f"BYTES element {i} must be a base64 string of an image file")
        try:
            out.append(base64.b64decode(item, validate=True))
        except (binascii.Error, ValueError):
            raise InvalidInput(f"BYTES element {i} is not valid base64 (JSON requests carry images "
                               "as base64; or use the binary tensor extension)") from None
    return out


_UINT8_RANGE = "UINT8 data must be integers 0..255"


#: JSON is parsed and converted in pieces of about this size: json.loads and numpy hold the GIL for
#: a whole call, so a 16 MB tensor in one call held the event loop for half a second (health
#: checks and every other request waited); between pieces the loop gets its turn
JSON_PIECE_BYTES = 256 * 1024
_DATA_OPEN = re.compile(rb'"data"\s*:\s*\[')
_NUMBER_CHARS = b"0123456789,- \t\r\n"


def loads_request(doc: bytes) -> tuple[Any, list[np.ndarray]]:
    """``json.loads(doc)`` of an inference request, in pieces where it matters: each long flat
    array of integers under a ``"data"`` key (what a JSON UINT8 tensor is) is taken out of the
    document, in its place a marker ``[-1, index]``, and parsed in pieces (each a separate call)
    into the int64 array at that index. :func:`fill_in` puts them back."""
    if len(doc) <= JSON_PIECE_BYTES:
        return json.loads(doc), []
    parts: list[bytes | memoryview] = []
    arrays: list[memoryview] = []
    pos = 0
    view = memoryview(doc)
    for m in _DATA_OPEN.finditer(doc):
        start = m.end()
        end = doc.find(b"]", start)
        if start < pos or end - start < JSON_PIECE_BYTES or not _numbers_only(view[start:end]):
            continue
        parts += [view[pos:start], b"-1,%d" % len(arrays)]
        arrays.append(view[start:end])
        pos = end
    if not arrays:
        return json.loads(doc), []
    parts.append(view[pos:])
    return json.loads(b"".join(parts)), [_int_array(a) for a in arrays]


def fill_in(inputs: list[Any], arrays: list[np.ndarray]) -> bool:
    """Put the arrays of :func:`loads_request` back where their markers are (each input's
    ``data``); False when a marker is not found in an input's data (the caller parses the whole
    document instead)."""
    found = 0
    for inp in inputs:
        data = inp.data
        if isinstance(data, list) and len(data) == 2 and data[0] == -1 \
                and type(data[1]) is int and 0 <= data[1] < len(arrays):
            inp.data = arrays[data[1]]
            found += 1
    return found == len(arrays)


def _numbers_only(text: memoryview) -> bool:
    return all(not bytes(text[i:i + JSON_PIECE_BYTES]).translate(None, _NUMBER_CHARS)
               for i in range(0, len(text), JSON_PIECE_BYTES))


def _int_array(text: memoryview) -> np.ndarray:
    """The integers of a JSON array's inside (digits, commas, minus signs, spaces), in pieces."""
    raw = text.tobytes()
    pieces, pos = [], 0
    while pos <= len(raw):
        cut = raw.find(b",", pos + JSON_PIECE_BYTES)
        cut = len(raw) if cut < 0 else cut
        try:
            values = json.loads(b"[" + raw[pos:cut] + b"]")
            pieces.append(np.array(values, dtype=np.int64))
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"malformed JSON tensor data: {exc.msg}") from None
        except OverflowError:  # past int64: no pixel value either
            raise InvalidInput(_UINT8_RANGE) from None
        pos = cut + 1
    return np.concatenate(pieces)


def json_uint8(data: list[Any] | np.ndarray, shape: list[int]) -> np.ndarray:
    if isinstance(data, np.ndarray):  # parsed already (loads_request)
        if data.size and (data.min() < 0 or data.max() > 255):
            raise InvalidInput(_UINT8_RANGE)
        return data.astype(np.uint8)
    # tritonclient sends the flat row-major list: take it as it is (a 640x480x3 frame is 921,600
    # elements, and walking them one by one in Python cost 150 ms); nested arrays are flattened
    flat = data if isinstance(data, list) and data and type(data[0]) is not list else _flatten(data)
    kinds = set(map(type, flat))
    if list in kinds:
        flat = _flatten(data)
        kinds = set(map(type, flat))
    if not kinds <= {int}:  # bool is an int subclass: refuse it too
        raise InvalidInput(_UINT8_RANGE)
    try:
        arr = np.array(flat, dtype=np.int64)
    except OverflowError:  # a value past the int64 range (2**63 and up): no pixel either
        raise InvalidInput(_UINT8_RANGE) from None
    if arr.size and (arr.min() < 0 or arr.max() > 255):
        raise InvalidInput(_UINT8_RANGE)
    return arr.astype(np.uint8)


def _flatten(data: Any) -> list[Any]:
    if not isinstance(data, list):
        raise InvalidInput("tensor 'data' must be a JSON array")
    # a regular nested array (a row-major HxWxC image) level by level, in C
    level = data
    while level and type(level[0]) is list:
        if not all(type(v) is list for v in level):
            break  # lists and values mixed on one level: the general walk below
        level = list(itertools.chain.from_iterable(level))
    else:
        if not any(type(v) is list for v in level):
            return level
    out: list[Any] = []
    stack = [data]
    while stack:  # iterative, so a hostile deeply nested array cannot blow the stack
        cur = stack.pop()
        if isinstance(cur, list):
            stack.extend(reversed(cur))
        else:
            out.append(cur)
    return out


def outputs(served: ServedModel,
            results: list[FrameResult]) -> dict[str, tuple[str, list[int], np.ndarray]]:
    """name -> (datatype, shape, array) for every output: the task renders its own."""
    arrays = _task(served).oip_tensors([r.result for r in results])
    arrays[VERDICT.name] = np.array([r.verdict.encode() for r in results], dtype=object)
    return {o.name: (o.datatype, list(arrays[o.name].shape), arrays[o.name])
            for o in output_specs(served)}


def requested(served: ServedModel, names: list[str] | None) -> list[str]:
    known = [o.name for o in output_specs(served)]
    if not names:
        return known
    for name in names:
        if name not in known:
            raise InvalidInput(f"unknown output {name!r}; outputs are {known}")
    return names


def serialize_bytes(arr: np.ndarray) -> bytes:
    """BYTES tensor -> the binary form: each element a 4-byte little-endian length + bytes."""
    return b"".join(struct.pack("<I", len(e)) + e for e in arr.reshape(-1))


def tensor_bytes(datatype: str, arr: np.ndarray) -> bytes:
    """An output tensor's raw bytes, as the binary extension and gRPC's raw contents carry them."""
    return serialize_bytes(arr) if datatype == "BYTES" else np.ascontiguousarray(arr).tobytes()


def deserialize_bytes(buf: bytes | memoryview) -> list[bytes]:
    out, i, n = [], 0, len(buf)
    while i < n:
        if i + 4 > n:
            raise InvalidInput("binary BYTES tensor is truncated (incomplete length prefix)")
        (size,) = struct.unpack_from("<I", buf, i)
        i += 4
        if i + size > n:
            raise InvalidInput("binary BYTES tensor is truncated (element longer than the data)")
        out.append(bytes(buf[i:i + size]))
        i += size
    return out
