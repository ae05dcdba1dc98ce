"""An HTTP process's runtime (`app.serving.Runtime`) with its engine in another process:
its drain answers every request accepted before it began, whatever stage it is in, never
dropping one with its connection; a model's state and a request's accounting. The engine
is served on a Unix socket in this process, as an engine process serves it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app import routes
from app.errors import ApiError
from app.serving import Runtime
from app.settings import Settings
from engine import Draining, RemoteEngine
from engine.process import EngineServer
from telemetry import RequestTrace, metrics
from tests.test_engine import Doubler, ready_engine


class SlowToPrepare(Doubler):
    """The HTTP process's side of the doubler, with a request stage (a large upload being
    decoded) that waits for `gate`."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()

    def request_stages(self):
        def decode(value: int) -> int:
            self.entered.set()
            self.gate.wait(10)
            return value

        return [("preprocess", decode)]


@pytest.fixture
async def runtime(tmp_path):
    """Start a runtime by calling `runtime(drain_timeout_s)`: one HTTP process's runtime,
    with an engine on a Unix socket as its only engine."""
    engine = await ready_engine(Doubler())
    path = str(tmp_path / "engine.sock")
    server = await asyncio.start_unix_server(EngineServer(engine).connection, path=path)
    started: list[Runtime] = []

    async def start(
        drain_timeout_s: float = 30, model: SlowToPrepare | None = None
    ) -> tuple[Runtime, SlowToPrepare]:
        model = model or SlowToPrepare()
        settings = Settings(drain_timeout_s=drain_timeout_s)
        runtime = Runtime(settings, {"double": model}, [RemoteEngine(path, "cpu")])
        await runtime.start()
        started.append(runtime)
        return runtime, model

    yield start
    for runtime in started:
        runtime.models["double"].gate.set()
        await runtime.close()
    server.close()
    await engine.close()


def serve(runtime: Runtime) -> asyncio.Future:
    return asyncio.ensure_future(runtime.serve("double", 21, RequestTrace("doubler", "doubler")))


async def until(event: threading.Event) -> None:
    deadline = time.monotonic() + 5
    while not event.is_set():
        assert time.monotonic() < deadline, "the request never reached its request stage"
        await asyncio.sleep(0.01)


async def test_the_drain_waits_for_a_request_still_in_its_request_stages(runtime):
    """It is in no engine yet, but it was accepted: the drain finishes it first."""
    runtime, model = await runtime()
    assert runtime.ready
    request = serve(runtime)
    await until(model.entered)
    drain = asyncio.ensure_future(runtime.drain())
    await asyncio.sleep(0.3)
    assert not drain.done(), "the drain ended with an accepted request still to be sent"
    model.gate.set()
    value, _ = await asyncio.wait_for(request, 5)
    assert value == 42
    await asyncio.wait_for(drain, 5)


async def test_a_request_prepared_after_the_drain_ran_out_is_answered_draining(runtime):
    """Past the drain's time, nothing would cut it off in the engine (its connection
    would be dropped when the process exits): it is answered 503 `draining` at once."""
    runtime, model = await runtime(drain_timeout_s=0.2)
    assert runtime.ready
    refused = metrics.REJECTED.labels("doubler", "draining")
    before = refused._value.get()
    request = serve(runtime)
    await until(model.entered)
    await asyncio.wait_for(runtime.drain(), 5)
    model.gate.set()
    with pytest.raises(Draining):
        await asyncio.wait_for(request, 2)
    assert refused._value.get() == before + 1


async def test_a_client_gone_after_the_engine_answered_is_counted_where_it_is_answered(runtime):
    """The engine's batcher counts a request cancelled while it is there; once it has
    answered, a client that goes away (during the response stages) is counted by the
    route that answers it, or by no one."""
    runtime, model = await runtime()
    model.gate.set()
    trace = RequestTrace("doubler", "doubler")
    value, _ = await runtime.serve("double", 21, trace)
    assert value == 42
    gone = ApiError(499, "client_closed_request", "the client disconnected")
    assert routes._rejection(gone, gone, trace) == "cancelled"


class Unattachable(SlowToPrepare):
    def attach(self, description: dict) -> None:
        raise ValueError(f"cannot read {sorted(description)}")


async def test_a_model_that_cannot_take_what_its_engine_says_of_it_is_reported_failed(runtime):
    """Not ready (which would run requests through a half-set request side) and not a
    background task that dies: failed, with the reason, as a model that cannot open."""
    runtime, _ = await runtime(model=Unattachable())
    state, error = runtime.model_state("double")
    assert state == "failed" and "cannot read ['factor']" in error
    assert not runtime.ready
    await asyncio.sleep(0.6)  # a few rounds of reading the engine's states
    assert runtime.model_state("double")[0] == "failed"
    assert all(not task.done() for task in runtime._tasks)
