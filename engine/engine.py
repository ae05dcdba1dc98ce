"""`Engine`: the one owner of a device, with every model placed on it and their batchers.

An engine loads each model on its device, warms it up and batches its requests: one
`Batcher` per model, whose batches run on the device's compute thread. On a CPU all
models share one compute thread (torch's OpenMP teams would otherwise spin against
each other on the same cores); on a GPU each model has its own, so a long image batch
does not hold up formulas queued for the same card, and the engine's sharing policy
(`engine.sharing`) puts each thread's work on a CUDA stream of its own, the formulas'
at a higher priority. Each model's device time is measured (`DeviceMeter`).

On a GPU the engine runs in a process of its own (`engine.process`), and HTTP processes
reach it through `RemoteEngine`; on a CPU it can run inside the HTTP process
(`LocalEngine`). The code is the same.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from batching import Batcher, BatchPolicy, BatchResult, ComputeThread, Worker
from engine import sharing
from engine.errors import NotReady, UnknownModel
from engine.sharing import (
    DEFAULT_SHARING,
    CudaApi,
    DeviceMeter,
    Lane,
    Sharing,
    TorchCuda,
    lane_attributes,
)
from models.base import DeviceRunner, Model, log_load_failure
from telemetry import BatchTelemetry, metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPlan:
    """One model to serve on an engine: how to build it and how to batch it.

    `build` is picklable (it travels to an engine process) and makes the `Model`.
    """

    key: str
    build: Callable[[], Model]
    max_batch_size: int
    max_wait_s: float
    max_queue: int
    # A device call (a batch, or a stream's step) that runs longer than this has stalled:
    # the model reports "stalled" and the server not ready until it comes back.
    stall_s: float = 120.0


@dataclass(frozen=True)
class ModelState:
    """A model's state in an engine: loading, ready or failed (with why), and what the
    HTTP side needs of the loaded model (`Model.describe`)."""

    state: str
    error: str | None = None
    description: dict[str, Any] = field(default_factory=dict)


class _Served:
    def __init__(self, plan: ModelPlan) -> None:
        self.plan = plan
        self.model: Model | None = None
        self.batcher: Batcher | None = None
        self.state = ModelState("loading")
        self.started = 0.0  # when its loading began (perf_counter)


class Engine:
    """Serves the `plans` on `device`, its models sharing a GPU by the `sharing` policy
    (`engine.sharing`; `cuda` is where its CUDA calls go). `start()` loads in the
    background; requests for a model not yet ready are refused with `NotReady`."""

    def __init__(
        self,
        device: torch.device,
        plans: list[ModelPlan],
        sharing: Sharing = DEFAULT_SHARING,
        cuda: CudaApi | None = None,
    ) -> None:
        self.device = device
        self.name = str(device)
        self.sharing = sharing
        self._cuda = cuda or TorchCuda()
        self._served = {plan.key: _Served(plan) for plan in plans}
        self._threads: dict[str, ThreadPoolExecutor] = {}
        self._loader: asyncio.Task | None = None
        self.draining = False

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> asyncio.Task:
        """Load and warm up every model, one after the other, in the background."""
        self._loader = asyncio.get_running_loop().create_task(self._load_all())
        return self._loader

    async def _load_all(self) -> None:
        """Each model in turn; on a CPU, where the models take turns on one thread, none
        is ready before every one is warm: a model ready while another warmed up would
        take requests and hold them for as long (tens of seconds for an image model),
        where `not_ready` tells clients to come back."""
        loaded = []
        for served in self._served.values():
            ready = await self._load(served)
            if ready is not None:
                loaded.append(ready)
            if self.device.type != "cpu":
                for serve in loaded:
                    serve()
                loaded = []
        for serve in loaded:
            serve()

    async def _load(self, served: _Served) -> Callable[[], None] | None:
        """Load and warm up `served`'s model; what then serves it, None if it failed."""
        plan = served.plan
        served.started = time.perf_counter()
        loop = asyncio.get_running_loop()
        model = None
        try:
            model = plan.build()
            metrics.MODEL_READY.labels(model.name).set(0)  # loading; stays 0 if it fails
            lane = sharing.lane(
                self.sharing,
                self.device,
                model.latency_sensitive,
                self._cuda,
                self._shares_device(served),
            )
            thread = self._compute_thread(plan.key, lane)
            # On the compute thread: on a CPU, torch's OpenMP team belongs to the first
            # thread that computes, and loading computes (fp16 weights become fp32).
            await loop.run_in_executor(thread, model.open)
            await loop.run_in_executor(thread, model.load, self.device)
            await loop.run_in_executor(thread, model.warmup, self.device, plan.max_batch_size)
            runner = model.runner(self.device)
            description = model.describe()
        except Exception as exc:
            source = model.source if model is not None else None
            reason = log_load_failure(
                log, exc, "could not load the %s model on %s", plan.key, self.name, source=source
            )
            served.state = ModelState("failed", reason)
            return None
        return functools.partial(self._serve, served, model, runner, description, lane, thread)

    def _serve(self, served: _Served, model, runner, description, lane: Lane, thread) -> None:
        """Start `served`'s batcher on its loaded `model`: it is ready."""
        plan = served.plan
        policy = BatchPolicy(
            max_batch_size=plan.max_batch_size,
            max_wait_s=plan.max_wait_s,
            max_queue=plan.max_queue,
            merge_buckets=model.merge_buckets,
        )
        meter = DeviceMeter(model.name, self.device, self._cuda)
        worker = metered_worker(
            self.name, runner, thread, meter, lambda: self._shares_device(served)
        )
        observer = BatchTelemetry(
            model.name,
            model.operation,
            padding_efficiency=model.padding_efficiency,
            device_s=meter.seconds,
            attributes=lane_attributes(lane),
        )
        served.model = model
        served.batcher = Batcher(plan.key, [worker], policy, observer=observer)
        served.batcher.start()
        served.state = ModelState("ready", description=description)
        metrics.MODEL_READY.labels(model.name).set(1)
        log.info(
            "%s model %s ready on %s in %.1f s (its work on the %s stream)",
            plan.key,
            model.name,
            self.name,
            time.perf_counter() - served.started,
            lane.stream,
        )

    def _shares_device(self, served: _Served) -> bool:
        """Whether another model is on this engine's GPU, loaded or loading in turn (not
        failed), so that its work may run beside `served`'s; on a CPU the models take
        turns on one thread."""
        return self.device.type == "cuda" and any(
            other is not served and other.state.state != "failed" for other in self._served.values()
        )

    def _compute_thread(self, key: str, lane: Lane) -> ThreadPoolExecutor:
        """The thread that runs model `key`'s work: the CPU's one, or on a GPU a thread of
        the model's own whose work queues on its lane."""
        thread_key = self.name if self.device.type == "cpu" else f"{key}-{self.name}"
        if thread_key not in self._threads:
            self._threads[thread_key] = ComputeThread(
                thread_name_prefix=f"texel-compute-{thread_key}",
                initializer=sharing.enter,
                initargs=(self.device, lane, self._cuda),
            )
        return self._threads[thread_key]

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and finish every queued and running one."""
        self.draining = True
        batchers = [s.batcher for s in self._served.values() if s.batcher is not None]
        done = await asyncio.gather(*(b.drain(timeout_s) for b in batchers))
        return all(done)

    async def close(self) -> None:
        self.draining = True
        if self._loader is not None and not self._loader.done():
            self._loader.cancel()
        for served in self._served.values():
            if served.batcher is not None:
                await served.batcher.close()
        for thread in self._threads.values():
            thread.shutdown(wait=False, cancel_futures=True)

    # -- requests --------------------------------------------------------------

    def states(self) -> dict[str, ModelState]:
        """Each model's state; a ready one whose device work has shown no sign of life
        for longer than its plan's `stall_s` is "stalled"."""
        states = {}
        for key, served in self._served.items():
            state = served.state
            if (silent := self._silent_s(served)) > served.plan.stall_s:
                why = f"its work on {self.name} has shown no progress for {silent:.0f} s"
                state = ModelState("stalled", why, state.description)
            states[key] = state
        return states

    def hung(self) -> list[str]:
        """What a model whose device work has shown no progress for twice its plan's
        `stall_s` says of it: a call that long has most likely hung, not slowed down."""
        return [
            f"the {key} model's work on {self.name} has shown no progress for {silent:.0f} s"
            for key, served in self._served.items()
            if (silent := self._silent_s(served)) > 2 * served.plan.stall_s
        ]

    @staticmethod
    def _silent_s(served: _Served) -> float:
        """How long a ready model's device work has shown no progress (0 otherwise)."""
        if served.state.state != "ready" or served.batcher is None:
            return 0.0
        return served.batcher.stalled_s()

    def model(self, key: str) -> Model:
        """The loaded model `key` (its payload and output types, for the protocol)."""
        served = self._get(key)
        if served.model is None:
            raise NotReady(f"the {key} model is {served.state.state}")
        return served.model

    def depth(self, key: str) -> int:
        """Requests of model `key` waiting for a batch."""
        batcher = self._get(key).batcher
        return 0 if batcher is None else batcher.depth

    async def submit(
        self,
        key: str,
        payload: Any,
        timeout_s: float,
        context: Any = None,
        on_progress: Callable[[int, int | None], None] | None = None,
    ) -> BatchResult:
        """Batch one preprocessed payload of model `key`, due within `timeout_s`;
        `on_progress(steps done, requests ahead)` follows it (`Batcher.submit`)."""
        served = self._get(key)
        if served.batcher is None or served.model is None:
            raise NotReady(f"the {key} model is {served.state.state}")
        model = served.model
        return await served.batcher.submit(
            payload,
            bucket=model.bucket(payload),
            cost=model.cost(payload),
            timeout_s=timeout_s,
            context=context,
            on_progress=on_progress,
        )

    def _get(self, key: str) -> _Served:
        served = self._served.get(key)
        if served is None:
            raise UnknownModel(f"the {key} model is not served on {self.name}")
        return served


def metered_worker(
    name: str,
    runner: DeviceRunner,
    thread: ThreadPoolExecutor,
    meter: DeviceMeter,
    shares_device: Callable[[], bool],
) -> Worker:
    """The batcher's worker for `runner`, its device time measured by `meter`: each batch
    whole, a stream at each step boundary; `shares_device` for its streams' feeds."""

    def run(payloads, should_stop):
        with meter.timed():
            return runner.run(payloads, should_stop)

    stream = None
    if runner.stream is not None:

        def stream(feed) -> None:
            try:
                runner.stream(feed)
            except BaseException:
                meter.abandon()
                raise
            meter.stop(wait=True)

    return Worker(name, run, thread, stream=stream, on_step=meter.lap, shares_device=shares_device)
