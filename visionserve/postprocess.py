"""Model outputs -> scores -> verdicts (the rule a PLC acts on)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig


@dataclass(frozen=True, slots=True)
class Classification:
    verdict: str  # "OK" | "NG"
    label: str
    score: float
    scores: np.ndarray  # (num_labels,) float32


def activate(raw: np.ndarray, activation: str) -> np.ndarray:
    x = raw.astype(np.float32, copy=False)
    if activation == "softmax":
        x = x - x.max(axis=1, keepdims=True)
        e = np.exp(x)
        return e / e.sum(axis=1, keepdims=True)
    if activation == "sigmoid":
        return 1.0 / (1.0 + np.exp(-np.clip(x, -80.0, 80.0)))  # no float32 overflow
    return x


def classify(raw: np.ndarray, config: ModelConfig) -> list[Classification]:
    """NG unless the top label is one of ``verdict.ok_labels`` with score >= ``ok_threshold``."""
    labels = config.output.labels
    if raw.ndim != 2 or raw.shape[1] != len(labels):
        raise ValueError(f"model output shape {raw.shape} does not match {len(labels)} labels")
    scores = activate(raw, config.output.activation)
    top = scores.argmax(axis=1)
    ok_labels = set(config.verdict.ok_labels)
    out = []
    for i, t in enumerate(top):
        label, score = labels[t], float(scores[i, t])
        ok = label in ok_labels and score >= config.verdict.ok_threshold
        out.append(Classification("OK" if ok else "NG", label, score, scores[i]))
    return out
