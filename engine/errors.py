"""Why an engine gave a request no output: the batcher's reasons and the engine's own."""

from __future__ import annotations

from batching.errors import (
    CUT_OFF,
    BatchFailed,
    BatchingError,
    Cancelled,
    DeadlineExceeded,
    Draining,
    QueueFull,
)

__all__ = [
    "CUT_OFF",
    "BatchFailed",
    "BatchingError",
    "Cancelled",
    "DeadlineExceeded",
    "Draining",
    "EngineError",
    "EngineUnavailable",
    "NotReady",
    "QueueFull",
    "UnknownModel",
]


class EngineError(BatchingError):
    """The engine itself, not its batcher, gave the request no output."""

    code = "engine_error"


class NotReady(EngineError):
    """The model is still loading, or failed to load."""

    code = "not_ready"


class UnknownModel(EngineError):
    """The request named a model that no engine serves."""

    code = "unknown_model"


class EngineUnavailable(EngineError):
    """The engine is not connected, or went away while the request was in it."""

    code = "engine_unavailable"
