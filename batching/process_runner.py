"""A `BatchRunner` whose batches run in a child process, under its own interpreter lock.

Why: in one process the GPU worker shares Python's interpreter lock with the event
loop and every other thread. A GPU worker gives the lock up at each GPU
synchronization and then waits to get it back while the event loop parses HTTP. On an
H200 a served batch of 62 formulas took 154 ms, where the model alone runs 128 in
78 ms, and the event loop held the lock in 46% of a profile's samples (README,
Benchmarks). In a child process the model has an interpreter to itself; the serving
process's compute thread only sends the payloads and waits on a pipe. Measured on the
H200 with 4 preprocessing processes: 380 formulas/s at concurrency 128 against 289
with the batches on a thread, so it is the default on a GPU.

`build` is a picklable callable that runs in the child: it loads the model, warms it
up and returns `(runner, info)`; `info` (a small picklable dict) comes back from
`start()`. The child is spawned (never forked: the parent may hold CUDA state) and
exits when the pipe closes or the parent dies. A batch's exception is re-raised in
the parent, so `OutOfMemory` still splits batches; `should_stop` is relayed to the
child through a shared flag.

A runner with a `stream` attribute (a `StreamRunner`) also streams: `run_stream(feed)`
relays the batcher's `Feed` over the pipe. The parent forwards new requests ("add")
and cancellations as they come, the child sends answers ("done") as rows finish and
says "idle" with the count of requests it has received when it has nothing left; the
parent ends the stream ("end") only if that count is all it sent and the feed has
nothing new, so a request in flight on the pipe is never dropped.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from batching.batcher import BatchRunner, ShouldStop
from batching.errors import BatchFailed, picklable
from batching.stream import Feed

Build = Callable[[], tuple[BatchRunner, dict]]
Report = Callable[[], Any]

log = logging.getLogger(__name__)


class ProcessRunner:
    """Runs batches in one spawned child process; call `start()` once, then call it.

    A child that dies fails the batch it was running (`BatchFailed`), and is started
    again, loading and warming up anew, before the next batch. `report`, if given, runs
    in the child once it is ready and after every batch; its latest value is
    `reported` (the worker's GPU memory, which the serving process cannot read).
    """

    def __init__(
        self, build: Build, name: str, poll_s: float = 0.005, report: Report | None = None
    ) -> None:
        self.build = build
        self.name = name
        self.poll_s = poll_s
        self.report = report
        self.reported: Any = None
        self.info: dict = {}
        self.streams = False  # whether the child's runner can stream (`run_stream`)
        self.restarts = 0
        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()
        self._process = None
        self._conn = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> dict:
        """Start the child and block until it has loaded and warmed up; its `info`."""
        self._conn, child_conn = self._context.Pipe()
        self._process = self._context.Process(
            target=_serve,
            args=(self.build, child_conn, self._stop, os.getpid(), self.report),
            name=self.name,
            daemon=True,
        )
        self._process.start()
        child_conn.close()  # the child holds its end; EOF here means it died
        kind, value = self._receive()
        if kind != "ready":
            self.close()
            raise value
        self.info, self.streams = value
        return self.info

    def __call__(self, payloads: list[Any], should_stop: ShouldStop) -> list[Any]:
        kind, value = self._run(payloads, should_stop)
        if kind == "lost":  # gone before it took the batch (killed while idle): once more
            kind, value = self._run(payloads, should_stop)
        if kind in ("error", "lost"):
            raise value
        return value

    def _run(self, payloads: list[Any], should_stop: ShouldStop) -> tuple[str, Any]:
        if not self._process.is_alive():
            self._restart()
        self._stop.clear()
        try:
            self._conn.send(payloads)
        except OSError:
            return "lost", self._died()
        return self._receive(should_stop)

    @property
    def stream(self):
        """`run_stream` when the child's runner streams, else None (as an adapter's
        runner has or lacks a `stream`)."""
        return self.run_stream if self.streams else None

    def run_stream(self, feed: Feed, take_limit: int = 1 << 16) -> None:
        """Relay a stream between the batcher's `feed` and the child (module docstring).

        The batcher never offers more than the child's rows, so everything offered is
        forwarded at once; the child admits it at its next step boundary.
        """
        if not self._process.is_alive():
            self._restart()
        first = feed.take(take_limit)
        sent, outstanding, cancels = len(first), {key for key, _ in first}, set()
        try:
            self._conn.send(("stream", first))
            while True:
                if self._conn.poll(self.poll_s):
                    kind, value = self._conn.recv()
                    if kind == "done":
                        outstanding.difference_update(key for key, _ in value)
                        feed.done(value)
                    elif kind == "report":
                        self.reported = value
                    elif kind == "idle":
                        if value == sent and feed.finish():
                            self._conn.send(("end", None))
                            return
                    elif kind == "error":
                        raise value
                new = feed.take(take_limit)
                if new:
                    self._conn.send(("add", new))
                    sent += len(new)
                    outstanding.update(key for key, _ in new)
                gone = set(feed.cancelled(list(outstanding))) - cancels
                if gone:
                    self._conn.send(("cancel", list(gone)))
                    cancels |= gone
        except (EOFError, OSError):
            raise self._died() from None

    def close(self) -> None:
        """Ask the child to exit, then make sure it has."""
        if self._process is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._conn.send(None)
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        self._conn.close()

    def _restart(self) -> None:
        log.warning(
            "worker process %s (pid %s) exited with code %s; starting it again",
            self.name,
            self.pid,
            self._process.exitcode,
        )
        self.close()
        self.restarts += 1
        self.start()

    def _receive(self, should_stop: ShouldStop | None = None) -> tuple[str, Any]:
        """The child's reply, relaying `should_stop` while waiting. A report before it is
        kept in `reported`; a child that died before saying it took the batch ("taken")
        is "lost", after it "error"."""
        taken = False
        try:
            while True:
                while should_stop is not None and not self._conn.poll(self.poll_s):
                    if not self._stop.is_set() and should_stop():
                        self._stop.set()
                kind, value = self._conn.recv()
                if kind == "taken":
                    taken = True
                elif kind == "report":
                    self.reported = value
                else:
                    return kind, value
        except (EOFError, OSError):
            return ("error" if taken else "lost"), self._died()

    def _died(self) -> BatchFailed:
        self._process.join(timeout=5)
        code = self._process.exitcode
        return BatchFailed(f"worker process {self.name} died (exit code {code})")


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """In a child process: end it once the process that started it is gone.

    Process pools and `ProcessRunner` notice an orderly shutdown, but not a parent
    killed outright (SIGKILL, OOM killer); their children would live on, orphaned.
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="texel-parent-watch", daemon=True).start()


def _serve(build: Build, conn, stop, parent_pid: int, report: Report | None = None) -> None:
    """The child: build the runner, report ready, then run batches until told to stop."""
    exit_with_parent(parent_pid)
    try:
        run, info = build()
    except BaseException as exc:  # reported to start(), which raises it in the parent
        conn.send(("error", picklable(exc)))
        return
    stream = getattr(run, "stream", None)
    # The model and its libraries live as long as the process: keep the garbage
    # collector's full collections from scanning them between batches.
    gc.collect()
    gc.freeze()
    _send_report(conn, report)
    conn.send(("ready", (info, stream is not None)))
    while True:
        try:
            payloads = conn.recv()
        except (EOFError, OSError):
            return
        if payloads is None:
            return
        if isinstance(payloads, tuple):
            if payloads[0] != "stream":
                # Sent to a stream that has failed before the parent heard it failed.
                continue
            feed = _ChildFeed(conn, payloads[1])
            try:
                stream(feed)
            except Exception as exc:
                if feed.quit:
                    return
                conn.send(("error", picklable(exc)))
            if feed.quit:
                return
            _send_report(conn, report)
            continue
        conn.send(("taken", None))
        try:
            result = run(payloads, stop.is_set)
        except Exception as exc:
            _send_report(conn, report)
            conn.send(("error", picklable(exc)))
        else:
            _send_report(conn, report)
            conn.send(("ok", result))


class _ChildFeed:
    """In the child: the stream's `Feed`, over the pipe (see `ProcessRunner.run_stream`)."""

    def __init__(self, conn, first: list[tuple[int, Any]]) -> None:
        self.conn = conn
        self.inbox = deque(first)
        self.received = len(first)
        self.gone: set[int] = set()
        self.ended = False
        self.quit = False  # the parent closed the pipe or asked the child to exit

    def take(self, limit: int) -> list[tuple[int, Any]]:
        self._pump()
        return [self.inbox.popleft() for _ in range(min(limit, len(self.inbox)))]

    def cancelled(self, keys: list[int]) -> list[int]:
        self._pump()
        return [key for key in keys if key in self.gone]

    def done(self, results: list[tuple[int, Any]]) -> None:
        answers = [(k, picklable(v) if isinstance(v, BaseException) else v) for k, v in results]
        try:
            self.conn.send(("done", answers))
        except OSError:  # the parent is gone; the stream runs out its rows and ends
            self.ended = self.quit = True

    def finish(self) -> bool:
        self._pump()
        if self.inbox:
            return False
        self.conn.send(("idle", self.received))
        while not self.inbox and not self.ended:
            self._pump(block=True)
        return not self.inbox

    def _pump(self, block: bool = False) -> None:
        """Read whatever the parent sent (waiting for one message with `block`)."""
        while not self.ended and (block or self.conn.poll()):
            block = False
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = None
            if message is None:
                self.ended = self.quit = True
                if self.inbox:  # nobody is left to answer
                    self.inbox.clear()
                return
            kind, value = message
            if kind == "add":
                self.inbox.extend(value)
                self.received += len(value)
            elif kind == "cancel":
                self.gone.update(value)
            elif kind == "end":
                self.ended = True


def _send_report(conn, report: Report | None) -> None:
    if report is None:
        return
    try:
        conn.send(("report", report()))
    except Exception:  # a report is an extra; the batch's reply must still go
        log.exception("worker report failed")
