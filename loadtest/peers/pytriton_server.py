"""Peer (c): NVIDIA Triton (2.51, bundled by nvidia-pytriton 0.7.0) with its dynamic batcher.

Triton's OIP v2 HTTP/gRPC front end and dynamic batcher; the model is a pytriton Python callable
that decodes, resizes and normalises each frame of the batch, runs the model once and applies
softmax -- the same work as visionserve. ``--device cuda``: nvJPEG and the model's ``.pt2`` in
fp16 on the GPU (``common.load_torch``); the default: OpenCV and onnxruntime on the CPU.
Input ``image`` BYTES [N,1], outputs ``scores`` FP32 [N,labels], ``label`` and ``verdict`` BYTES [N,1]
(``visionserve bench --protocol oip``).

Run it through ``run_peers.py`` (it sets LD_LIBRARY_PATH so that Triton's Python-backend stub
loads this venv's own libpython first; without that models fail with an ``_thread.RLock``
attribute error). Stop it with SIGINT (Ctrl-C), not a bare SIGTERM, so Triton shuts down.

    .work/peers/pytriton/bin/python loadtest/peers/pytriton_server.py --models models --model NAME --http-port 8300
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, QueuePolicy, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--http-port", type=int, default=8300)
    p.add_argument("--grpc-port", type=int, default=8301)
    p.add_argument("--metrics-port", type=int, default=8302)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-queue-delay-us", type=int, default=2000)
    p.add_argument("--device", default="cpu", help="cpu, or cuda for the torch model on the GPU")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # pytriton shuts Triton down cleanly on KeyboardInterrupt only. A process started in the
    # background of a non-interactive shell inherits SIGINT ignored, so restore it, and turn
    # SIGTERM into the same KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.default_int_handler(signal.SIGINT, None))
    model = common.load_for(a.device, a.models, a.model)

    @batch
    def infer(image: np.ndarray) -> dict[str, np.ndarray]:
        tensor = model.prepare([bytes(x[0]) for x in image])
        scores = model.run(tensor)
        v = model.verdicts(scores)
        return {"scores": scores.astype(np.float32),
                "label": np.array([[x[1].encode()] for x in v], dtype=np.bytes_),
                "verdict": np.array([[x[0].encode()] for x in v], dtype=np.bytes_)}

    preferred = [b for b in (1, 2, 4, 8, 16, 32) if b <= a.max_batch_size]
    config = ModelConfig(
        max_batch_size=a.max_batch_size,
        batcher=DynamicBatcher(max_queue_delay_microseconds=a.max_queue_delay_us, preferred_batch_size=preferred,
                               default_queue_policy=QueuePolicy(allow_timeout_override=True)),
    )
    tconf = TritonConfig(http_address="127.0.0.1", http_port=a.http_port, grpc_address="127.0.0.1",
                         grpc_port=a.grpc_port, metrics_port=a.metrics_port, allow_gpu_metrics=False)
    # no token on the statistics endpoints: the benchmark reads batch statistics from them
    with Triton(config=tconf, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        triton.bind(
            model_name=a.model,
            infer_func=infer,
            inputs=[Tensor(name="image", dtype=np.bytes_, shape=(1,))],
            outputs=[Tensor(name="scores", dtype=np.float32, shape=(len(model.labels),)),
                     Tensor(name="label", dtype=np.bytes_, shape=(1,)),
                     Tensor(name="verdict", dtype=np.bytes_, shape=(1,))],
            config=config,
            strict=True,
        )
        try:
            triton.serve()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
