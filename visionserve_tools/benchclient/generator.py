"""The load generator: several processes, each with its own asyncio loop and raw clients.

Open loop (``rate``): each process fires its share of a fixed arrival schedule (constant
spacing or Poisson) whether or not earlier answers came back, so a slow server cannot slow the
offered load down (no coordinated omission). A new frame takes an idle keep-alive connection or
opens one; past ``max_connections`` per process the frame is counted as ``generator_overflow``
instead of waiting. Closed loop (``concurrency``): N senders each send, await, send again.

Times are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC: one clock for all processes). Each frame's
latency runs from the moment its bytes are written to the moment its answer is read; the lag of
that moment behind the schedule is kept too, as the generator's own health figure.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import wire


@dataclass(frozen=True)
class Job:
    """One worker's share of one run (picklable: sent to the worker process)."""

    worker: int
    workers: int
    protocol: str
    host: str
    port: int
    model: str
    start_ns: int           # perf_counter_ns at which the schedule starts (same for all workers)
    duration_s: float       # warm-up + measured window
    rate: float = 0.0       # total frames/s over all workers (open loop), 0 = closed loop
    poisson: bool = False
    concurrency: int = 0    # total closed-loop senders over all workers
    deadline_ms: float | None = None
    timeout_s: float = 10.0
    connections: int = 4    # pre-opened keep-alive connections per worker (open loop)
    max_connections: int = 512
    seed: int = 0


@dataclass
class Result:
    """Per-frame records of one worker, as numpy arrays (cheap to pickle back)."""

    sched_ns: np.ndarray     # scheduled send, ns after start_ns
    lag_ns: np.ndarray       # actual send minus scheduled send
    latency_ns: np.ndarray   # send to full answer; -1 when there was none
    outcome: np.ndarray      # wire.OUTCOMES index
    verdict: np.ndarray      # wire.VERDICTS value or -1
    batch: np.ndarray        # server-reported batch size (inspect API), 0 if unknown
    frame: np.ndarray        # index into the image set
    score: np.ndarray        # top score reported by the server (nan if none)
    labels: list[str]
    cpu_s: float             # this worker's own CPU time during the run
    details: dict[str, str]  # one example message per outcome kind


_FRAMES: list = []  # the image set, set once per worker process by init_worker


def init_worker(frames: list) -> None:
    global _FRAMES
    _FRAMES = frames


def run_job(job: Job) -> Result:
    """Worker-process entry point."""
    try:
        import uvloop  # faster loop where available; same semantics

        policy = uvloop.EventLoopPolicy()
        asyncio.set_event_loop_policy(policy)
    except ImportError:
        pass
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    out = asyncio.run(_Worker(job, _FRAMES).run())
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    out.cpu_s = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return out


class _Worker:
    def __init__(self, job: Job, frames: list) -> None:
        self.job = job
        self.frames = frames
        self.rng = random.Random(job.seed * 7919 + job.worker)
        self.idle: list[wire.HttpConnection] = []
        self.open_conns = 0
        self.recs: list[tuple] = []
        self.details: dict[str, str] = {}
        self.grpc_stub: Any = None  # tritonclient's GRPCInferenceServiceStub (untyped)
        self.grpc_channel: Any = None  # grpc.aio.Channel
        self.seq = 0
        self.prebuilt: list[tuple[bytes, bytes]] = []

    async def run(self) -> Result:
        job = self.job
        await self._setup()
        end_ns = job.start_ns + int(job.duration_s * 1e9)
        try:
            if job.rate > 0:
                await self._open_loop(end_ns)
            else:
                await self._closed_loop(end_ns)
        finally:
            for c in self.idle:
                c.close()
            if self.grpc_channel is not None:
                await self.grpc_channel.close()
        return self._result()

    async def _setup(self) -> None:
        job = self.job
        hostport = f"{job.host}:{job.port}"
        if job.protocol == "grpc":
            import grpc
            from tritonclient.grpc import service_pb2_grpc

            opts = [("grpc.max_send_message_length", 64 << 20),
                    ("grpc.max_receive_message_length", 64 << 20)]
            self.grpc_channel = grpc.aio.insecure_channel(hostport, options=opts)
            self.grpc_stub = service_pb2_grpc.GRPCInferenceServiceStub(self.grpc_channel)
            self.prebuilt = [wire.grpc_request(job.model, f.data, job.deadline_ms)
                             for f in self.frames]
            await asyncio.wait_for(self.grpc_channel.channel_ready(), 10)
        else:
            if job.protocol == "oip":
                self.prebuilt = [wire.oip_request(hostport, job.model, f.data, job.deadline_ms)
                                 for f in self.frames]
            n = job.connections if job.rate > 0 else 0
            for _ in range(n):
                self.idle.append(await wire.HttpConnection(job.host, job.port).open())
                self.open_conns += 1

    # --- schedules -----------------------------------------------------------------------------

    async def _sleep_until(self, t_ns: int) -> None:
        delay = (t_ns - time.perf_counter_ns()) / 1e9
        if delay > 0:
            await asyncio.sleep(delay)

    async def _open_loop(self, end_ns: int) -> None:
        job = self.job
        per_worker = job.rate / job.workers
        tasks: set[asyncio.Task] = set()
        i = 0
        # constant spacing interleaves the workers: worker k fires at (i*W + k)/rate
        t = job.start_ns + int(job.worker * 1e9 / job.rate) if not job.poisson else job.start_ns
        if job.poisson:
            t += int(self.rng.expovariate(per_worker) * 1e9)
        while t < end_ns:
            await self._sleep_until(t)
            task = asyncio.get_running_loop().create_task(self._one(t, i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            if job.poisson:
                t += int(self.rng.expovariate(per_worker) * 1e9)
            else:
                t = job.start_ns + int((i * job.workers + job.worker) * 1e9 / job.rate)
        if tasks:
            await asyncio.wait(tasks, timeout=job.timeout_s + 1)

    async def _closed_loop(self, end_ns: int) -> None:
        job = self.job
        mine = job.concurrency // job.workers \
            + (1 if job.worker < job.concurrency % job.workers else 0)

        async def sender(k: int) -> None:
            conn = None
            if job.protocol != "grpc":
                conn = await wire.HttpConnection(job.host, job.port).open()
            i = k
            await self._sleep_until(job.start_ns)
            while True:
                t = time.perf_counter_ns()
                if t >= end_ns:
                    break
                conn = await self._one(t, i, conn)
                i += mine
            if conn is not None:
                conn.close()

        await asyncio.gather(*(sender(k) for k in range(mine)))

    # --- one frame -----------------------------------------------------------------------------

    async def _one(self, sched: int, i: int, conn: wire.HttpConnection | None = None):
        job = self.job
        fi = (i * job.workers + job.worker) % len(self.frames)
        frame = self.frames[fi]
        own_conn = conn is None and job.protocol != "grpc"
        if own_conn:
            if self.idle:
                conn = self.idle.pop()
            elif self.open_conns < job.max_connections:
                self.open_conns += 1
                try:
                    conn = await wire.HttpConnection(job.host, job.port).open()
                except OSError as exc:
                    self.open_conns -= 1
                    self._record(sched, time.perf_counter_ns(), -1,
                                 wire.Answer(wire.CONN_ERROR, detail=str(exc)), fi)
                    return None
            else:
                self._record(sched, time.perf_counter_ns(), -1, wire.Answer(wire.OVERFLOW), fi)
                return None
        t_send = time.perf_counter_ns()
        ans = await self._send(conn, frame, fi, t_send)
        t_done = time.perf_counter_ns()
        answered = ans.outcome not in (wire.CONN_ERROR, wire.TIMEOUT)
        self._record(sched, t_send, t_done - t_send if answered else -1, ans, fi)
        if conn is not None and (conn.closed or ans.outcome in (wire.CONN_ERROR, wire.TIMEOUT,
                                                                wire.BAD_ANSWER)):
            conn.close()
            if own_conn:
                self.open_conns -= 1
                return None
            try:  # a closed-loop sender reconnects
                return await wire.HttpConnection(job.host, job.port).open()
            except OSError:
                await asyncio.sleep(0.05)
                return wire.HttpConnection(job.host, job.port)
        if own_conn:
            assert conn is not None  # set above, or this returned
            self.idle.append(conn)
        return conn

    async def _send(self, conn, frame, fi: int, t_send: int) -> wire.Answer:
        job = self.job
        try:
            if job.protocol == "grpc":
                resp = await self.grpc_stub.ModelInfer(self.prebuilt[fi], timeout=job.timeout_s)
                return wire.parse_grpc(resp)
            if conn.closed:
                await conn.open()
            if job.protocol == "oip":
                head, body = self.prebuilt[fi]
                status, headers, data = await asyncio.wait_for(conn.request(head, body),
                                                               job.timeout_s)
                return wire.parse_oip(status, headers, data)
            self.seq += 1
            part = f"w{job.worker}-{self.seq}"
            if job.protocol == "json":
                head, body = wire.json_request(f"{job.host}:{job.port}", job.model, frame.data,
                                               part, job.deadline_ms)
            else:
                head, body = wire.inspect_request(f"{job.host}:{job.port}", job.model, frame.data,
                                                  frame.content_type, part, job.deadline_ms)
            status, headers, data = await asyncio.wait_for(conn.request(head, body), job.timeout_s)
            return wire.parse_inspect(status, data, headers)
        except asyncio.TimeoutError:
            return wire.Answer(wire.TIMEOUT, detail=f"no answer within {job.timeout_s} s")
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                wire.ProtocolError) as exc:
            return wire.Answer(wire.CONN_ERROR, detail=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # grpc.aio.AioRpcError and friends
            if hasattr(exc, "code"):
                return wire.grpc_error_answer(exc)
            raise

    def _record(self, sched: int, t_send: int, latency: int, ans: wire.Answer, fi: int) -> None:
        self.recs.append((sched - self.job.start_ns, t_send - sched, latency, ans.outcome,
                          ans.verdict, ans.batch_size, fi, ans.score, ans.label))
        if ans.outcome != wire.OK and wire.OUTCOMES[ans.outcome] not in self.details:
            self.details[wire.OUTCOMES[ans.outcome]] = ans.detail[:300]

    def _result(self) -> Result:
        cols = list(zip(*self.recs)) if self.recs else [()] * 9
        return Result(
            sched_ns=np.asarray(cols[0], dtype=np.int64), lag_ns=np.asarray(cols[1],
                                                                            dtype=np.int64),
            latency_ns=np.asarray(cols[2], dtype=np.int64), outcome=np.asarray(cols[3],
                                                                               dtype=np.int8),
            verdict=np.asarray(cols[4], dtype=np.int8), batch=np.asarray(cols[5], dtype=np.int32),
            frame=np.asarray(cols[6], dtype=np.int32), score=np.asarray(cols[7], dtype=np.float64),
            labels=list(cols[8]), cpu_s=0.0, details=self.details)


def merge(results: list[Result]) -> Result:
    cat = {name: np.concatenate([getattr(r, name) for r in results])
           for name in ("sched_ns", "lag_ns", "latency_ns", "outcome", "verdict", "batch", "frame",
                        "score")}
    details: dict[str, str] = {}
    for r in results:
        for k, v in r.details.items():
            details.setdefault(k, v)
    return Result(**cat, labels=[x for r in results for x in r.labels],
                  cpu_s=sum(r.cpu_s for r in results),
                  details=details)


def _settle(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


class Pool:
    """The generator processes, kept alive across the steps of a sweep."""

    def __init__(self, processes: int, frames: list) -> None:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        self.processes = max(1, processes)
        # spawn: a clean interpreter per worker (no inherited event loop, gRPC or thread state)
        self._ex = ProcessPoolExecutor(self.processes, mp_context=mp.get_context("spawn"),
                                       initializer=init_worker, initargs=(frames,))
        # start every worker now so start-up cost is outside the measured window
        list(self._ex.map(_settle, [0.3] * self.processes))

    def run(self, make_job) -> list:
        """``make_job(worker)`` -> Job for each worker; returns futures of Results."""
        return [self._ex.submit(run_job, make_job(k)) for k in range(self.processes)]

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)
