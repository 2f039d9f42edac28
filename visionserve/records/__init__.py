"""Traceability records and image capture (issue 21; docs/records.md).

Every answered frame becomes a :class:`~.record.Record` (part, station, camera, time, model,
version, verdict, the task's result, timings, request id), appended to a durable store by one
writer thread off the hot path (:mod:`.writer`, tapped into the engine like the PLC result bus);
frames a capture policy picks are kept for retraining with their record as a JSON sidecar
(:mod:`.capture`), read back by their record with the answer drawn on them (:mod:`.images`,
:mod:`.overlay`). The store is SQLite in WAL mode in the data folder, or PostgreSQL
(:mod:`.store`); ``GET /v1/parts/{part_id}`` (:mod:`.http`) and ``visionserve records export``
(:mod:`.cli`) read it; ``visionserve doctor`` checks it (:mod:`.health`).
"""
