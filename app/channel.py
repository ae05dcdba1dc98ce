"""A small asynchronous RPC channel between Texel's own processes, over a Unix socket.

Each frame is a 4-byte length and a pickle. Either end may call the other:
`await channel.call("submit", ...)` runs `handler.rpc_submit(...)` as a task on the
far side and returns its result or raises its exception here. Cancelling the
awaiting task cancels the far task too, so a client that goes away frees its place in
the batcher of the other process. Both ends are Texel processes started by the same
command, so pickle is safe; the socket lives in a directory only its user can enter.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import logging
import pickle
from typing import Any

from batching.errors import picklable

log = logging.getLogger(__name__)

_HEADER = 4
_FLUSH_AT = 1 << 20  # wait for the socket once this much is buffered


class ChannelClosed(ConnectionError):
    """The process at the other end went away, or the channel was closed."""


class Channel:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Any, name: str
    ) -> None:
        self.name = name
        self._reader = reader
        self._writer = writer
        self._handler = handler
        self._ids = itertools.count()
        self._calls: dict[int, asyncio.Future] = {}
        self._serving: dict[int, asyncio.Task] = {}
        self._pending: list[bytes] = []  # frames queued for the next flush
        self._closed = False
        self._reading = asyncio.get_running_loop().create_task(self._read())
        self.done = asyncio.get_running_loop().create_future()  # set once closed

    @classmethod
    async def connect(cls, path: str, handler: Any, name: str) -> Channel:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer, handler, name)

    @property
    def closed(self) -> bool:
        return self._closed

    async def call(self, method: str, *args: Any) -> Any:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        try:
            await self._send(("call", call_id, method, args))
            return await future
        except asyncio.CancelledError:
            if not self._closed:
                self._write(("cancel", call_id, None, None))
            raise
        finally:
            self._calls.pop(call_id, None)

    def close(self) -> None:
        self._shut(ChannelClosed(f"{self.name}: closed"))

    def _write(self, message: tuple) -> None:
        """Queue a frame. Frames queued in one turn of the event loop (a batch's answers,
        requests arriving together) go out in one write: one system call, not one each."""
        if self._closed:
            raise ChannelClosed(f"{self.name}: closed")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._pending.append(len(data).to_bytes(_HEADER, "big"))
        self._pending.append(data)
        if len(self._pending) == 2:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        if self._pending and not self._closed:
            self._writer.writelines(self._pending)
        self._pending.clear()

    async def _send(self, message: tuple) -> None:
        self._write(message)
        if self._writer.transport.get_write_buffer_size() > _FLUSH_AT:
            try:
                await self._writer.drain()
            except ConnectionError as exc:
                raise ChannelClosed(f"{self.name}: {exc}") from exc

    async def _read(self) -> None:
        reason: BaseException = ChannelClosed(f"{self.name}: the other process closed it")
        try:
            while True:
                size = int.from_bytes(await self._reader.readexactly(_HEADER), "big")
                kind, call_id, first, second = pickle.loads(await self._reader.readexactly(size))
                if kind == "call":
                    task = asyncio.get_running_loop().create_task(
                        self._serve(call_id, first, second)
                    )
                    self._serving[call_id] = task
                elif kind == "cancel":
                    # pop: a task cancelled before it started never runs its `finally`
                    if (task := self._serving.pop(call_id, None)) is not None:
                        task.cancel()
                elif (future := self._calls.get(call_id)) is not None and not future.done():
                    if kind == "ok":
                        future.set_result(first)
                    else:
                        future.set_exception(first)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            reason = ChannelClosed(f"{self.name}: closed")
        except Exception as exc:  # a frame that does not unpickle: the channel is unusable
            log.exception("%s: bad frame", self.name)
            reason = ChannelClosed(f"{self.name}: {type(exc).__name__}: {exc}")
        self._shut(reason)

    async def _serve(self, call_id: int, method: str, args: tuple) -> None:
        try:
            result = getattr(self._handler, f"rpc_{method}")(*args)
            if inspect.isawaitable(result):
                result = await result
            reply = ("ok", call_id, result, None)
        except asyncio.CancelledError:
            return  # the caller cancelled; nobody waits for a reply
        except Exception as exc:
            reply = ("error", call_id, picklable(exc), None)
        finally:
            self._serving.pop(call_id, None)
        try:
            await self._send(reply)
        except ChannelClosed:
            pass
        except Exception as exc:  # the result did not pickle
            log.exception("%s: could not send the reply to %s", self.name, method)
            self._write(("error", call_id, RuntimeError(f"{method}: {exc}"), None))

    def _shut(self, reason: BaseException) -> None:
        if self._closed:
            return
        with contextlib.suppress(Exception):  # answers already made still go out
            self._flush()
        self._closed = True
        for future in self._calls.values():
            if not future.done():
                future.set_exception(reason)
        for task in self._serving.values():
            task.cancel()
        if self._reading is not asyncio.current_task():
            self._reading.cancel()
        self._writer.close()
        if not self.done.done():
            self.done.set_result(None)
