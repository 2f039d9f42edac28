"""Every answer belongs to its own frame (CPU): a model whose scores are its input's mean colour,
unique solid-colour frames of mixed sizes and formats, 48 concurrent clients for 30 s, 30% of
them with deadlines that expire mid-batch and some hanging up mid-request. The same check runs on
the GPU in tests/gpu/test_frame_integrity_gpu.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.tools import integrity

pytestmark = pytest.mark.slow

CPU_SIZES = ((480, 640), (240, 320), (131, 97), (64, 64), (600, 800))


@pytest.fixture(scope="module")
def means_repo(tmp_path_factory):
    return integrity.make_repo(tmp_path_factory.mktemp("integrity"), "onnxruntime")


@pytest.mark.parametrize("frontends, flags", [(0, ()), (2, ())], ids=["in-process", "frontends"])
def test_every_answer_belongs_to_its_frame(means_repo, server_factory, frontends, flags):
    """Many clients, frames of many sizes, short deadlines: never another frame's bytes under a
    frame's verdict, in process and through the front ends' shared memory."""
    extra = ("--frontends", str(frontends)) if frontends else ()
    server = server_factory(means_repo, *extra, *flags, grpc=False)
    report = asyncio.run(integrity.run_load(server.url, seconds=30, clients=48, sizes=CPU_SIZES,
                                            short_ms=(1.0, 15.0)))
    summary = report.as_dict()
    print("frame integrity", "frontends", frontends, flags, summary)
    assert report.wrong == 0, summary
    assert report.answered_200 > 100, summary  # the check saw real traffic
    assert report.statuses.get(504, 0) > 0, summary  # short deadlines did expire
    assert not {s for s in report.statuses if s not in (200, 503, 504)}, summary  # no 500s
