"""``inference.GRPCInferenceService``: the OIP v2 gRPC service. It only translates.

Every call goes to the same :class:`~visionserve.dataplane.DataPlane` as HTTP. Errors come from the
one table in :mod:`visionserve.errors`; anything unexpected is answered INTERNAL with a short
message, and its traceback goes to the log only.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from .. import oip
from ..errors import INTERNAL_MESSAGE, NotFound, VisionServeError, grpc_code, retry_after
from ..logs import new_request_id, request_id
from . import convert

if TYPE_CHECKING:
    from ..config import ServerSettings
    from ..dataplane import DataPlane

log = logging.getLogger(__name__)

pb = service_pb2
#: requests of one stream being answered at once; past it the stream is not read further, so
#: gRPC flow control pushes back on the client instead of memory growing
STREAM_INFLIGHT = 256


class InferenceServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, engine: DataPlane, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings

    # --- health and metadata -----------------------------------------------------------------

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=self.engine.live)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.engine.ready)

    async def ModelReady(self, request, context):
        # Unknown model or version: ready=false, not an error, so tritonclient's is_model_ready()
        # answers False over gRPC just as it does over HTTP (where it reads a 404 as False).
        try:
            ready = self.engine.model_ready(request.name, request.version)
        except NotFound:
            ready = False
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request, context):
        return convert.server_metadata()

    async def ModelMetadata(self, request, context):
        return await _call(context, lambda: convert.model_metadata(
            self.engine.get(request.name, request.version)))

    async def ModelConfig(self, request, context):
        return await _call(context, lambda: convert.model_config(
            self.engine.get(request.name, request.version)))

    async def ModelStatistics(self, request, context):
        async def statistics():
            return convert.model_statistics(
                await self.engine.statistics(request.name, request.version))

        return await _call(context, statistics)

    # --- model repository extension -----------------------------------------------------------

    async def RepositoryIndex(self, request, context):
        async def index():
            rows = await self.engine.repository_index(request.ready)
            return pb.RepositoryIndexResponse(
                models=[pb.RepositoryIndexResponse.ModelIndex(**row) for row in rows])

        return await _call(context, index)

    async def RepositoryModelLoad(self, request, context):
        async def load():
            await self.engine.load_model(request.model_name, convert.parameters(request.parameters),
                                         _caller(context))
            return pb.RepositoryModelLoadResponse()

        return await _call(context, load)

    async def RepositoryModelUnload(self, request, context):
        async def unload():
            await self.engine.unload_model(request.model_name,
                                           convert.parameters(request.parameters),
                                           _caller(context))
            return pb.RepositoryModelUnloadResponse()

        return await _call(context, unload)

    # --- inference ---------------------------------------------------------------------------

    async def ModelInfer(self, request, context):
        arrival = time.monotonic()
        return await _call(context, lambda: self._infer(request, arrival, context.time_remaining()),
                           request.id)

    async def _infer(self, request: service_pb2.ModelInferRequest, arrival: float,
                     time_remaining_s: float | None) -> service_pb2.ModelInferResponse:
        try:
            return await self._answer(request, arrival, time_remaining_s)
        except VisionServeError as exc:
            if not exc.counted:  # refused here, before the engine (which counts what it answers)
                self.engine.count_error(request.model_name, exc)
            raise

    async def _answer(self, request: service_pb2.ModelInferRequest, arrival: float,
                      time_remaining_s: float | None) -> service_pb2.ModelInferResponse:
        engine = self.engine
        params = convert.parameters(request.parameters)
        route = oip.route(engine, request.model_name, request.model_version, params)
        served = engine.get(route.model, route.version)
        frames = convert.frames(served, request, self.settings.max_image_pixels)
        names = oip.requested(served, [o.name for o in request.outputs] or None)
        param_ms, priority = oip.parameters(params)
        served, results = await engine.infer(
            route.model, route.version, frames,
            deadline_ms=convert.deadline_ms(param_ms, time_remaining_s), priority=priority,
            arrival=arrival, origin=oip.origin(params, request.id, route))
        return convert.infer_response(served, results, names, request.id,
                                      oip.answer_parameters(route))

    async def ModelStreamInfer(self, request_iterator, context) -> AsyncIterator[Any]:
        """One long-lived stream, many requests: each is answered as soon as its frames are done
        (so answers may come out of order; each carries its request id). A failed request is
        answered with ``error_message`` and the stream goes on."""
        answers: asyncio.Queue = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_INFLIGHT)
        tasks: set[asyncio.Task] = set()
        done_reading = object()
        stream_id = _request_id(context)

        async def answer(request: service_pb2.ModelInferRequest, arrival: float) -> None:
            request_id.set(request.id[:64] or stream_id)  # in this task's own context
            # the slot is given back once the answer is written (below), not when it is queued:
            # a client that reads slowly must hold the stream back, not grow this queue
            try:
                response = await self._infer(request, arrival, context.time_remaining())
                answers.put_nowait(pb.ModelStreamInferResponse(infer_response=response))
            except VisionServeError as exc:
                answers.put_nowait(_stream_error(request, exc.message))
            except Exception:
                log.exception("unhandled error in ModelStreamInfer (model %r)", request.model_name)
                answers.put_nowait(_stream_error(request, INTERNAL_MESSAGE))

        async def read() -> None:
            try:
                async for request in request_iterator:
                    arrival = time.monotonic()
                    await slots.acquire()
                    task = asyncio.create_task(answer(request, arrival))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                await answers.put(done_reading)

        reader = asyncio.create_task(read())
        try:
            while True:
                item = await answers.get()
                if item is done_reading:
                    break
                yield item  # resumes once gRPC has taken the message (flow control permitting)
                slots.release()
            await reader  # surfaces a failure to read the stream
        finally:
            # the client went away (or the server is stopping): its frames need not run
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


def _unimplemented(method: str):
    async def handler(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            f"visionserve does not implement {method} (supported extensions: "
                            f"{', '.join(oip.EXTENSIONS)})")

    handler.__name__ = method
    return handler


# Triton's shared-memory, trace and log RPCs: answered UNIMPLEMENTED with a clear
# message (the generated base class would raise NotImplementedError and log a traceback).
for _method in service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods:
    if _method.name not in InferenceServicer.__dict__:
        setattr(InferenceServicer, _method.name, _unimplemented(_method.name))


def _stream_error(request: service_pb2.ModelInferRequest, message: str) -> Any:
    """An error answer in the stream; it names the request (id, model) it belongs to."""
    return pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(
        model_name=request.model_name, model_version=request.model_version, id=request.id))


def _request_id(context: grpc.aio.ServicerContext, oip_id: str = "") -> str:
    """The id log lines name a call by: the client's ``x-request-id`` metadata, else the OIP
    request id, else a new one."""
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and value:
            return str(value)[:64]
    return oip_id[:64] or new_request_id()


def _caller(context: grpc.aio.ServicerContext) -> dict[str, Any]:
    """Who made a repository change, for the audit: the peer's address, the request id and the
    ``x-operator`` metadata (unchecked); gRPC names no credential's identity."""
    meta = dict(context.invocation_metadata() or ())
    return {"client": context.peer(), "request_id": request_id.get(), "operator": None,
            "operator_declared": meta.get("x-operator")}


async def _call(context: grpc.aio.ServicerContext, work: Callable[[], Any],
                oip_id: str = "") -> Any:
    """Run ``work`` (a function, or one returning an awaitable) under the call's request id; map
    VisionServeError through the status table, anything else to INTERNAL."""
    token = request_id.set(_request_id(context, oip_id))
    try:
        result = work()
        if inspect.isawaitable(result):
            result = await result
        return result
    except VisionServeError as exc:
        wait = retry_after(exc)
        if wait is not None:
            context.set_trailing_metadata((("retry-after", wait),))
        await context.abort(grpc.StatusCode[grpc_code(exc)], exc.message)
    except (asyncio.CancelledError, grpc.aio.AbortError):
        raise
    except Exception:
        log.exception("unhandled error in a gRPC call")
        await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)
    finally:
        request_id.reset(token)
