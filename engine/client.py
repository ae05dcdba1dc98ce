"""How an HTTP process talks to an engine: one interface, two implementations.

`LocalEngine` calls an `Engine` in the same process (a CPU server with one HTTP
process); `RemoteEngine` speaks the engine protocol over the engine process's Unix
socket, reconnecting when the engine restarts. Both give the same `BatchResult`s and
raise the same errors, so nothing above them knows where the engine runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import msgspec
from opentelemetry.trace import SpanContext

from batching import BatchResult, cut_off
from engine import protocol
from engine.engine import Engine, ModelState
from engine.errors import EngineUnavailable
from models.base import Model

log = logging.getLogger(__name__)

RECONNECT_S = 0.2
STATUS_TIMEOUT_S = 5.0
# How long past a request's deadline an HTTP process still waits for its engine's answer.
# The engine answers at the deadline itself (504); silence past it means the engine's
# event loop stands still, and the request is answered 503 `engine_unavailable` here
# (the launcher restarts such an engine).
ANSWER_GRACE_S = 5.0


class EngineClient(ABC):
    """An engine as an HTTP process sees it."""

    name: str

    @abstractmethod
    async def start(self) -> None:
        """Start (a local engine) or connect (a remote one); returns at once."""

    @property
    @abstractmethod
    def connected(self) -> bool: ...

    @abstractmethod
    async def submit(
        self,
        model: Model,
        payload: Any,
        timeout_s: float,
        context: SpanContext | None,
        on_progress: Callable[[int, int | None], None] | None = None,
    ) -> BatchResult:
        """Run `payload` of `model` in the engine's batches; raises the batcher's errors,
        `NotReady`, `UnknownModel` or `EngineUnavailable`. `on_progress(steps done,
        requests ahead in the queue)` follows the request, where its model reports steps."""

    @abstractmethod
    async def states(self) -> tuple[bool, dict[str, ModelState]]:
        """(draining, {model key: state}) of the engine."""

    async def drain(self, timeout_s: float) -> None:  # noqa: B027 - only a local engine drains here
        """Finish queued work before the process exits."""

    @abstractmethod
    async def close(self) -> None: ...


class LocalEngine(EngineClient):
    """An engine inside this process."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.name = engine.name

    async def start(self) -> None:
        self.engine.start()

    @property
    def connected(self) -> bool:
        return True

    async def submit(self, model, payload, timeout_s, context, on_progress=None) -> BatchResult:
        return await self.engine.submit(model.key, payload, timeout_s, context, on_progress)

    async def states(self) -> tuple[bool, dict[str, ModelState]]:
        return self.engine.draining, self.engine.states()

    async def drain(self, timeout_s: float) -> None:
        await self.engine.drain(timeout_s)

    async def close(self) -> None:
        await self.engine.close()


class RemoteEngine(EngineClient):
    """An engine process, over its Unix socket at `path`."""

    def __init__(self, path: str, name: str) -> None:
        self.path = path
        self.name = name
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._progress: dict[int, Callable[[int, int | None], None]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._pending: list[bytes] = []
        self._task: asyncio.Task | None = None
        self._closed = False
        self._messages = protocol.decoder(protocol.FromEngine)
        self._outputs: dict[type, msgspec.msgpack.Decoder] = {}

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._connection())

    @property
    def connected(self) -> bool:
        return self._writer is not None

    async def _connection(self) -> None:
        """Keep a connection to the engine: connect, read answers, and after the engine
        went away fail what was in it and connect again once it is back."""
        announced = False
        while not self._closed:
            try:
                reader, writer = await asyncio.open_unix_connection(self.path)
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            self._writer = writer
            log.info("connected to engine %s", self.name)
            announced = False
            try:
                while True:
                    self._receive(await protocol.read_frame(reader))
            except (asyncio.IncompleteReadError, ConnectionError, OSError):
                pass
            except Exception:
                log.exception("engine %s sent a bad frame", self.name)
            finally:
                self._writer = None
                writer.close()
            if not announced and not self._closed:
                log.error("lost engine %s; reconnecting", self.name)
                announced = True
            self._fail_all(EngineUnavailable(f"the engine on {self.name} went away"))

    def _receive(self, body: bytes) -> None:
        message = self._messages.decode(body)
        if isinstance(message, protocol.Progress):
            if (follow := self._progress.get(message.id)) is not None:
                follow(message.steps, message.ahead)
            return
        future = self._waiting.get(message.id)
        if future is not None and not future.done():
            future.set_result(message)

    def _fail_all(self, error: Exception) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(error)

    def _send(self, message: Any) -> None:
        """Queue a frame; frames queued in one turn of the event loop go out in one write."""
        if self._writer is None:
            raise EngineUnavailable(f"the engine on {self.name} is not connected")
        self._pending.append(protocol.frame(message))
        if len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._writer is not None and self._pending:
            self._writer.writelines(self._pending)
        self._pending.clear()

    async def _call(self, message: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._waiting[message.id] = future
        try:
            self._send(message)
            return await future
        finally:
            self._waiting.pop(message.id, None)

    async def submit(self, model, payload, timeout_s, context, on_progress=None) -> BatchResult:
        request_id = next(self._ids)
        submit = protocol.Submit(
            request_id,
            model.key,
            msgspec.Raw(protocol.encode(payload)),
            timeout_s,
            protocol.TraceRef.of(context),
            progress=on_progress is not None,
        )
        if on_progress is not None:
            self._progress[request_id] = on_progress
        try:
            async with asyncio.timeout(timeout_s + ANSWER_GRACE_S):
                reply = await self._call(submit)
        except asyncio.CancelledError as exc:
            if self._writer is not None:  # the client went away: free its place in the batch
                with contextlib.suppress(EngineUnavailable):
                    self._send(protocol.Cancel(request_id, cut_off=cut_off(exc)))
            raise
        except TimeoutError:
            with contextlib.suppress(EngineUnavailable):
                self._send(protocol.Cancel(request_id))
            message = f"the engine on {self.name} did not answer by the request's deadline"
            raise EngineUnavailable(message) from None
        finally:
            self._progress.pop(request_id, None)
        if isinstance(reply, protocol.Refusal):
            raise protocol.refusal_error(reply)
        return BatchResult(
            value=self._output_decoder(model.output_type).decode(reply.output),
            batch_size=reply.batch_size,
            queue_wait_s=reply.queue_wait_s,
            run_s=reply.run_s,
            worker=reply.worker,
            batch_ref=reply.batch.context() if reply.batch is not None else None,
        )

    def _output_decoder(self, kind: type) -> msgspec.msgpack.Decoder:
        if kind not in self._outputs:
            self._outputs[kind] = protocol.decoder(kind)
        return self._outputs[kind]

    async def states(self) -> tuple[bool, dict[str, ModelState]]:
        reply = await asyncio.wait_for(
            self._call(protocol.Status(next(self._ids))), STATUS_TIMEOUT_S
        )
        models = {
            key: ModelState(status.state, status.error, status.description)
            for key, status in reply.models.items()
        }
        return reply.draining, models

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(EngineUnavailable(f"the connection to {self.name} is closed"))
