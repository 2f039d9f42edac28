"""Protobuf <-> plain values for the OIP v2 gRPC service. Semantics live in :mod:`visionserve.oip`.

The message classes are the ones generated from Triton's ``grpc_service.proto`` and shipped in
``tritonclient.grpc``; using them (instead of a hand-kept copy of the proto) keeps us wire-identical
to what tritonclient and perf_analyzer expect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2

from .. import oip
from ..errors import InvalidInput

if TYPE_CHECKING:
    from collections.abc import Sequence

    from ..dataplane import ServedModel
    from ..execution.results import FrameResult
    from ..imaging import Frame

pb = service_pb2


def parameter_value(p: service_pb2.InferParameter) -> Any:
    """The value of whichever member of the ``InferParameter`` oneof is set (None if none)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def parameters(params) -> dict[str, Any]:
    return {k: parameter_value(v) for k, v in params.items()}


def deadline_ms(param_ms: float | None, time_remaining_s: float | None) -> float | None:
    """The request's deadline: the ``timeout`` parameter, or the client's gRPC deadline when
    tighter.

    A gRPC deadline that has already passed becomes a tiny positive budget, so the engine answers
    DEADLINE_EXCEEDED the usual way instead of refusing the value as out of range.
    """
    if time_remaining_s is None:
        return param_ms
    grpc_ms = max(time_remaining_s * 1000.0, 1e-3)
    if param_ms is None or grpc_ms < param_ms:
        return grpc_ms
    return param_ms


def frames(served: ServedModel, request: service_pb2.ModelInferRequest,
           max_pixels: int) -> list[Frame]:
    """The frames of a ModelInferRequest: inputs in ``raw_input_contents`` or typed ``contents``."""
    if len(request.inputs) != 1:
        raise InvalidInput(f"model {served.name} takes exactly one input "
                           f"({served.config.input.name!r}), got {len(request.inputs)}")
    inp = request.inputs[0]
    shape = list(inp.shape)
    oip.check_input(served, inp.name, inp.datatype, shape)
    raw = request.raw_input_contents
    if raw:
        if len(raw) != len(request.inputs):
            raise InvalidInput(f"{len(raw)} raw_input_contents for {len(request.inputs)} input(s)")
        if _has_contents(inp):
            raise InvalidInput(f"input {inp.name!r} has both raw_input_contents and typed contents")
        data = raw[0]
        if inp.datatype == "BYTES":
            return oip.frames_from_bytes(oip.deserialize_bytes(data), [shape[0]], max_pixels)
        expected = oip.byte_size("UINT8", shape)
        if len(data) != expected:
            raise InvalidInput(f"UINT8 input of shape {shape} needs {expected} bytes, got "
                               f"{len(data)}")
        return oip.frames_from_uint8(data, shape, max_pixels)
    if not _has_contents(inp):
        raise InvalidInput(f"input {inp.name!r} carries no data (neither raw_input_contents nor "
                           "contents)")
    if inp.datatype == "BYTES":
        return oip.frames_from_bytes(list(inp.contents.bytes_contents), [shape[0]], max_pixels)
    values = np.asarray(inp.contents.uint_contents, dtype=np.uint32)
    if values.size and int(values.max()) > 255:
        raise InvalidInput("UINT8 contents must be integers 0..255")
    return oip.frames_from_uint8(values.astype(np.uint8), shape, max_pixels)


def _has_contents(inp: service_pb2.ModelInferRequest.InferInputTensor) -> bool:
    return inp.HasField("contents") and inp.contents.ByteSize() > 0


def infer_response(served: ServedModel, results: list[FrameResult], names: list[str],
                   request_id: str, parameters: dict[str, str] | None = None
                   ) -> service_pb2.ModelInferResponse:
    """All requested outputs in ``raw_output_contents`` (what Triton does over gRPC)."""
    tensors = oip.outputs(served, results)
    response = pb.ModelInferResponse(model_name=served.name, model_version=str(served.version),
                                     id=request_id)
    for key, value in (parameters or {}).items():
        response.parameters[key].string_param = value
    for name in names:
        datatype, shape, arr = tensors[name]
        response.outputs.add(name=name, datatype=datatype, shape=shape)
        response.raw_output_contents.append(oip.tensor_bytes(datatype, arr))
    return response


def server_metadata() -> service_pb2.ServerMetadataResponse:
    return json_format.ParseDict(oip.server_metadata(), pb.ServerMetadataResponse())


def model_metadata(served: ServedModel) -> service_pb2.ModelMetadataResponse:
    return json_format.ParseDict(oip.model_metadata(served), pb.ModelMetadataResponse())


def model_config(served: ServedModel) -> service_pb2.ModelConfigResponse:
    config = json_format.ParseDict(oip.model_config(served), model_config_pb2.ModelConfig())
    return pb.ModelConfigResponse(config=config)


def model_statistics(served: Sequence[ServedModel]) -> service_pb2.ModelStatisticsResponse:
    body = {"model_stats": [oip.model_statistics(s) for s in served]}
    return json_format.ParseDict(body, pb.ModelStatisticsResponse())
