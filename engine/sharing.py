"""How the models of one GPU share it, and how much of it each one takes.

On a GPU each model has a compute thread of its own (`engine.engine`); the sharing
policy (`TEXEL_ADVANCED__GPU_SHARING`) says where each thread queues its work:

- `priority` (the default): every model on a CUDA stream of its own, and a
  latency-sensitive model's (`Model.latency_sensitive`: formulas) at the device's
  highest priority, the others' at its lowest. The GPU runs both at once; whenever a
  kernel of the high-priority stream waits, its blocks take the next free room, so a
  formula's decoding steps run beside a long denoising step instead of behind it, and
  the images get whatever the formulas leave. (Equal priorities are not offered: torch
  draws streams of one priority from a small pool, so a model's stream could be one the
  other model's side work already uses.)
- `off`: every model on the device's default stream, each kernel queued behind the
  other model's, and each wait for its own work a wait for the other's too.

On a CPU the models share one compute thread and take turns at step boundaries
(`batching.stream`); the policy does nothing there.

`DeviceMeter` measures a model's device time: CUDA events on its stream around each
batch and at each step boundary of a stream (read once the device has passed them,
never waited for during a stream), wall time on a CPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from telemetry import metrics

Sharing = Literal["priority", "off"]
DEFAULT_SHARING: Sharing = "priority"


class CudaApi(Protocol):
    """The CUDA calls the engine makes for sharing and metering: one seam, so that the
    choice of streams can be checked where no GPU is."""

    def priority_range(self) -> tuple[int, int]:
        """(lowest, highest) stream priority of the device; CUDA counts down."""
        ...

    def enter(self, device: torch.device, priority: int | None) -> None:
        """On a compute thread: make `device` current, and with a `priority` a new
        stream of that priority the thread's current stream."""
        ...

    def event(self) -> Any:
        """A timing event recorded now on the calling thread's current stream."""
        ...


class TorchCuda:
    """`CudaApi` through torch."""

    def priority_range(self) -> tuple[int, int]:
        return torch.cuda.Stream.priority_range()

    def enter(self, device: torch.device, priority: int | None) -> None:
        # Each thread starts on cuda:0: a worker for another GPU makes its own current,
        # so that the streams, CUDA graphs and allocations it makes are on it.
        torch.cuda.set_device(device)
        if priority is not None:
            torch.cuda.set_stream(torch.cuda.Stream(device, priority=priority))

    def event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


@dataclass(frozen=True)
class Lane:
    """Where one model's work queues on its device: a CUDA stream of `priority`, or with
    None the device's default stream (and on a CPU, the shared compute thread)."""

    priority: int | None
    stream: str  # for spans: "high", "low", "default" or "cpu"


def lane(policy: Sharing, device: torch.device, latency_sensitive: bool, cuda: CudaApi) -> Lane:
    """The lane of a model on `device` under `policy`."""
    if device.type != "cuda":
        return Lane(None, "cpu")
    if policy == "off":
        return Lane(None, "default")
    if policy != "priority":
        raise ValueError(f"unknown GPU sharing policy {policy!r}; use priority or off")
    lowest, highest = cuda.priority_range()
    return Lane(highest, "high") if latency_sensitive else Lane(lowest, "low")


def enter(device: torch.device, lane: Lane, cuda: CudaApi) -> None:
    """The compute thread's initializer: its device current, its work on its lane."""
    if device.type == "cuda":
        cuda.enter(device, lane.priority)


class DeviceMeter:
    """One model's device time on one device, into `texel_device_seconds_total`.

    `timed()` encloses a whole batch, whose time is known when it returns (its outputs
    are on the host by then). A stream calls `lap()` at each step boundary and `stop()`
    when it ends; on a GPU each lap is an event on the stream, and the time between two
    is credited once the device has passed the second (checked at each lap, never waited
    for), so the stream keeps running ahead of its device.
    """

    def __init__(self, model: str, device: torch.device, cuda: CudaApi | None = None) -> None:
        self._counter = metrics.DEVICE_SECONDS.labels(model, str(device))
        self._cuda = cuda if device.type == "cuda" else None
        self._open: Any = None  # the mark where the interval now running began
        self._pending: deque[tuple[Any, Any]] = deque()  # intervals the device has not passed
        self._lock = threading.Lock()
        self.total_s = 0.0  # credited so far (spans read it from other threads)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        self._open = self._mark()
        try:
            yield
        except BaseException:
            self.abandon()
            raise
        self.stop(wait=True)

    def lap(self) -> None:
        mark = self._mark()
        if self._open is not None:
            self._close(self._open, mark)
        self._open = mark
        self._collect(wait=False)

    def stop(self, wait: bool = False) -> None:
        """End the running interval; with `wait`, credit everything now."""
        if self._open is not None:
            self._close(self._open, self._mark())
            self._open = None
        self._collect(wait)

    def abandon(self) -> None:
        """The work failed: end the running interval without ever waiting for the
        device, and raise nothing that would hide the failure."""
        with contextlib.suppress(Exception):
            self.stop()

    def seconds(self) -> float:
        """Device time so far: what is credited, and on a CPU the running interval's."""
        opened = self._open
        with self._lock:
            total = self.total_s
        if opened is None or self._cuda is not None:
            return total
        return total + time.perf_counter() - opened

    def _mark(self) -> Any:
        return time.perf_counter() if self._cuda is None else self._cuda.event()

    def _close(self, start: Any, end: Any) -> None:
        if self._cuda is None:
            self._credit(end - start)
        else:
            self._pending.append((start, end))

    def _collect(self, wait: bool) -> None:
        while self._pending and (wait or self._pending[0][1].query()):
            start, end = self._pending.popleft()
            if wait:
                end.synchronize()
            self._credit(start.elapsed_time(end) / 1000)

    def _credit(self, seconds: float) -> None:
        with self._lock:
            self.total_s += seconds
        self._counter.inc(seconds)
