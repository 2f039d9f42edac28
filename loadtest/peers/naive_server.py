"""Peer (a): what one would write by hand -- FastAPI + onnxruntime (or, with ``--device cuda``,
torch on the GPU with nvJPEG: ``common.load_torch``), one request, one inference.

A plain synchronous endpoint (FastAPI runs it in its thread pool), the same inspect URL, headers
and answer as visionserve, no batching, no deadline scheduling.

    .work/peers/naive/bin/python loadtest/peers/naive_server.py --models models --model NAME --port 8100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import uvicorn
from fastapi import Body, FastAPI, Header, HTTPException, Response


def build(models: Path, name: str, device: str = "cpu") -> FastAPI:
    model = common.load_for(device, models, name)
    app = FastAPI()

    @app.get("/v2/health/ready")
    def ready() -> dict:
        return {"ready": True}

    @app.post("/v1/models/{model_name}/inspect")
    def inspect(model_name: str, body: bytes = Body(..., media_type="image/jpeg"),
                x_part_id: str | None = Header(None), x_deadline_ms: float | None = Header(None)) -> Response:
        t0 = time.perf_counter()
        if model_name != name:
            raise HTTPException(404, f"unknown model {model_name!r}")
        try:
            x = model.prepare([body])
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None
        scores = model.run(x)
        (verdict,) = model.verdicts(scores)
        took = (time.perf_counter() - t0) * 1000
        ans = common.answer(x_part_id, name, verdict, scores[0], model.labels, 1, x_deadline_ms, took)
        return Response(json.dumps(ans), media_type="application/json")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--models", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--device", default="cpu", help="cpu, or cuda for the torch model on the GPU")
    a = p.parse_args()
    uvicorn.run(build(a.models, a.model, a.device), host="127.0.0.1", port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
