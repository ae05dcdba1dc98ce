"""The asyncio batcher: one owner of the queue, worker threads that run batches.

Callers `submit()` a preprocessed payload with its bucket key and get back a
`BatchResult`. A single scheduler task owns the `BucketQueue`; it forms a batch
whenever a worker is idle and the policy says a bucket is ready, and hands the
batch to that worker's thread so the event loop stays free for HTTP.

A worker with a `stream` runner batches continuously (`batching.stream`): the
first request starts a stream at once (no wait for company, which can join it at its
next check), and while it runs the scheduler hands it
every queued request it has room for, at once, whatever its bucket; each
request's answer returns the moment its row finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from batching.errors import (
    BatchFailed,
    Cancelled,
    DeadlineExceeded,
    Draining,
    OutOfMemory,
    cut_off,
)
from batching.queue import (
    BatchPlan,
    BatchPolicy,
    BucketQueue,
    DrainRate,
    Pending,
    State,
)
from batching.stream import Feed, Joined, StreamRunner

log = logging.getLogger(__name__)

ShouldStop = Callable[[], bool]


class BatchRunner(Protocol):
    """Runs one batch on one device. Called on that device's worker thread.

    Returns one result per payload, in order. A result may be an `Exception`
    instance, which fails only that request. Long computations should poll
    `should_stop()` and stop early when it returns True (every member cancelled).
    """

    def __call__(self, payloads: list[Any], should_stop: ShouldStop) -> list[Any]: ...


class ComputeThread(ThreadPoolExecutor):
    """The one thread that runs a device's batches, counting the calls waiting for it.

    Shared by several models (one compute thread per CPU), it lets a continuous stream
    see that another model's batch waits, and give way (`batching.stream`).
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(max_workers=1, **kwargs)
        self._count_lock = threading.Lock()
        self.waiting = 0

    def submit(self, fn, /, *args, **kwargs):
        with self._count_lock:
            self.waiting += 1

        def started():
            with self._count_lock:
                self.waiting -= 1
            return fn(*args, **kwargs)

        return super().submit(started)


@dataclass(frozen=True)
class Worker:
    """A device and the function that runs batches on it.

    `executor` is the single thread that runs them; pass one to share a device's
    thread between batchers (a CPU should have one compute thread), else the
    batcher makes its own. With `stream`, batches run continuously through it
    instead of `run` (which the batcher then does not call); `on_step` is called on the
    worker's thread at each of a stream's step boundaries (`Feed.take`), for whoever times
    the device's work; `shares_device` says whether another model is on the worker's
    device (`Feed.shares_device`).
    """

    name: str
    run: BatchRunner
    executor: Executor | None = None
    stream: StreamRunner | None = None
    on_step: Callable[[], None] | None = None
    shares_device: Callable[[], bool] | None = None


class BatchObserver(Protocol):
    """Hooks through which telemetry watches the batcher without the batcher knowing it."""

    def batch(
        self, batcher: str, worker: str, bucket: Hashable, items: list[Pending]
    ) -> contextlib.AbstractContextManager[Any]: ...

    def join(
        self, batcher: str, worker: str, bucket: Hashable, items: list[Pending], running: int
    ) -> tuple[Any, Any]:
        """Requests joined a running stream, `running` rows in all now: returns (handle,
        ref), `ref` for the requests to link to, `handle` for `leave()`."""
        ...

    def leave(self, handle: Any) -> None:
        """Every request of one `join()` has its answer."""
        ...

    def queue_depth(self, batcher: str, depth: int) -> None: ...

    def rejected(self, batcher: str, reason: str) -> None: ...


class _NullObserver:
    @contextlib.contextmanager
    def batch(self, batcher: str, worker: str, bucket: Hashable, items: list[Pending]):
        yield None

    def join(self, batcher, worker, bucket, items, running) -> tuple[Any, Any]:
        return None, None

    def leave(self, handle: Any) -> None:
        pass

    def queue_depth(self, batcher: str, depth: int) -> None:
        pass

    def rejected(self, batcher: str, reason: str) -> None:
        pass


@dataclass(frozen=True)
class BatchResult:
    """What a request gets back: its own output plus facts about its batch."""

    value: Any
    batch_size: int
    queue_wait_s: float
    run_s: float
    worker: str
    batch_ref: Any = None  # whatever the observer's batch scope yielded (a span context)


@dataclass(frozen=True)
class _Outcome:
    value: Any
    error: BaseException | None
    batch_size: int
    worker: str
    started: float
    finished: float
    batch_ref: Any


class Batcher:
    """Groups concurrent requests of one model into batches by bucket."""

    def __init__(
        self,
        name: str,
        workers: Sequence[Worker],
        policy: BatchPolicy,
        *,
        observer: BatchObserver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not workers:
            raise ValueError("a batcher needs at least one worker")
        self.name = name
        self.policy = policy
        self._workers = list(workers)
        self._observer = observer or _NullObserver()
        self._clock = clock
        self._queue = BucketQueue(policy)
        self._drain_rate = DrainRate()
        self._idle: list[Worker] = list(reversed(self._workers))
        self._executors: dict[str, Executor] = {}
        self._owned: list[ThreadPoolExecutor] = []
        for w in self._workers:
            if w.executor is None:
                own = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"texel-{name}-{w.name}")
                self._owned.append(own)
            self._executors[w.name] = w.executor or own
        self._tasks: set[asyncio.Task] = set()
        self._inflight = 0  # batches (and streams) handed to a worker and not yet resolved
        self._streams: dict[str, Feed] = {}  # running streams, by worker
        self._batch_started: dict[str, float] = {}  # running whole batches, by worker
        self._wakeup = asyncio.Event()
        self._idle_event = asyncio.Event()
        self._scheduler: asyncio.Task | None = None
        self._draining = False
        self._stopping = False
        self.scheduling_steps = 0  # how often the scheduler woke up (tests check it idles)

    # -- lifecycle -----------------------------------------------------------

    def start(self) -> None:
        if self._scheduler is None:
            self._scheduler = asyncio.get_running_loop().create_task(
                self._schedule(), name=f"texel-batcher-{self.name}"
            )

    async def drain(self, timeout_s: float | None = None) -> bool:
        """Refuse new requests, flush every bucket, wait for running batches.

        Returns True when everything finished within `timeout_s`.
        """
        self._draining = True
        self._wake()
        try:
            await asyncio.wait_for(self._wait_idle(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        """Stop the scheduler and the worker threads. Call `drain()` first to finish work."""
        self._draining = True
        # The flag as well as the cancellation: asyncio.wait_for (Python 3.11) swallows a
        # cancellation that arrives as the event it waits for is set.
        self._stopping = True
        if self._scheduler is not None:
            self._scheduler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scheduler
            self._scheduler = None
        for item in list(self._queue):
            self._queue.remove(item)
            self._fail(item, Draining("the server is shutting down"), "draining")
        for executor in self._owned:
            executor.shutdown(wait=False, cancel_futures=True)

    # -- introspection -------------------------------------------------------

    @property
    def depth(self) -> int:
        """Requests waiting for a batch (not those running)."""
        return len(self._queue)

    @property
    def queued_cost(self) -> float:
        return self._queue.queued_cost

    @property
    def draining(self) -> bool:
        return self._draining

    # -- the request path ----------------------------------------------------

    async def submit(
        self,
        payload: Any,
        *,
        bucket: Hashable,
        timeout_s: float,
        cost: float = 1.0,
        context: Any = None,
        on_progress: Callable[[int, int | None], None] | None = None,
    ) -> BatchResult:
        """Queue one request and wait for its result.

        Raises `QueueFull`, `Draining`, `DeadlineExceeded` or `BatchFailed`;
        cancelling the awaiting task removes the request (or, once it runs, asks
        the batch to stop when all its members are gone). `on_progress(steps done,
        requests ahead in the queue)` is called on the event loop: once queued (0 steps),
        then at every step a stream reports (`Feed.progress`).
        """
        if self._draining:
            self._observer.rejected(self.name, "draining")
            raise Draining("the server is shutting down and accepts no new requests")
        now = self._clock()
        item = Pending(
            payload=payload,
            bucket=bucket,
            cost=cost,
            enqueued_at=now,
            deadline=now + timeout_s,
            context=context,
        )
        loop = asyncio.get_running_loop()
        item.future = loop.create_future()
        if on_progress is not None:
            item.progress = lambda steps: loop.call_soon_threadsafe(on_progress, steps, None)
        retry_after = self._drain_rate.retry_after(len(self._queue) + 1)
        ahead = len(self._queue)
        try:
            self._queue.push(item, retry_after_s=retry_after)
        except Exception:
            self._observer.rejected(self.name, "queue_full")
            raise
        if on_progress is not None:
            on_progress(0, ahead)
        self._observer.queue_depth(self.name, len(self._queue))
        self._wake()
        try:
            outcome: _Outcome = await asyncio.wait_for(
                asyncio.shield(item.future), max(0.0, item.deadline - self._clock())
            )
        except TimeoutError:
            if item.future.done():  # the scheduler expired it at the same moment
                outcome = item.future.result()
            else:
                self._abandon(item)
                self._observer.rejected(self.name, "deadline")
                raise DeadlineExceeded(f"no result within {timeout_s:g} s") from None
        except asyncio.CancelledError as exc:
            self._abandon(item)
            self._observer.rejected(self.name, "draining" if cut_off(exc) else "cancelled")
            raise
        if outcome.error is not None:
            raise outcome.error
        return BatchResult(
            value=outcome.value,
            batch_size=outcome.batch_size,
            queue_wait_s=outcome.started - item.enqueued_at,
            run_s=outcome.finished - outcome.started,
            worker=outcome.worker,
            batch_ref=outcome.batch_ref,
        )

    def _abandon(self, item: Pending) -> None:
        """The caller stopped waiting: free its slot, or flag it for a running batch."""
        item.cancelled = True
        if item.state is State.QUEUED and self._queue.remove(item):
            item.state = State.DONE
            self._observer.queue_depth(self.name, len(self._queue))
            self._wake()

    # -- the scheduler -------------------------------------------------------

    def _wake(self) -> None:
        self._wakeup.set()

    async def _schedule(self) -> None:
        due = -math.inf
        while not self._stopping:
            self._wakeup.clear()
            try:
                self._plan_batches(due)
            except Exception:  # a bug here must not silently stall every request
                log.exception("batcher %s: scheduling step failed", self.name)
            # With every worker busy only deadlines matter: a finishing batch wakes us.
            wakeup = self._queue.next_wakeup(include_wait=bool(self._idle))
            timeout = None if wakeup is None else max(0.0, wakeup - self._clock())
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
                due = -math.inf
            except TimeoutError:
                # The event loop runs a timer up to its clock's resolution early, so the
                # clock may still read a hair before `wakeup`: that moment has come all the
                # same. Else the next sleep would be shorter than the resolution, and on a
                # loop whose time stands still while it runs (a virtual clock) endless.
                due = wakeup

    def _plan_batches(self, due: float = -math.inf) -> None:
        """One scheduling step; `due`: a time the clock is known to have reached."""
        self.scheduling_steps += 1
        now = max(self._clock(), due)
        for item in self._queue.expire(now):
            self._fail(item, DeadlineExceeded("the request waited past its deadline"), "deadline")
        # Idle workers first: a device with nothing queued on it is the least loaded.
        while self._idle:
            # A stream takes company at every check, so waiting for it buys nothing.
            at_once = self._draining or self._idle[-1].stream is not None
            plan = self._queue.next_batch(now, flush=at_once)
            if plan is None:
                break
            self._launch(self._idle.pop(), plan)
        self._top_up_streams()
        self._observer.queue_depth(self.name, len(self._queue))
        if not self._queue and not self._inflight:
            self._idle_event.set()

    def _launch(self, worker: Worker, plan: BatchPlan) -> None:
        self._idle_event.clear()
        for item in plan.items:
            item.state = State.RUNNING
        self._inflight += 1
        if worker.stream is not None:
            run = self._execute_stream(worker, self._start_stream(worker, plan.items))
        else:
            run = self._execute(worker, plan)
        task = asyncio.get_running_loop().create_task(run)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _execute(self, worker: Worker, plan: BatchPlan) -> None:
        loop = asyncio.get_running_loop()
        try:
            outcomes = await loop.run_in_executor(
                self._executors[worker.name], self._run_plan, worker, plan.bucket, plan.items
            )
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            # Its thread was shut down (`Engine.close`) with the batch still waiting for it.
            for item in plan.items:
                self._fail(item, Draining("the server is shutting down"), "draining")
            self._worker_free(worker)
            return
        except Exception as exc:  # the executor itself failed (shut down)
            outcomes = [self._failure(exc, len(plan.items)) for _ in plan.items]
        self._drain_rate.record(
            self._clock(), len(plan.items), min(outcome.started for outcome in outcomes)
        )
        for item, outcome in zip(plan.items, outcomes, strict=True):
            item.state = State.DONE
            if not item.future.done():
                item.future.set_result(outcome)
        self._worker_free(worker)

    def _worker_free(self, worker: Worker) -> None:
        """A worker's batch or stream is over: it takes the next."""
        self._inflight -= 1
        self._idle.append(worker)
        self._wake()

    # -- streams (continuous batching) ---------------------------------------

    def _top_up_streams(self) -> None:
        """Hand queued requests to running streams with room, at once, any bucket: each
        request, oldest first, to the stream whose device has the least predicted work
        queued (`Feed.load`, from the requests' costs), so several devices share the
        work by what it costs rather than by request count."""
        limit = self.policy.max_batch_size
        room = {feed: limit - feed.holding for feed in self._streams.values()}
        room = {feed: free for feed, free in room.items() if free > 0}
        if not self._queue or not room:
            return
        load = {feed: feed.load for feed in room}
        handed: dict[Feed, list[Pending]] = {feed: [] for feed in room}
        for item in self._queue.take_oldest(sum(room.values())):
            feed = min((f for f in room if len(handed[f]) < room[f]), key=load.__getitem__)
            handed[feed].append(item)
            load[feed] += item.cost
        for feed, items in handed.items():
            if not items:
                continue
            if feed.offer(items):
                for item in items:
                    item.state = State.RUNNING
            else:  # the stream is ending; these wait for the next launch
                self._queue.restore(items)

    def _start_stream(self, worker: Worker, items: list[Pending]) -> Feed:
        feed = self._new_feed(worker)
        feed.offer(items)
        self._streams[worker.name] = feed
        return feed

    def _new_feed(self, worker: Worker) -> Feed:
        loop = asyncio.get_running_loop()
        feed = Feed(
            lambda answered: loop.call_soon_threadsafe(self._deliver, feed, worker, answered),
            clock=self._clock,
            on_join=lambda joined, running: self._observer.join(
                self.name, worker.name, max(item.bucket for item in joined), joined, running
            ),
            on_leave=self._observer.leave,
            yield_when=lambda: getattr(self._executors[worker.name], "waiting", 0) > 0,
            on_step=worker.on_step,
            shares_device=worker.shares_device,
        )
        return feed

    async def _execute_stream(self, worker: Worker, feed: Feed) -> None:
        loop = asyncio.get_running_loop()
        try:
            error = await loop.run_in_executor(
                self._executors[worker.name], self._run_stream, worker, feed
            )
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            # Its thread was shut down (`Engine.close`) before the stream began.
            error = Draining("the server is shutting down")
        except Exception as exc:  # the executor itself failed (shut down)
            error = exc
        # Answers the worker sent are delivered before this resumes (both go through
        # call_soon_threadsafe, in order); whatever is left never got one.
        self._streams.pop(worker.name, None)
        if feed.parked is not None and error is None and self._scheduler is not None:
            # It gave the thread up to other work: it runs on behind that work, with the
            # same requests, and the worker stays busy meanwhile.
            resumed = self._new_feed(worker)
            resumed.resume(feed)
            self._streams[worker.name] = resumed
            task = loop.create_task(self._execute_stream(worker, resumed))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        untaken, left = feed.leftovers()
        if untaken and error is None and self._scheduler is not None:
            # Offered while it ended (it gave way to other work): queue again.
            for item in untaken:
                item.state = State.QUEUED
            self._queue.restore([item for item in untaken if not item.cancelled])
            self._observer.queue_depth(self.name, len(self._queue))
        elif untaken and error is None:  # the batcher has closed meanwhile
            for item in untaken:
                self._fail(item, Draining("the server is shutting down"), "draining")
        elif untaken:  # the stream failed before taking them: they fail with it
            left = left + untaken
        if left and isinstance(error, Draining):
            for item in left:
                self._fail(item, error, "draining")
        elif left:
            if error is None:
                error = BatchFailed(f"the {worker.name} worker ended without answering")
                log.error("stream on %s ended with %d requests unanswered", worker.name, len(left))
            failure = self._failure(error, len(left)).error
            for item in left:
                self._fail(item, failure, None)
        self._worker_free(worker)

    def _run_stream(self, worker: Worker, feed: Feed) -> BaseException | None:
        """On the worker thread: run the stream until it finishes; its failure, if any."""
        try:
            worker.stream(feed)
        except OutOfMemory as exc:
            log.error("stream on %s ran out of device memory", worker.name)
            return BatchFailed(f"the device ran out of memory: {exc}")
        except Exception as exc:
            log.exception("stream failed on %s", worker.name)
            return exc
        return None

    def _deliver(
        self, feed: Feed, worker: Worker, answered: list[tuple[Pending, Any, Joined, float]]
    ) -> None:
        """On the event loop: answers from a stream, each as its row finished."""
        for item, value, joined, finished in answered:
            error = value if isinstance(value, Exception) else None
            if error is not None and not isinstance(error, Cancelled | BatchFailed):
                error = BatchFailed(f"the model failed on this request: {error}")
            outcome = _Outcome(
                value=None if error is not None else value,
                error=error,
                batch_size=joined.running,
                worker=worker.name,
                started=joined.started,
                finished=finished,
                batch_ref=joined.ref,
            )
            item.state = State.DONE
            if not item.future.done():
                item.future.set_result(outcome)
        feed.delivered += len(answered)
        feed.delivered_cost += sum(item.cost for item, *_ in answered)
        started = min((joined.started for _, _, joined, _ in answered), default=self._clock())
        self._drain_rate.record(self._clock(), len(answered), started)
        self._wake()

    def stalled_s(self) -> float:
        """How long the longest-running worker has gone without a sign of life: a whole
        batch since it started, a stream since it last checked for requests; 0 if idle."""
        now = self._clock()
        times = [*self._batch_started.values(), *(f.alive_at for f in self._streams.values())]
        return max((now - t for t in times), default=0.0)

    def _run_plan(self, worker: Worker, bucket: Hashable, items: list[Pending]) -> list[_Outcome]:
        """Run a batch on the worker thread; split it in halves on out-of-memory."""
        live = [item for item in items if not item.cancelled]
        if not live:
            return [self._failure(Cancelled("the client went away"), 0) for _ in items]
        started = self._clock()
        self._batch_started[worker.name] = started
        try:
            return self._run_live(worker, bucket, items, live, started)
        finally:
            self._batch_started.pop(worker.name, None)

    def _run_live(
        self, worker: Worker, bucket: Hashable, items: list[Pending], live: list[Pending], started
    ) -> list[_Outcome]:
        try:
            with self._observer.batch(self.name, worker.name, bucket, live) as ref:
                values = worker.run([item.payload for item in live], lambda: _all_cancelled(live))
        except OutOfMemory as exc:
            if len(live) == 1:
                return self._merge(items, live, [self._failure(exc, 1, oom=True)])
            half = len(live) // 2
            log.warning(
                "batch of %d did not fit on %s; retrying as %d + %d",
                len(live),
                worker.name,
                half,
                len(live) - half,
            )
            return self._merge(
                items,
                live,
                self._run_plan(worker, bucket, live[:half])
                + self._run_plan(worker, bucket, live[half:]),
            )
        except Exception as exc:
            log.exception("batch of %d failed on %s", len(live), worker.name)
            return self._merge(items, live, [self._failure(exc, len(live)) for _ in live])
        finished = self._clock()
        if len(values) != len(live):
            error = BatchFailed(f"the model returned {len(values)} results for {len(live)} inputs")
            return self._merge(items, live, [self._failure(error, len(live)) for _ in live])
        outcomes = [
            _Outcome(
                value=None if isinstance(v, Exception) else v,
                error=v if isinstance(v, Exception) else None,
                batch_size=len(live),
                worker=worker.name,
                started=started,
                finished=finished,
                batch_ref=ref,
            )
            for v in values
        ]
        return self._merge(items, live, outcomes)

    def _merge(
        self, items: list[Pending], live: list[Pending], outcomes: list[_Outcome]
    ) -> list[_Outcome]:
        by_item = dict(zip(map(id, live), outcomes, strict=True))
        cancelled = self._failure(Cancelled("the client went away"), 0)
        return [by_item.get(id(item), cancelled) for item in items]

    def _failure(self, exc: BaseException, batch_size: int, oom: bool = False) -> _Outcome:
        if isinstance(exc, Cancelled | BatchFailed):
            error: BaseException = exc
        elif oom:
            error = BatchFailed("the request does not fit in device memory even alone")
        else:
            error = BatchFailed(f"the model failed on this batch: {type(exc).__name__}: {exc}")
        now = self._clock()
        return _Outcome(None, error, batch_size, "", now, now, None)

    def _fail(self, item: Pending, error: BaseException, reason: str | None) -> None:
        item.state = State.DONE
        if item.future is not None and not item.future.done():
            now = self._clock()
            item.future.set_result(_Outcome(None, error, 0, "", now, now, None))
        if reason:
            self._observer.rejected(self.name, reason)

    async def _wait_idle(self) -> None:
        while self._queue or self._inflight:
            self._idle_event.clear()
            self._wake()
            await self._idle_event.wait()


def _all_cancelled(items: list[Pending]) -> bool:
    return all(item.cancelled for item in items)
