"""Peer (b): LitServe with its own dynamic batching (max_batch_size, batch_timeout).

LitServe's API server parses JSON (or forms) and hands the payload to a worker process, so a
frame travels as base64 in ``{"image": ..., "part_id": ..., "deadline_ms": ...}``
(``visionserve bench --protocol json``). Decode, resize, normalise run per frame in
``decode_request`` in the worker, the model once per batch in ``predict`` -- the same work as
visionserve.

    .work/peers/litserve/bin/python loadtest/peers/litserve_server.py --models models --model NAME --port 8200
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import litserve as ls
import numpy as np


class InspectAPI(ls.LitAPI):
    def __init__(self, models: Path, name: str, max_batch_size: int, batch_timeout: float) -> None:
        super().__init__(max_batch_size=max_batch_size, batch_timeout=batch_timeout,
                         api_path=f"/v1/models/{name}/inspect")
        self.models, self.name = models, name

    def setup(self, device) -> None:
        self.model = common.load(self.models, self.name)

    def decode_request(self, request):
        t0 = time.perf_counter()
        x = self.model.preprocess(base64.b64decode(request["image"]))
        return x, request.get("part_id"), request.get("deadline_ms"), t0

    def batch(self, inputs):
        return np.stack([i[0] for i in inputs]), [i[1:] for i in inputs]

    def predict(self, x):
        if self.max_batch_size > 1:  # batch() made (tensor, metas)
            tensor, metas = x
        else:  # one decode_request output
            tensor, metas = x[0][None], [x[1:]]
        scores = self.model.run(tensor)
        n = len(metas)
        out = []
        for (part_id, deadline_ms, t0), v, s in zip(metas, self.model.verdicts(scores), scores):
            took = (time.perf_counter() - t0) * 1000
            out.append(common.answer(part_id, self.name, v, s, self.model.labels, n, deadline_ms, took))
        return out if self.max_batch_size > 1 else out[0]

    def unbatch(self, output):
        return output

    def encode_response(self, output):
        return output


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=8200)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-timeout", type=float, default=0.002, help="seconds")
    a = p.parse_args()
    api = InspectAPI(a.models, a.model, a.max_batch_size, a.batch_timeout)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=30)
    # access log off, as for the other servers: one log line per frame costs CPU on a small box
    server.run(host="127.0.0.1", port=a.port, num_api_servers=1, generate_client_file=False,
               log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
