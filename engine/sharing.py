"""How the models of one GPU share it, and how much of it each one takes.

On a GPU each model has a compute thread of its own (`engine.engine`); the sharing
policy (`TEXEL_ADVANCED__GPU_SHARING`) says where each thread queues its work:

- `priority` (the default): every model on a CUDA stream of its own, and a
  latency-sensitive model's (`Model.latency_sensitive`: formulas) at the device's
  highest priority, the others' at its lowest. The GPU runs both at once; whenever a
  kernel of the high-priority stream waits, its blocks take the next free room, so a
  formula's decoding steps run beside a long denoising step instead of behind it, and
  the images get whatever the formulas leave. A high priority only wins the room that
  frees up, though, and a UNet replayed from CUDA graphs keeps every SM full; so on a
  device shared with other models a model that is not latency-sensitive runs in a CUDA
  green context that leaves `RESERVED_SMS` of the device's SMs to the others. (Equal
  priorities are not offered: torch draws streams of one priority from a small pool, so
  a model's stream could be one the other model's side work already uses.)
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
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from telemetry import metrics

log = logging.getLogger(__name__)

Sharing = Literal["priority", "off"]
DEFAULT_SHARING: Sharing = "priority"
# SMs a shared device keeps from its models that are not latency-sensitive (green contexts
# take SMs in groups of 8 on current GPUs, so the partition is rounded down to one).
RESERVED_SMS = 32
SM_GROUP = 8


class CudaApi(Protocol):
    """The CUDA calls the engine makes for sharing and metering: one seam, so that the
    choice of streams can be checked where no GPU is."""

    def priority_range(self) -> tuple[int, int]:
        """(lowest, highest) stream priority of the device; CUDA counts down."""
        ...

    def enter(self, device: torch.device, priority: int | None, sms: int | None) -> None:
        """On a compute thread: make `device` current, and with a `priority` a new
        stream of that priority the thread's current stream; with `sms`, a stream of a
        green context confined to that many SMs instead."""
        ...

    def sm_count(self, device: torch.device) -> int:
        """The device's streaming multiprocessors."""
        ...

    def event(self) -> Any:
        """A timing event recorded now on the calling thread's current stream."""
        ...


class TorchCuda:
    """`CudaApi` through torch."""

    def __init__(self) -> None:
        self._contexts: list[Any] = []  # green contexts live as long as their streams

    def priority_range(self) -> tuple[int, int]:
        return torch.cuda.Stream.priority_range()

    def enter(self, device: torch.device, priority: int | None, sms: int | None) -> None:
        # Each thread starts on cuda:0: a worker for another GPU makes its own current,
        # so that the streams, CUDA graphs and allocations it makes are on it.
        torch.cuda.set_device(device)
        if sms is not None:
            try:
                from torch.cuda.green_contexts import GreenContext

                context = GreenContext.create(num_sms=sms, device_id=device.index or 0)
                self._contexts.append(context)
                torch.cuda.set_stream(context.Stream())
                log.info("%s: this model's work runs on %d SMs (a green context)", device, sms)
                return
            except Exception as exc:  # an older driver or build: the whole device
                log.warning("%s: no green context of %d SMs (%s)", device, sms, exc)
        if priority is not None:
            torch.cuda.set_stream(torch.cuda.Stream(device, priority=priority))

    def sm_count(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).multi_processor_count

    def event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


@dataclass(frozen=True)
class Lane:
    """Where one model's work queues on its device: a CUDA stream of `priority`, or with
    None the device's default stream (and on a CPU, the shared compute thread); with
    `sms`, a stream confined to that many of the device's SMs."""

    priority: int | None
    stream: str  # for spans: "high", "low", "default" or "cpu"
    sms: int | None = None


def lane(
    policy: Sharing,
    device: torch.device,
    latency_sensitive: bool,
    cuda: CudaApi,
    shared: bool = False,
) -> Lane:
    """The lane of a model on `device` under `policy`; `shared`: other models run there."""
    if device.type != "cuda":
        return Lane(None, "cpu")
    if policy == "off":
        return Lane(None, "default")
    if policy != "priority":
        raise ValueError(f"unknown GPU sharing policy {policy!r}; use priority or off")
    lowest, highest = cuda.priority_range()
    if latency_sensitive:
        return Lane(highest, "high")
    sms = None
    if shared:
        sms = (cuda.sm_count(device) - RESERVED_SMS) // SM_GROUP * SM_GROUP
    return Lane(lowest, "low", sms if sms and sms > 0 else None)


def lane_attributes(lane: Lane) -> dict[str, Any]:
    """What a batch span says of the lane its work ran on."""
    if lane.stream == "cpu":
        return {}
    attributes: dict[str, Any] = {"texel.device.stream": lane.stream}
    if lane.sms is not None:
        attributes["texel.device.sms"] = lane.sms
    return attributes


def enter(device: torch.device, lane: Lane, cuda: CudaApi) -> None:
    """The compute thread's initializer: its device current, its work on its lane."""
    if device.type == "cuda":
        cuda.enter(device, lane.priority, lane.sms)


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
