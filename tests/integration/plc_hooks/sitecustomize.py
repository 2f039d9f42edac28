"""Fault hooks for the PLC integration tests, loaded into a real ``visionserve serve`` process
through PYTHONPATH (Python imports ``sitecustomize`` at start-up).

With PLC_TEST_HOOKS=<folder>: while ``<folder>/hang`` exists every model call blocks (the engine
stops making progress while the process and its PLC servers live on); while
``<folder>/hold-load`` exists loading a model waits (the server stays not ready); ``<folder>/slow``
holding a number makes every model call take that many seconds.
"""

from __future__ import annotations

import os
import time

FOLDER = os.environ.get("PLC_TEST_HOOKS")

if FOLDER:
    from visionserve.backends.onnx import OnnxBackend

    def _wait(name: str) -> None:
        while os.path.exists(os.path.join(FOLDER, name)):
            time.sleep(0.01)

    def _slow() -> None:
        try:
            with open(os.path.join(FOLDER, "slow")) as f:
                time.sleep(float(f.read() or 0))
        except (OSError, ValueError):
            pass

    _run, _load = OnnxBackend.run, OnnxBackend.load

    def run(self, batch):
        _wait("hang")
        _slow()
        return _run(self, batch)

    def load(self, *args, **kwargs):
        _wait("hold-load")
        return _load(self, *args, **kwargs)

    OnnxBackend.run, OnnxBackend.load = run, load
