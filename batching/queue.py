"""Bucketed request queue and the batch-forming policy.

Pure state with the clock passed in: no asyncio, no threads, so every rule
(size and wait limits, ordering by deadline, capacity, expiry) is testable with
a fake clock. The asyncio `Batcher` owns one `BucketQueue` and is the only
thing that touches it.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

from batching.errors import QueueFull


@dataclass(frozen=True)
class BatchPolicy:
    """When a bucket becomes a batch.

    A bucket launches once it holds `max_batch_size` requests or its oldest
    request has waited `max_wait_s`; at most `max_queue` requests wait in all.
    The wait counts from when a request could first have run: its arrival, or,
    if every worker was busy then, the moment one became free. Under load a
    batch's answers go back together and their clients' next requests arrive
    over the next milliseconds; counting from the free worker lets them join the
    requests already waiting, where counting from arrival would launch those at
    once and leave two half-size cohorts alternating on the device for good.

    `merge_buckets` is for models whose batch cost is mostly per batch, not per
    padded element (a launch-bound decoder): bucket keys are then numbers (a
    padded width), a launching batch that has room is topped up from the nearest
    other buckets, and the batch's bucket is the largest key in it. Buckets count
    as full together once they hold `max_batch_size` requests between them.

    `max_rejoin_s` is the wait, counted from the free worker, of a bucket whose oldest
    request queued while every worker was busy, when that should be longer than
    `max_wait_s`: long enough for the finished batch's clients to send their next
    requests (for a model whose batch takes a second, some tens of milliseconds of
    HTTP and encoding). The same window lets a worker that just finished a batch of
    `k` requests wait for `k` to be queued again (`awaited`): with as many clients as
    the batch holds, none queues while it runs, and without it the first clients back
    would launch a part batch and the rest the next, two cohorts for good. It launches
    as soon as they are back, so a lone user (a batch of one) waits for nothing, not
    even `max_wait_s`. Both waits are for clients that come back; when a batch's
    clients stop coming back within the window (independent users, arriving at
    random), the batcher stops waiting for them (`ReturnRate`).
    """

    max_batch_size: int = 8
    max_wait_s: float = 0.01
    max_queue: int = 256
    merge_buckets: bool = False
    max_rejoin_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_wait_s < 0:
            raise ValueError("max_wait_s must not be negative")
        if self.max_queue < 1:
            raise ValueError("max_queue must be at least 1")
        if self.max_rejoin_s < 0:
            raise ValueError("max_rejoin_s must not be negative")


class ReturnRate:
    """Whether the clients of finished batches come back within the rejoin window.

    For each finished batch of `k` requests it counts the arrivals in the `window_s`
    after it and averages `min(1, arrivals / k)` over recent batches (exponentially,
    weight `smoothing`). Closed-loop clients, each sending its next request once its
    answer is in, give the share of them back within the window: about 1 when the
    window covers their spread. Independent users arriving at random at a rate r fill
    batches of about r times the batch's duration T, and r times the window W arrive
    in it: about W / T, under a half for any window shorter than half a batch (images:
    250 ms against about a second). While the average is below `threshold` the
    batcher does not wait for returns at all; it counts on, so clients that start
    coming back turn the wait on again within a few batches. It starts at 1
    (waiting), the closed loop being where waiting matters.
    """

    def __init__(self, window_s: float, threshold: float = 0.5, smoothing: float = 0.3):
        self.window_s = window_s
        self.threshold = threshold
        self.smoothing = smoothing
        self.ratio = 1.0
        self._open: deque[tuple[float, int]] = deque()  # (freed at, batch size)
        self._arrivals: deque[float] = deque()  # since the oldest open window began

    @property
    def returning(self) -> bool:
        return self.ratio >= self.threshold

    def freed(self, now: float, size: int) -> None:
        """A batch of `size` requests finished at `now` (a stream's size is 0: none)."""
        if size and self.window_s:
            self._open.append((now, size))

    def next_close(self) -> float | None:
        """When the oldest open window ends (None: none is open)."""
        return self._open[0][0] + self.window_s if self._open else None

    def arrival(self, now: float) -> None:
        if self._open:
            self._arrivals.append(now)

    def update(self, now: float) -> bool:
        """Close the windows that have ended; True if `returning` changed."""
        before = self.returning
        while self._open and now >= self._open[0][0] + self.window_s:
            start, size = self._open.popleft()
            back = sum(1 for t in self._arrivals if start <= t < start + self.window_s)
            self.ratio += self.smoothing * (min(1.0, back / size) - self.ratio)
        oldest = self._open[0][0] if self._open else math.inf
        while self._arrivals and self._arrivals[0] < oldest:
            self._arrivals.popleft()
        return self.returning != before


class State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"


@dataclass(eq=False)
class Pending:
    """One request waiting for, or inside, a batch.

    `context` is opaque to the batcher: the caller's tracing context, carried
    to the worker thread so the batch span can link back to each request.
    """

    payload: Any
    bucket: Hashable
    cost: float
    enqueued_at: float
    deadline: float
    context: Any = None
    state: State = State.QUEUED
    cancelled: bool = False
    # Set by the Batcher; the queue itself never looks at it.
    future: Any = field(default=None, repr=False)


@dataclass(frozen=True)
class BatchPlan:
    """A batch chosen by the policy: requests of one bucket (or merged buckets), oldest first."""

    bucket: Hashable
    items: list[Pending]

    def __len__(self) -> int:
        return len(self.items)


class BucketQueue:
    """A bounded queue with one FIFO sub-queue per bucket."""

    def __init__(self, policy: BatchPolicy) -> None:
        self.policy = policy
        self._buckets: OrderedDict[Hashable, deque[Pending]] = OrderedDict()
        self._size = 0
        self._cost = 0.0
        # The rejoin window in use: the policy's, or 0 while clients do not come back.
        self.rejoin_s = policy.max_rejoin_s

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Pending]:
        for items in self._buckets.values():
            yield from items

    @property
    def queued_cost(self) -> float:
        """Sum of the `cost` of waiting requests (the work this queue represents)."""
        return self._cost

    def bucket_sizes(self) -> dict[Hashable, int]:
        return {key: len(items) for key, items in self._buckets.items()}

    def push(self, item: Pending, retry_after_s: float = 1.0) -> None:
        """Add a request, or raise `QueueFull` when `max_queue` requests already wait."""
        if self._size >= self.policy.max_queue:
            raise QueueFull(self._size, retry_after_s)
        self._buckets.setdefault(item.bucket, deque()).append(item)
        self._size += 1
        self._cost += item.cost

    def remove(self, item: Pending) -> bool:
        """Take a waiting request out (cancelled by its client). False if not queued."""
        items = self._buckets.get(item.bucket)
        if items is None or item not in items:
            return False
        items.remove(item)
        self._forget(item)
        if not items:
            del self._buckets[item.bucket]
        return True

    def expire(self, now: float) -> list[Pending]:
        """Remove and return every waiting request whose deadline has passed."""
        expired = [item for item in self if item.deadline <= now]
        for item in expired:
            self.remove(item)
        return expired

    def is_ready(
        self,
        bucket: Hashable,
        now: float,
        flush: bool = False,
        free_since: float = -math.inf,
        awaited: int = 0,
    ) -> bool:
        """Whether `bucket` launches now; `free_since`: since when a worker has been idle,
        `awaited`: how many requests the batch it finished held (BatchPolicy)."""
        items = self._buckets.get(bucket)
        if not items:
            return False
        queued = self._queued(items)
        if flush or queued >= self.policy.max_batch_size:
            return True
        expected = self._expected(items, free_since, awaited)
        if expected and queued >= expected:
            return True  # the finished batch's clients are back
        return now >= self._launch_time(items, free_since, expected)

    def _queued(self, items: deque[Pending]) -> int:
        """How many requests a batch launched from this bucket could take now."""
        return self._size if self.policy.merge_buckets else len(items)

    def _expected(self, items: deque[Pending], free_since: float, awaited: int) -> int:
        """How many requests this bucket's batch may hold once the `awaited` clients of
        the finished batch are back: those that queued behind it, plus them (0: none are
        awaited, or the policy has no rejoin window to wait in)."""
        if not awaited or not self.rejoin_s:
            return 0
        queues = self._buckets.values() if self.policy.merge_buckets else [items]
        behind = sum(1 for q in queues for item in q if item.enqueued_at < free_since)
        return min(self.policy.max_batch_size, behind + awaited)

    def _launch_time(self, items: deque[Pending], free_since: float, expected: int = 0) -> float:
        """When a bucket that does not fill up launches (is_ready and next_wakeup agree);
        `expected`: as `_expected` gives it."""
        policy = self.policy
        start = max(items[0].enqueued_at, free_since)
        wait = policy.max_wait_s
        if items[0].enqueued_at < free_since:  # it queued behind busy workers
            wait = max(wait, self.rejoin_s)
        launch = start + wait
        if self._queued(items) < expected:
            # Some of the finished batch's clients may still be on their way back.
            launch = max(launch, free_since + self.rejoin_s)
        return launch

    def next_batch(
        self, now: float, flush: bool = False, free_since: float = -math.inf, awaited: int = 0
    ) -> BatchPlan | None:
        """Pop the next batch, or None if no bucket is ready.

        Among ready buckets the one holding the earliest deadline goes first, so
        a rare shape is not starved by a busy one. `flush` (used while draining)
        makes every non-empty bucket ready.
        """
        ready = [
            key for key in self._buckets if self.is_ready(key, now, flush, free_since, awaited)
        ]
        if not ready:
            return None
        key = min(ready, key=lambda k: min(item.deadline for item in self._buckets[k]))
        take = self._take(key, self.policy.max_batch_size)
        if self.policy.merge_buckets:
            for other in sorted(self._buckets, key=lambda k: (abs(k - key), k)):
                if len(take) == self.policy.max_batch_size:
                    break
                take += self._take(other, self.policy.max_batch_size - len(take))
            key = max(item.bucket for item in take)
        return BatchPlan(bucket=key, items=take)

    def take_oldest(self, count: int) -> list[Pending]:
        """Pop up to `count` requests of any bucket, earliest deadline first: top-ups for
        a running stream, which takes any bucket at once (`batching.stream`)."""
        take = sorted(self, key=lambda item: item.deadline)[:count]
        for item in take:
            self.remove(item)
        return take

    def restore(self, items: list[Pending]) -> None:
        """Put popped requests back at the head of their buckets, in order."""
        for item in reversed(items):
            self._buckets.setdefault(item.bucket, deque()).appendleft(item)
            self._size += 1
            self._cost += item.cost

    def next_wakeup(
        self, include_wait: bool = True, free_since: float = -math.inf, awaited: int = 0
    ) -> float | None:
        """The earliest time at which a bucket's wait runs out or a deadline passes.

        Without `include_wait` only deadlines count: a scheduler with no idle worker
        cannot launch a ready bucket anyway, and must not spin on one.
        """
        times = []
        for items in self._buckets.values():
            if include_wait:
                expected = self._expected(items, free_since, awaited)
                times.append(self._launch_time(items, free_since, expected))
            times.append(min(item.deadline for item in items))
        return min(times, default=None)

    def _take(self, key: Hashable, count: int) -> list[Pending]:
        """Pop up to `count` requests from one bucket, oldest first."""
        items = self._buckets[key]
        take = [items.popleft() for _ in range(min(len(items), count))]
        for item in take:
            self._forget(item)
        if not items:
            del self._buckets[key]
        return take

    def _forget(self, item: Pending) -> None:
        self._size -= 1
        self._cost -= item.cost
        if self._size == 0:
            self._cost = 0.0  # no float drift once empty


class DrainRate:
    """Requests completed per second over a sliding window, for `Retry-After`."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._total = 0

    def record(self, now: float, count: int) -> None:
        self._events.append((now, count))
        self._total += count
        self._trim(now)

    def per_second(self, now: float) -> float | None:
        self._trim(now)
        if not self._events:
            return None
        span = max(now - self._events[0][0], 1e-3)
        return self._total / max(span, 1.0)

    def retry_after(self, now: float, waiting: int, floor_s: float = 1.0) -> float:
        """Seconds until `waiting` requests are likely served, at least `floor_s`."""
        rate = self.per_second(now)
        if not rate:
            return floor_s
        return max(floor_s, math.ceil(waiting / rate))

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            _, count = self._events.popleft()
            self._total -= count
