"""Stream ordering on the GPU data path: a batch's pixels are never overwritten by the next batch
while its kernels are still queued.

torchvision decodes JPEGs on a stream of its own, into tensors allocated on the caller's current
stream, without waiting for what is queued there, so the next batch's decode could reuse the blocks
of the previous batch's decoded images while that batch's resize was still queued (batch k built
from batch k+1's pixels). This test holds the stream busy so that every resize is queued behind the
next decode, and checks each batch's pixels. On the H200 it did not reproduce the old race (the old
code passed it too, 2026-12-03): it guards the ordering; the whole-path check that did catch the old
code is tests/gpu/test_frame_integrity_gpu.py (1,241 of 20,425 answers wrong before, 0 after)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _solid_jpeg(rgb, h=480, w=640) -> bytes:
    import cv2

    img = np.empty((h, w, 3), np.uint8)
    img[:] = rgb[::-1]  # BGR for OpenCV
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    return buf.tobytes()


def test_next_batch_decode_does_not_overwrite_a_queued_batch():
    import torch

    from visionserve import imaging
    from visionserve.config import InputSpec
    from visionserve.gpu.memory import high_priority_stream
    from visionserve.gpu.preprocess import TorchPreprocessor

    spec = InputSpec(width=32, height=32)
    stream = high_priority_stream("cuda:0")
    prep = TorchPreprocessor(spec, device="cuda:0", dtype=torch.float32, max_batch=16, stream=stream)
    colours = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (120, 120, 20)]
    batches = [[imaging.encoded_frame(_solid_jpeg(c))] * 16 for c in colours]
    prep.prepare(batches[0], 16)  # warm: nvJPEG and the allocator have their buffers
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of a busy stream: the resizes wait behind it
        outs = [prep.prepare(b, 16)[0] for b in batches]
        stream.synchronize()
        for c, t in zip(colours, outs):
            got = t.float().mean(dim=(2, 3)).cpu().numpy() * 255  # scale 1/255, mean 0, std 1
            np.testing.assert_allclose(got, np.tile(c, (16, 1)), atol=4)
