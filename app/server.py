"""uvicorn as Texel runs it: its settings, bounds on what a client may send before the
app sees a request, HTTP processes that keep their connections evenly shared, and a
graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.errors import ApiError, error_body, headers_too_large, malformed_http, request_timeout
from app.http import NoSniff
from app.settings import Settings

log = logging.getLogger("texel")

# A request's head (its request line and headers): generous for browsers' cookies and
# tokens, small enough that no client can make a process buffer much.
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADERS = 100
# How long uvicorn waits for its connections once the drain is over (`TexelServer`).
AFTER_DRAIN_S = 3


def uvicorn_config(
    app, settings: Settings, share: ConnectionShare | None = None, **kwargs
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http=functools.partial(
            BoundedHttpProtocol, head_timeout_s=settings.request_timeout_s, share=share
        ),
        log_config=None,
        timeout_keep_alive=settings.advanced.keep_alive_s,
        # After the drain every request is answered or cut off (`Runtime.cut_off`): what
        # is left is writing those answers.
        timeout_graceful_shutdown=AFTER_DRAIN_S,
        # uvicorn answers 503 once this many connections are open, so one more than the
        # connections a process holds
        limit_concurrency=settings.advanced.max_connections + 1,
        **kwargs,
    )


class ConnectionShare:
    """One HTTP process's part of the connections that all of them hold, in a table
    shared by every HTTP process (a slot each: the connections it has open).

    The kernel places each new connection on one of the processes by a hash of its
    addresses (SO_REUSEPORT), and a kept-alive connection stays where it landed, so a
    few long-lived connections (a proxy's pool, a closed loop's clients) divide unevenly
    and stay so: the busiest process queues its requests while others idle. A process
    holding more than its share answers its next request on one of them with
    `Connection: close`; the client opens a new connection, which the kernel places
    again. The share allows an eighth over the even split (at least one connection),
    and connections already told to close are not counted against it twice.
    """

    def __init__(self, table, index: int) -> None:
        self.table = table  # multiprocessing.RawArray("i", processes)
        self.index = index
        self.open = 0
        self.leaving = 0
        table[index] = 0

    def opened(self) -> None:
        self.open += 1
        self.table[self.index] = self.open

    def closed(self, leaving: bool) -> None:
        self.open -= 1
        self.leaving -= leaving
        self.table[self.index] = self.open

    def over(self) -> bool:
        """Whether one of this process's connections should go: True also counts it
        as leaving."""
        even = sum(self.table) / len(self.table)
        if self.open - self.leaving <= even + max(1.0, even / 8):
            return False
        self.leaving += 1
        return True


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that is refused."""


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools), with bounds on a request's head: its
    size, its number of headers, and the time it takes to arrive. A head over them is
    answered here, before the app sees the request; the bounds on the body are the
    app's (`app.http.BodySizeLimit`). Malformed HTTP is answered in JSON too."""

    def __init__(
        self, *args, head_timeout_s: float, share: ConnectionShare | None = None, **kwargs
    ) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s
        self.share = share
        self._leaving = False  # told to close after its response (`ConnectionShare`)
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_received = 0  # bytes received since the head began
        self._head_bytes = 0  # the head's bytes the parser has read
        self._head_fields = 0
        self._refusal: ApiError | None = None
        self._blank_lines = False  # the head timer runs for blank lines, no request yet

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.share is not None:
            self.share.opened()
        # uvicorn arms its keep-alive timer only after a response; without this a
        # connection that never sends a request would stay open.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_done()
        if self.share is not None:
            self.share.closed(self._leaving)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._head_timer is None and self._between_requests():
            # Bytes that begin no request (the blank lines HTTP lets a client send before
            # one) stopped uvicorn's keep-alive timer and start no head: without a timer
            # here, a connection that sent "\r\n" once would stay open for ever.
            self._blank_lines = True
            self._start_head_timer()
        # A head still arriving: the parser buffers an unfinished header, so its bytes
        # are counted as they come (a head that arrives whole is counted by the parser's
        # callbacks below).
        if self._head_timer is not None:
            self._head_received += len(data)
            if self._head_received > MAX_HEAD_BYTES:
                self._refuse(headers_too_large(MAX_HEAD_BYTES, MAX_HEADERS))

    def _between_requests(self) -> bool:
        """No request is being read or answered on this connection."""
        return not self.pipeline and (self.cycle is None or self.cycle.response_complete)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._blank_lines = False
        self._head_received = self._head_bytes = self._head_fields = 0
        if self._head_timer is None:  # else blank lines came first: the head began with them
            self._start_head_timer()

    def _start_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url), fields=0)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4, fields=1)  # ": " and CRLF
        super().on_header(name, value)

    def _count_head(self, size: int, fields: int) -> None:
        self._head_bytes += size
        self._head_fields += fields
        if self._head_bytes > MAX_HEAD_BYTES or self._head_fields > MAX_HEADERS:
            self._refusal = headers_too_large(MAX_HEAD_BYTES, MAX_HEADERS)
            raise _Refused  # httptools reports it as a parser error: send_400_response

    def on_headers_complete(self) -> None:
        self._head_done()
        super().on_headers_complete()
        if self.share is None or self._leaving or not self.cycle.keep_alive:
            return
        # Not with pipelined requests waiting behind this one: they would go unanswered.
        if not self.pipeline and self.share.over():
            self._leaving = True
            self.cycle.keep_alive = False  # uvicorn sends `Connection: close`, then closes

    def send_400_response(self, msg: str) -> None:
        self._refuse(self._refusal or malformed_http())

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._blank_lines:  # no request began: closed as an idle connection is
            self.transport.close()
            return
        self._refuse(request_timeout(self.head_timeout_s))

    def _head_done(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _refuse(self, error: ApiError) -> None:
        """Answer `error` and close, unless a response is on its way (to a request
        before a pipelined one): then only close. A request refused while its body
        arrives (malformed chunks) is answered here, and the app, still reading it, sees
        the client gone."""
        self._head_done()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        in_body = (
            cycle is not None and cycle.more_body and not cycle.response_started
        ) and not self.pipeline
        if in_body:
            cycle.disconnected = True  # what the app sends from now on is dropped
            cycle.message_event.set()
        if cycle is None or cycle.response_complete or in_body:
            body = error_body(error)
            head = [STATUS_LINE[error.status]]
            for name, value in self.server_state.default_headers:
                head.append(name + b": " + value + b"\r\n")
            head.append(b"content-type: application/json\r\n")
            head.append(b"%s: %s\r\n" % NoSniff.HEADER)
            head.append(b"content-length: %d\r\n" % len(body))
            head.append(b"connection: close\r\n\r\n")
            self.transport.write(b"".join(head) + body)
        self.transport.close()


class TexelServer(uvicorn.Server):
    """uvicorn, with a graceful drain on SIGTERM/SIGINT.

    The first signal marks the process not ready (load balancers stop sending),
    waits `shutdown_grace_s`, lets its requests finish for up to `drain_timeout_s`,
    answers those still running 503, then stops. A second signal answers them 503 at
    once and stops. Signals in `ignore` do nothing: an HTTP process of the launcher's
    ignores SIGINT, which Ctrl-C sends the launcher too; the launcher's SIGTERM then
    stops it as any other, after the grace and the drain.
    """

    def __init__(self, config: uvicorn.Config, runtime, ignore: tuple[int, ...] = ()) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.ignore = ignore
        self._draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig in self.ignore:
            return
        if self._draining is not None or self.should_exit:
            with contextlib.suppress(RuntimeError):  # no loop: nothing is in flight
                asyncio.get_running_loop().call_soon_threadsafe(self.runtime.cut_off)
            return super().handle_exit(sig, frame)
        log.info("received %s: draining", signal.Signals(sig).name)
        self.runtime.draining = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return super().handle_exit(sig, frame)
        self._draining = loop.create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame) -> None:
        try:
            await asyncio.sleep(self.runtime.settings.shutdown_grace_s)
            await self.runtime.drain()
        finally:
            super().handle_exit(sig, frame)
