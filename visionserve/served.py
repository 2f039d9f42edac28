"""One loaded model version as the engine serves it (:class:`Served`), and the model config it is
loaded with (:func:`effective_config`): what the engine's lifecycle, admission and statistics
share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from . import metrics, tasks
from .batching import Batcher
from .config import BatchingSpec, ModelConfig, ServerSettings
from .dataplane import ModelStats
from .errors import ConfigError, describe_validation
from .execution import Executor
from .repository import ModelEntry


def file_stamp(path: Path) -> tuple[int, int]:
    """(size, modification time) of a version's model file: a changed file is a new model."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@dataclass
class Served:
    """One loaded model version."""

    entry: ModelEntry
    version: int
    config: ModelConfig
    batcher: Batcher
    runners: list[Executor]
    stats: ModelStats = field(default_factory=ModelStats)
    backend_info: dict[str, str] = field(default_factory=dict)
    series: metrics.ModelSeries = field(init=False)  # made in __post_init__
    #: what the outputs mean: the front ends have it render answers (bound to the model at load)
    task: tasks.Task | None = None
    #: the model file's (size, modification time) when it was loaded
    source: tuple[int, int] = (0, 0)
    #: this load of it, for the GPU reservation's streams (a version reloaded is another load)
    load_id: int = 0

    def __post_init__(self) -> None:
        self.series = metrics.ModelSeries(self.entry.name)
        if self.task is None:
            self.task = tasks.create(self.config)

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def ready(self) -> bool:
        return self.batcher.alive and all(r.healthy for r in self.runners)


def effective_config(config: ModelConfig, settings: ServerSettings) -> ModelConfig:
    """model.toml's batching, with the server's command-line overrides applied."""
    b = config.batching
    over = {k: v for k, v in {
        "max_batch_size": settings.max_batch_size,
        "max_queue_delay_ms": settings.max_queue_delay_ms,
        "max_queue_size": settings.max_queue_size,
        "takt_ms": settings.takt_ms,
    }.items() if v is not None}
    if not over:
        return config
    data = b.model_dump() | over
    mbs = data["max_batch_size"]
    data["preferred_batch_sizes"] = tuple(p for p in data["preferred_batch_sizes"]
                                          if p <= mbs) or (mbs,)
    try:
        batching = BatchingSpec.model_validate(data)
    except ValidationError as exc:
        # the server setting's own range is wider than model.toml's: name the option, not pydantic
        errs = "; ".join(describe_validation(exc, flag=True, got=True))
        raise ConfigError(f"server override does not fit model {config.name or 'config'}: "
                          f"{errs}") from None
    return config.model_copy(update={"batching": batching})
