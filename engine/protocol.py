"""The engine protocol: typed messages between HTTP processes and an engine process.

One framing (a 4-byte big-endian length, then a MessagePack body) and one set of
msgspec structs, told apart by their tag. An HTTP process sends `Submit`, `Cancel` and
`Status`; the engine answers each `Submit` with one `Answer` or `Refusal`, and each
`Status` with `States`. A request's payload and its output travel as `msgspec.Raw`,
encoded and decoded with the model's own `payload_type` and `output_type`; numpy
arrays inside them travel as MessagePack extensions, without copies to lists.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np
from opentelemetry.trace import SpanContext, TraceFlags

from batching import BatchFailed, Cancelled, DeadlineExceeded, Draining, QueueFull
from engine.errors import EngineUnavailable, NotReady, UnknownModel

_ARRAY = 1  # MessagePack extension code of a numpy array
_HEADER = 4
MAX_FRAME = 1 << 30


class TraceRef(msgspec.Struct, frozen=True):
    """A span context across the process boundary (ids in hex)."""

    trace_id: str
    span_id: str
    flags: int

    @classmethod
    def of(cls, context: Any) -> TraceRef | None:
        if not isinstance(context, SpanContext) or not context.is_valid:
            return None
        return cls(f"{context.trace_id:032x}", f"{context.span_id:016x}", int(context.trace_flags))

    def context(self) -> SpanContext:
        return SpanContext(
            int(self.trace_id, 16),
            int(self.span_id, 16),
            is_remote=True,
            trace_flags=TraceFlags(self.flags),
        )


# -- HTTP process to engine ----------------------------------------------------------


class Submit(msgspec.Struct, tag="submit"):
    id: int
    model: str
    payload: msgspec.Raw
    timeout_s: float
    trace: TraceRef | None = None
    progress: bool = False  # send `Progress` while it waits and runs


class Cancel(msgspec.Struct, tag="cancel"):
    id: int
    cut_off: bool = False  # by the HTTP process's drain, not by its client


class Status(msgspec.Struct, tag="status"):
    id: int


# -- engine to HTTP process ----------------------------------------------------------


class Answer(msgspec.Struct, tag="answer"):
    id: int
    output: msgspec.Raw
    batch_size: int
    queue_wait_s: float
    run_s: float
    worker: str
    batch: TraceRef | None = None


class Progress(msgspec.Struct, tag="progress"):
    """A request has done `steps` steps; `ahead`: requests before it in the queue."""

    id: int
    steps: int
    ahead: int | None = None


class Refusal(msgspec.Struct, tag="refusal"):
    """Why a request got no output: a `code` that maps back to an exception."""

    id: int
    code: str
    message: str
    retry_after_s: float | None = None


class ModelStatus(msgspec.Struct):
    state: str
    error: str | None = None
    description: dict[str, Any] = {}


class States(msgspec.Struct, tag="states"):
    id: int
    draining: bool
    models: dict[str, ModelStatus]


ToEngine = Submit | Cancel | Status
FromEngine = Answer | Refusal | States | Progress


# -- encoding --------------------------------------------------------------------------


def _encode_hook(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        body = msgspec.msgpack.encode((value.dtype.str, value.shape, value.tobytes()))
        return msgspec.msgpack.Ext(_ARRAY, body)
    if isinstance(value, np.generic):
        return value.item()
    raise NotImplementedError(f"{type(value).__name__} cannot cross the engine protocol")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _ARRAY:
        raise ValueError(f"unknown extension {code}")
    dtype, shape, body = msgspec.msgpack.decode(data)
    return np.frombuffer(body, dtype=dtype).reshape(shape)


def _decode_hook(kind: type, value: Any) -> Any:
    if kind is np.ndarray and isinstance(value, np.ndarray):
        return value
    raise NotImplementedError(f"cannot decode {kind}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_encode_hook)


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def decoder(kind: Any) -> msgspec.msgpack.Decoder:
    """A decoder of `kind` (a message union, or a model's payload or output type)."""
    return msgspec.msgpack.Decoder(kind, ext_hook=_ext_hook, dec_hook=_decode_hook)


def frame(message: Any) -> bytes:
    body = encode(message)
    return len(body).to_bytes(_HEADER, "big") + body


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's body; `asyncio.IncompleteReadError` once the other end closed."""
    size = int.from_bytes(await reader.readexactly(_HEADER), "big")
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes")
    return await reader.readexactly(size)


# -- errors ----------------------------------------------------------------------------


def refusal(request_id: int, exc: BaseException) -> Refusal:
    """The refusal that says why `exc` ended a request."""
    code = getattr(exc, "code", None) or "batch_failed"
    if code not in _ERRORS and code != "queue_full":
        code = "batch_failed"
    message = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
    retry = exc.retry_after_s if isinstance(exc, QueueFull) else None
    return Refusal(request_id, code, message, retry)


def refusal_error(message: Refusal) -> Exception:
    """The exception a refusal stands for, raised in the HTTP process."""
    if message.code == "queue_full":
        error = QueueFull(0, message.retry_after_s or 1.0)
        error.message = message.message
        return error
    return _ERRORS.get(message.code, BatchFailed)(message.message)


_ERRORS: dict[str, type[Exception]] = {
    "deadline_exceeded": DeadlineExceeded,
    "cancelled": Cancelled,
    "draining": Draining,
    "batch_failed": BatchFailed,
    "not_ready": NotReady,
    "unknown_model": UnknownModel,
    "engine_unavailable": EngineUnavailable,
}
