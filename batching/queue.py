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
    request has waited `max_wait_s` since its arrival; at most `max_queue` requests
    wait in all.

    `merge_buckets` is for models whose batch cost is mostly per batch, not per
    padded element (a launch-bound decoder): bucket keys are then numbers (a
    padded width), a launching batch that has room is topped up from the nearest
    other buckets, and the batch's bucket is the largest key in it. Buckets count
    as full together once they hold `max_batch_size` requests between them.
    """

    max_batch_size: int = 8
    max_wait_s: float = 0.01
    max_queue: int = 256
    merge_buckets: bool = False

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_wait_s < 0:
            raise ValueError("max_wait_s must not be negative")
        if self.max_queue < 1:
            raise ValueError("max_queue must be at least 1")


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
    # Called from any thread with the number of steps done, for callers that follow them.
    progress: Any = field(default=None, repr=False)


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

    def is_ready(self, bucket: Hashable, now: float, flush: bool = False) -> bool:
        """Whether `bucket` launches now (BatchPolicy)."""
        items = self._buckets.get(bucket)
        if not items:
            return False
        if flush or self._queued(items) >= self.policy.max_batch_size:
            return True
        return now >= self._launch_time(items)

    def _queued(self, items: deque[Pending]) -> int:
        """How many requests a batch launched from this bucket could take now."""
        return self._size if self.policy.merge_buckets else len(items)

    def _launch_time(self, items: deque[Pending]) -> float:
        """When a bucket that does not fill up launches (is_ready and next_wakeup agree)."""
        return items[0].enqueued_at + self.policy.max_wait_s

    def next_batch(self, now: float, flush: bool = False) -> BatchPlan | None:
        """Pop the next batch, or None if no bucket is ready.

        Among ready buckets the one holding the earliest deadline goes first, so
        a rare shape is not starved by a busy one. `flush` (used while draining)
        makes every non-empty bucket ready.
        """
        ready = [key for key in self._buckets if self.is_ready(key, now, flush)]
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

    def next_wakeup(self, include_wait: bool = True) -> float | None:
        """The earliest time at which a bucket's wait runs out or a deadline passes.

        Without `include_wait` only deadlines count: a scheduler with no idle worker
        cannot launch a ready bucket anyway, and must not spin on one.
        """
        times = []
        for items in self._buckets.values():
            if include_wait:
                times.append(self._launch_time(items))
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
    """Requests completed per second of work over a sliding window, for `Retry-After`.

    The seconds counted are those in which the model was working (from a batch's start,
    or the completion before, to its completion), not the idle ones between: a burst
    that fills the queue after a quiet minute drains at the rate the model works, not
    at the rate that minute's few requests came. The window ends at the latest
    completion, not at the present: after a quiet spell longer than the window the rate
    last seen still stands, rather than no estimate at all.
    """

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, int, float]] = deque()  # (when, count, busy_s)
        self._total = 0
        self._busy_s = 0.0
        self._last = -math.inf  # the latest completion

    def record(self, now: float, count: int, started: float) -> None:
        """`count` requests completed at `now`, by work that began at `started`."""
        busy_s = max(0.0, now - max(started, self._last))
        self._last = max(self._last, now)
        self._events.append((now, count, busy_s))
        self._total += count
        self._busy_s += busy_s
        self._trim()

    def per_second(self) -> float | None:
        if not self._events:
            return None
        return self._total / max(self._busy_s, 1e-3)

    def retry_after(self, waiting: int, floor_s: float = 1.0) -> float:
        """Seconds until `waiting` requests are likely served, at least `floor_s`."""
        rate = self.per_second()
        if not rate:
            return floor_s
        return max(floor_s, math.ceil(waiting / rate))

    def _trim(self) -> None:
        while self._events and self._events[0][0] < self._last - self.window_s:
            _, count, busy_s = self._events.popleft()
            self._total -= count
            self._busy_s -= busy_s
