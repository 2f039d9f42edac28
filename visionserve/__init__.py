"""visionserve: a low-latency batched inference server for industrial vision."""

from __future__ import annotations

__version__ = "0.1.0"
