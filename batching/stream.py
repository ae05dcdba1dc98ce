"""Continuous batching: a worker that takes requests in and hands results back while it runs.

A `BatchRunner` gets a fixed list and returns when the whole list is done, so a batch
of formulas costs as long as its longest one, and requests that arrive meanwhile wait
for the next batch. A `StreamRunner` instead runs for as long as there is work: at
each step boundary it `take()`s requests the scheduler has handed it (up to its free
rows), and `done()` returns each request's result the moment it is ready. Rows join
and leave a running decode, so the device runs near its best batch size under a
closed loop of clients instead of alternating between two half-size cohorts.

`Feed` is the meeting point between the asyncio scheduler (which `offer()`s requests,
never more than the worker's capacity) and the worker's thread (`take`, `done`,
`finish`). It is thread-safe; results reach the event loop through
`call_soon_threadsafe`. A stream ends only through `finish()`, which succeeds only
when nothing offered is left to take, so no request is stranded between the two.

A stream on a thread shared with other models (one compute thread on a CPU) would
hold that thread for as long as its own requests keep coming; with `yield_when`
(other calls wait for the thread) it takes no more requests, ends once its rows
have, and the requests offered to it and not taken go back to the queue. A stream
whose rows take long (a denoising loop) need not wait for them to end: it can
`park()` their state and return at a step boundary; the batcher then runs it again,
with the same requests, behind the calls that were waiting (`Feed.resumed`).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from batching.queue import Pending

# Keys of taken requests, unique in the process for good: `id()` of a finished request is
# soon another's, and a late word about the old one (a cancel crossing its answer) must
# not touch the new one.
_keys = itertools.count()


class StreamRunner(Protocol):
    """Runs requests continuously on one device, on that device's worker thread.

    Returns once `feed.finish()` has returned True. Every key it took must get a
    result through `feed.done()` first (a value, or an `Exception` instance that fails
    only that request); keys whose clients went away (`feed.cancelled`) may be
    dropped early by reporting any result for them. Raising fails every request taken
    and not yet done.
    """

    def __call__(self, feed: Feed) -> None: ...


@dataclass
class Joined:
    """When requests joined a running stream together, and how many rows ran then."""

    started: float
    running: int
    ref: Any = None  # what requests link to (the observer's span context for the join)
    handle: Any = None  # what the observer ends once every member has left
    members: int = 0


class Feed:
    """One running stream's inbox and outbox, shared by the scheduler and the worker."""

    def __init__(
        self,
        deliver: Callable[[list[tuple[Pending, Any, Joined, float]]], None],
        *,
        clock: Callable[[], float] = time.monotonic,
        on_join: Callable[[list[Pending], int], tuple[Any, Any]] = lambda items, n: (None, None),
        on_leave: Callable[[Any], None] = lambda handle: None,
        yield_when: Callable[[], bool] = lambda: False,
        on_step: Callable[[], None] | None = None,
        shares_device: Callable[[], bool] | None = None,
    ) -> None:
        self._deliver = deliver
        self._clock = clock
        self._on_join = on_join
        self._on_leave = on_leave
        self._yield_when = yield_when
        self._on_step = on_step  # each take() is a step boundary of the worker's
        self._shares_device = shares_device
        self.yielded = False  # took no more requests so that other work could run
        self.alive_at = clock()  # the worker's last sign of life (a check for requests)
        self.parked: Any = None  # the worker's state, when it gave the thread up mid-way
        self.resumed: Any = None  # the state a parked stream left, for its next run
        self._lock = threading.Lock()
        self._inbox: deque[Pending] = deque()
        self._taken: dict[int, tuple[Pending, Joined]] = {}
        self._closed = False
        self.offered = 0  # by the scheduler; minus `delivered`, what the stream holds
        self.delivered = 0
        self.offered_cost = 0.0  # the same in predicted cost (`Pending.cost`)
        self.delivered_cost = 0.0

    # -- the scheduler's side (event loop) ------------------------------------

    def offer(self, items: list[Pending]) -> bool:
        """Hand requests to the stream; False (nothing taken) once it has finished."""
        with self._lock:
            if self._closed:
                return False
            self._inbox.extend(items)
            self.offered += len(items)
            self.offered_cost += sum(item.cost for item in items)
            return True

    @property
    def holding(self) -> int:
        """Requests offered to the stream and not yet answered."""
        return self.offered - self.delivered

    @property
    def load(self) -> float:
        """The predicted cost of the requests it holds: the work queued on its device."""
        return max(0.0, self.offered_cost - self.delivered_cost) if self.holding else 0.0

    def resume(self, parked: Feed) -> None:
        """Take over a parked stream's requests, taken and untaken, and its state."""
        with parked._lock, self._lock:
            self._inbox.extend(parked._inbox)
            self._taken.update(parked._taken)
            parked._inbox.clear()
            parked._taken.clear()
            parked._closed = True
            self.offered, self.delivered = parked.offered, parked.delivered
            self.offered_cost, self.delivered_cost = parked.offered_cost, parked.delivered_cost
            self.resumed = parked.parked

    def leftovers(self) -> tuple[list[Pending], list[Pending]]:
        """Once the stream has ended: the requests offered and never taken (to queue
        again), and those taken and never answered (to fail)."""
        with self._lock:
            self._closed = True
            untaken = list(self._inbox)
            unanswered = [item for item, _ in self._taken.values()]
            joins = {id(joined): joined for _, joined in self._taken.values()}
            self._inbox.clear()
            self._taken.clear()
        for joined in joins.values():
            self._on_leave(joined.handle)
        return untaken, unanswered

    # -- the worker's side (its thread) ---------------------------------------

    def take(self, limit: int, fits: Callable[[Any], bool] | None = None) -> list[tuple[int, Any]]:
        """Up to `limit` new requests as (key, payload), oldest first, stopping at the
        first whose payload does not `fits` (called on each in turn, which may count
        what it let in); never blocks. A request is taken when it joins: the time it
        waited before is its queue wait."""
        self.alive_at = self._clock()
        if self._on_step is not None:
            self._on_step()
        # The first take always goes ahead, so a stream serves its first requests even
        # when it gives way at once.
        if self.offered > len(self._inbox) and not self.yielded and self._yield_when():
            self.yielded = True
        if self.yielded:
            return []
        with self._lock:
            items = []
            while self._inbox and len(items) < limit:
                if fits is not None and not fits(self._inbox[0].payload):
                    break
                items.append(self._inbox.popleft())
            if not items:
                return []
            running = len(self._taken) + len(items)
            joined = Joined(self._clock(), running, members=len(items))
            joined.handle, joined.ref = self._on_join(items, running)
            keyed = [(next(_keys), item) for item in items]
            for key, item in keyed:
                self._taken[key] = (item, joined)
        return [(key, item.payload) for key, item in keyed]

    def progress(self, key: int, steps: int) -> None:
        """A taken request has done `steps` steps (for callers that follow them)."""
        entry = self._taken.get(key)
        if entry is not None and entry[0].progress is not None:
            entry[0].progress(steps)

    def cancelled(self, keys: list[int]) -> list[int]:
        """Which of these taken requests' clients have gone away."""
        with self._lock:
            return [key for key in keys if key in self._taken and self._taken[key][0].cancelled]

    def done(self, results: list[tuple[int, Any]]) -> None:
        """Results of taken requests, by key: a value, or an Exception for that request."""
        now = self._clock()
        answered = []
        with self._lock:
            for key, value in results:
                entry = self._taken.pop(key, None)
                if entry is not None:
                    answered.append((entry[0], value, entry[1], now))
        for _, _, joined, _ in answered:
            joined.members -= 1
            if joined.members == 0:
                self._on_leave(joined.handle)
        if answered:
            self._deliver(answered)

    def should_give_way(self) -> bool:
        """Whether other work waits for this stream's thread."""
        return self._yield_when()

    def shares_device(self) -> bool:
        """Whether another model is on this stream's device, its work running beside the
        stream's whenever it has any (on a GPU; False where nobody says)."""
        return self._shares_device is not None and self._shares_device()

    def park(self, state: Any) -> None:
        """Give the thread up with requests still running: the worker returns right
        after, and its next run finds `state` in `resumed`."""
        self.parked = state

    def finish(self) -> bool:
        """End the stream if nothing is left to take (True); else False, take more."""
        with self._lock:
            if self._inbox and not self.yielded:
                return False
            self._closed = True
            return True
