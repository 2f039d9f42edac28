"""Every answer belongs to its own frame, on the GPU data path (nvJPEG, device preprocessing,
CUDA graphs): the CPU test's check (tests/integration/test_frame_integrity.py) with the torch
backend on CUDA, in the serving process, as shipped (the front ends and batch workers the server
chooses) and with front ends and batch workers named, and 1-8 ms deadlines that expire while a
batch is being decoded (the case that gave other frames' scores before the stream fixes)."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import pytest

from tests.tools import integrity

# beside other tests: a busier machine only makes the races it looks for likelier
pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def means_repo(tmp_path_factory):
    return integrity.make_repo(tmp_path_factory.mktemp("integrity"), "torch", "fp16")


@pytest.mark.parametrize("frontends, flags", [
    (0, ()), (None, ()), (4, ("--gpu-batch-processes", "2"))],
    ids=["in-process", "as-shipped", "frontends-batch-processes"])
def test_every_answer_belongs_to_its_frame_on_gpu(means_repo, server_factory, frontends, flags):
    """``frontends`` None: the server as shipped, with the front ends and batch workers it
    chooses for this machine (said in its log)."""
    as_shipped = frontends is None
    extra = ("--frontends", str(frontends)) if frontends else ()
    server = server_factory(means_repo, "--device", "cuda:0", *extra, *flags, grpc=False,
                            as_shipped=as_shipped)
    if as_shipped:
        chosen = re.search(r"execution: (\d+) front-end process\(es\), (\d+) batch worker",
                           server.log())
        assert chosen, server.log()
        frontends, workers = int(chosen[1]), int(chosen[2])
        flags = ("--gpu-batch-processes", str(workers)) if workers else ()
    report = asyncio.run(integrity.run_load(server.url, seconds=30, clients=48, processes=4))
    summary = report.as_dict()
    if os.environ.get("INTEGRITY_OUT"):  # tests/gpu/run_on_device.sh keeps the figures
        with open(Path(os.environ["INTEGRITY_OUT"]) / "integrity.jsonl", "a") as f:
            f.write(json.dumps({"as_shipped": as_shipped, "frontends": frontends,
                                "flags": list(flags), **summary}) + "\n")
    if "--gpu-batch-processes" in flags:  # the workers prepared and ran the batches
        workers = int(flags[1])
        assert "batches prepared and run by process(es)" in server.log()
        assert f"batches in flight: {2 * workers}, and {workers} more when full" in server.log()
        assert "preparation process failed" not in server.log()
        assert "could not prepare a batch" not in server.log()
    assert report.wrong == 0, summary
    assert report.answered_200 > 1000, summary
    assert not {s for s in report.statuses if s not in (200, 503, 504)}, summary
