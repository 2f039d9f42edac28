"""gRPC health (``grpc.health.v1``) against a real ``grpc.aio`` server on loopback: it says what the
engine's readiness is at the moment it is asked, not what it was at the watcher's last poll."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from visionserve.grpc import server as grpc_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Engine:
    """Only what the health service reads: readiness."""

    ready = False


@pytest.fixture
async def served(monkeypatch):
    # a poll that never comes within the test: what it sees must come from Check and Watch
    monkeypatch.setattr(grpc_server, "HEALTH_POLL_S", 3600.0)
    engine = Engine()
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    gs = grpc_server.GrpcServer(server, engine, f"127.0.0.1:{port}")
    await gs.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield engine, health_pb2_grpc.HealthStub(channel), gs
    finally:
        await channel.close()
        await gs.stop(grace=0)


async def check(stub, service: str = "") -> int:
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def test_check_and_a_new_watch_say_the_readiness_of_now(served):
    engine, stub, _ = served
    assert await check(stub) == NOT_SERVING  # warming up
    engine.ready = True  # ready: HTTP /v2/health/ready says so at once, and so does gRPC
    assert await check(stub) == SERVING
    assert await check(stub, grpc_server.SERVICE_NAME) == SERVING
    engine.ready = False  # a model turned unhealthy, or the drain began
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert (await watch.read()).status == NOT_SERVING
    watch.cancel()


async def test_an_open_watch_hears_a_change_from_the_watcher(served, monkeypatch):
    engine, stub, gs = served
    engine.ready = True
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert (await watch.read()).status == SERVING
    engine.ready = False
    await gs._refresh()  # what the watcher does at its next poll
    assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
    watch.cancel()


async def test_stop_turns_the_service_not_serving_for_good(served):
    engine, stub, gs = served
    engine.ready = True
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert (await watch.read()).status == SERVING
    await gs.health.enter_graceful_shutdown()
    assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
    assert await check(stub) == NOT_SERVING  # a refresh cannot undo the shutdown
    watch.cancel()
