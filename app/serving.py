"""The runtime behind the routes of one HTTP process: its models' request sides, the
engines it sends payloads to, and the request flow.

A request flows through named stages: `http.parse` (in the route), the model's request
stages (`preprocess`, `tokenize`) on a thread pool, `queue.wait` and `generate` in an
engine, the model's response stages (`tokenize`, `postprocess`) on the pool again.
Every stage is timed by `RequestTrace`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Link

from app.errors import ApiError, not_ready
from app.settings import Settings
from engine import (
    CUT_OFF,
    BatchResult,
    Cancelled,
    DeadlineExceeded,
    Draining,
    EngineClient,
    EngineUnavailable,
    ModelState,
)
from models.base import Model, log_load_failure
from telemetry import RequestTrace, metrics
from telemetry.bottleneck import BottleneckSampler, watch_event_loop, watch_garbage_collector

log = logging.getLogger(__name__)

FOLLOW_S = 0.25  # how often an HTTP process reads its engines' states
FIRST_LOOK_S = 2.0  # how long a starting HTTP process waits for its engines to connect


@dataclass
class Runtime:
    """Everything an HTTP process holds between requests; built and torn down by the
    lifespan. `models` are the request sides (no weights) of the models the engines
    serve, `engines` the clients of every engine."""

    settings: Settings
    models: dict[str, Model]
    engines: list[EngineClient]
    draining: bool = False
    pool: ThreadPoolExecutor | None = None
    bottleneck: BottleneckSampler = field(default_factory=BottleneckSampler)
    # Per model, its state in each engine, as last read; and what is in flight per engine.
    states: dict[str, dict[str, ModelState]] = field(default_factory=dict)
    _attached: set[str] = field(default_factory=set)
    _opening: dict[str, str] = field(default_factory=dict)  # models that failed to open
    _load: dict[str, float] = field(default_factory=dict)
    _inflight: set[asyncio.Future] = field(default_factory=set)  # requests in the engines
    _preparing: int = 0  # requests in their request stages, accepted and bound for an engine
    _cut_off: bool = False  # the drain's time is up: what is still in flight gets 503
    _tasks: list[asyncio.Task] = field(default_factory=list)
    # Called as the event loop goes round (every `FOLLOW_S`, `_beat`): the launcher's
    # sign of life.
    heartbeat: Callable[[], None] | None = None

    # -- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(watch_event_loop()))
        watch_garbage_collector()
        threads = self.settings.advanced.preprocess_threads
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="texel-http")
        self.states = {key: {} for key in self.models}
        for key, model in self.models.items():
            metrics.series_from_zero(model.name)
            try:
                await loop.run_in_executor(self.pool, model.open)
            except Exception as exc:
                self._opening[key] = log_load_failure(
                    log, exc, "could not open the %s model's processing", key, source=model.source
                )
        for engine in self.engines:
            self._load[engine.name] = 0.0
            await engine.start()
        await self._first_look(FIRST_LOOK_S)
        metrics.HTTP_PROCESSES.set(1)
        self._tasks.append(loop.create_task(self._follow()))
        if self.heartbeat is not None:
            self._tasks.append(loop.create_task(self._beat()))

    async def _beat(self) -> None:
        """Show the launcher that this process's event loop goes round, whatever the
        engines are doing (`_follow` may wait seconds for a busy one)."""
        while True:
            self.heartbeat()
            await asyncio.sleep(FOLLOW_S)

    async def _first_look(self, timeout_s: float) -> None:
        """Read the engines' states once before uvicorn takes connections. A process that
        joins a port already serving (one started again after it died) gets its share of
        connections at once, and without this look it would answer them 503 until its
        first `_follow` round; an engine that is not there by `timeout_s` counts as
        unavailable, as it would then."""
        deadline = time.monotonic() + timeout_s
        while not all(engine.connected for engine in self.engines):
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.01)
        await self.refresh()

    async def _follow(self) -> None:
        """Read the engines' model states; attach what a newly ready model says of itself."""
        frozen = False
        failing = False
        while True:
            try:
                await self.refresh()
            except Exception:
                # A bug (a model that cannot take what its engine says of itself): the
                # states keep being read, and the error is logged once until they are.
                if not failing:
                    log.exception("reading the engines' model states failed")
                failing = True
            else:
                failing = False
            if not frozen and self.settings.advanced.gc_freeze and self.ready:
                freeze_heap()
                frozen = True
            await asyncio.sleep(FOLLOW_S)

    async def refresh(self) -> None:
        for engine in self.engines:
            try:
                _, models = await engine.states() if engine.connected else (False, {})
            except TimeoutError:
                # Connected but slow to answer (a busy machine): what it said last stands;
                # a lost connection is what makes its models unavailable.
                log.warning("engine %s did not report its state in time", engine.name)
                continue
            except EngineUnavailable:
                models = {}
            for key in self.models:
                state = models.get(key, ModelState("unavailable"))
                self.states[key][engine.name] = state
                if state.state == "ready" and key not in self._attached:
                    self._attached.add(key)
                    self._attach(key, state.description)

    def _attach(self, key: str, description: dict) -> None:
        """Give model `key`'s request side what its engine says of the loaded model; one
        that cannot take it counts as failed to load, as one that cannot open does."""
        model = self.models[key]
        try:
            model.attach(description)
        except Exception as exc:
            self._opening[key] = log_load_failure(
                log, exc, "could not take what the engine says of the %s model", key,
                source=model.source,
            )  # fmt: skip

    async def drain(self) -> None:
        """Stop taking requests and finish every one in flight (in its request stages or
        in an engine, and with an engine in this process, every queued one) within
        `DRAIN_TIMEOUT_S`; past it, the requests still in flight are answered 503
        `draining` (`cut_off`)."""
        self.draining = True
        deadline = time.monotonic() + self.settings.drain_timeout_s
        await asyncio.gather(*(e.drain(self.settings.drain_timeout_s) for e in self.engines))
        while (self._inflight or self._preparing) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.cut_off()

    def cut_off(self) -> None:
        """Stop waiting for the requests still in the engines: each is cancelled there
        and answered 503 `draining`, so that none is left to be dropped with its
        connection when the process exits."""
        self.draining = True
        self._cut_off = True
        for submitted in list(self._inflight):
            submitted.cancel(CUT_OFF)

    async def close(self) -> None:
        self.draining = True
        for task in self._tasks:
            task.cancel()
        for engine in self.engines:
            await engine.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        metrics.HTTP_PROCESSES.set(0)

    # -- state -----------------------------------------------------------------

    def model_state(self, key: str) -> tuple[str, str | None]:
        """(state, error) of model `key` over the engines: failed if any failed to load
        it, stalled if any's device work shows no progress, ready if every engine has it
        ready, else loading (or unavailable)."""
        if key in self._opening:
            return "failed", self._opening[key]
        states = list(self.states.get(key, {}).values())
        for state in states:
            if state.state == "failed":
                return "failed", state.error
        for state in states:
            if state.state == "stalled":
                return "stalled", state.error
        if states and all(state.state == "ready" for state in states):
            return "ready", None
        if any(state.state == "unavailable" for state in states):
            return "unavailable", None
        return "loading", None

    @property
    def ready(self) -> bool:
        return (
            bool(self.models)
            and not self.draining
            and all(self.model_state(key)[0] == "ready" for key in self.models)
        )

    async def readiness(self) -> tuple[bool, bool, dict[str, str]]:
        """(ready, draining, {model: state}) for /readyz, from the engines' own state."""
        await self.refresh()
        draining = self.draining
        states = {key: self.model_state(key)[0] for key in self.models}
        return self.ready, draining, states

    def model_label(self, key: str) -> str:
        """The `model` label of a task's metrics: the served model's name."""
        model = self.models.get(key)
        return model.name if model is not None else key

    async def ready_model(self, key: str) -> Model:
        """`model(key)`, reading the engines' states first if the last reading did not
        find it ready (it may be up to `FOLLOW_S` old)."""
        if key in self.models and self.model_state(key)[0] != "ready" and not self.draining:
            await self.refresh()
        return self.model(key)

    def model(self, key: str) -> Model:
        """The request side of model `key`, if it is served and ready."""
        model = self.models.get(key)
        if model is None:
            raise ApiError(404, "model_disabled", f"the {key} model is not enabled on this server")
        if self.draining:
            raise ApiError(503, "draining", "the server is shutting down", {"Retry-After": "1"})
        state, error = self.model_state(key)
        if state == "failed":
            raise ApiError(503, "model_failed", f"the {key} model failed to load: {error}")
        if state == "unavailable":
            raise ApiError(503, "unavailable", "the engine is restarting", {"Retry-After": "1"})
        if state == "stalled":
            message = f"the {key} model is stalled: {error}"
            raise ApiError(503, "stalled", message, {"Retry-After": "5"})
        if state != "ready":
            raise not_ready()
        return model

    def metrics_exposition(self, accept: str | None) -> tuple[bytes, str]:
        return metrics.exposition(accept)

    async def diagnose(self, window_s: float) -> dict:
        return (await self.bottleneck.diagnose(window_s)).as_dict()

    # -- the request flow ------------------------------------------------------

    async def serve(self, key: str, request: Any, trace: RequestTrace) -> tuple[Any, BatchResult]:
        """Run one request of model `key` through its stages and an engine; the model's
        result and the facts of the batch it ran in."""
        arrived = time.monotonic()
        value = await self.prepare(key, request, trace)
        return await self.complete(key, value, trace, arrived)

    async def prepare(self, key: str, request: Any, trace: RequestTrace) -> Any:
        """A request of model `key` through its request stages: the engine's payload."""
        model = self.model(key)
        quick = model.quick_request(request)
        self._preparing += 1
        try:
            return await self._stages(model, model.request_stages(), request, trace, quick)
        finally:
            self._preparing -= 1

    async def complete(
        self,
        key: str,
        value: Any,
        trace: RequestTrace,
        arrived: float,
        on_progress: Callable[[int, int | None], None] | None = None,
    ) -> tuple[Any, BatchResult]:
        """A prepared payload through an engine and the response stages, due
        `REQUEST_TIMEOUT_S` after `arrived` (`time.monotonic()`). A request once prepared
        is not refused for draining: it was accepted before the server began to drain.
        Only once the drain's time is up (`cut_off`) is it answered 503 `draining` here,
        since nothing would cut it off in an engine any more."""
        model = self.models[key]
        if self._cut_off:
            metrics.REJECTED.labels(model.name, "draining").inc()  # no batcher saw it
            raise Draining("the server shut down before this request finished")
        engine = self._pick(key)
        remaining = self.settings.request_timeout_s - (time.monotonic() - arrived)
        if remaining <= 0:
            metrics.REJECTED.labels(model.name, "deadline").inc()  # no batcher saw it
            raise DeadlineExceeded("the request's deadline passed before it was queued")
        cost = model.cost(value)
        submitted_ns = time.time_ns()
        self._load[engine.name] += cost
        submitted = asyncio.ensure_future(
            engine.submit(model, value, remaining, trace.span_context, on_progress)
        )
        self._inflight.add(submitted)
        trace.in_engine = True
        try:
            result = await submitted
        except asyncio.CancelledError:
            # Cancelled by `cut_off`, not with this request's own task (a client gone).
            if self._cut_off and not asyncio.current_task().cancelling():
                trace.unanswered(submitted_ns, Draining.code)
                raise Draining("the server shut down before this request finished") from None
            trace.unanswered(submitted_ns, Cancelled.code)
            raise
        except Exception as exc:
            trace.unanswered(submitted_ns, getattr(exc, "code", type(exc).__name__))
            raise
        finally:
            self._load[engine.name] -= cost
            self._inflight.discard(submitted)
        trace.in_engine = False  # a client gone from here on is counted where it is answered
        self._record(trace, model, value, result, submitted_ns)
        stages = model.response_stages()
        output = await self._stages(model, stages, result.value, trace, model.quick_response)
        return output, result

    async def _stages(
        self, model: Model, stages, value: Any, trace: RequestTrace, inline: bool = False
    ) -> Any:
        """The stages in order, each on the thread pool, or with `inline` on the loop."""
        loop = asyncio.get_running_loop()
        for name, step in stages:
            with trace.stage(name) as span:
                if inline:
                    value = step(value)
                else:
                    value = await loop.run_in_executor(self.pool, step, value)
                for attribute, attribute_value in model.span_attributes(name, value).items():
                    span.set_attribute(attribute, attribute_value)
        return value

    def _pick(self, key: str) -> EngineClient:
        """The engine with the model ready and the least predicted work in flight from
        this process."""
        ready = [
            engine
            for engine in self.engines
            if self.states[key].get(engine.name, ModelState("loading")).state == "ready"
        ]
        if not ready:
            raise ApiError(503, "unavailable", "no engine serves this model right now",
                           {"Retry-After": "1"})  # fmt: skip
        return min(ready, key=lambda engine: self._load[engine.name])

    def _record(
        self, trace: RequestTrace, model: Model, payload: Any, result: BatchResult, at_ns: int
    ) -> None:
        """The `queue.wait` and `generate` spans of what happened in the engine."""
        bucket = str(model.bucket(payload))
        trace.record("queue.wait", at_ns, result.queue_wait_s, **{"texel.bucket": bucket})
        links = [Link(result.batch_ref)] if result.batch_ref is not None else None
        trace.record(
            "generate",
            at_ns + int(result.queue_wait_s * 1e9),
            result.run_s,
            links=links,
            **{
                "texel.batch.size": result.batch_size,
                "texel.bucket": bucket,
                "texel.device": result.worker,
            },
        )


def freeze_heap() -> None:
    """Put every object alive now (modules, models, tokenizers) out of the cyclic garbage
    collector's reach: its full collections then scan only what requests allocate since,
    and pause every thread of the process for that much less."""
    gc.collect()
    gc.freeze()
    metrics.GC_FROZEN.set(gc.get_freeze_count())
