"""The engine: the one owner of a device, its models and their batchers.

HTTP processes reach an engine through an `EngineClient`: `LocalEngine` in the same
process, `RemoteEngine` over the engine protocol (`engine.protocol`) to an engine
process (`engine.process`).
"""

from batching import BatchResult
from engine.client import EngineClient, LocalEngine, RemoteEngine
from engine.engine import Engine, ModelPlan, ModelState
from engine.errors import (
    CUT_OFF,
    BatchFailed,
    BatchingError,
    Cancelled,
    DeadlineExceeded,
    Draining,
    EngineError,
    EngineUnavailable,
    NotReady,
    QueueFull,
    UnknownModel,
)

__all__ = [
    "CUT_OFF",
    "BatchFailed",
    "BatchResult",
    "BatchingError",
    "Cancelled",
    "DeadlineExceeded",
    "Draining",
    "QueueFull",
    "Engine",
    "EngineClient",
    "EngineError",
    "EngineUnavailable",
    "LocalEngine",
    "ModelPlan",
    "ModelState",
    "NotReady",
    "RemoteEngine",
    "UnknownModel",
]
