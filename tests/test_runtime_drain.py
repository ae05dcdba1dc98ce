"""An HTTP process's drain (`Runtime.drain`) with its engine in another process: a
request accepted before the drain began is answered, whatever stage it is in, never
dropped with its connection. The engine is served on a Unix socket in this process, as
an engine process serves it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

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

    async def start(drain_timeout_s: float) -> tuple[Runtime, SlowToPrepare]:
        model = SlowToPrepare()
        settings = Settings(drain_timeout_s=drain_timeout_s)
        runtime = Runtime(settings, {"double": model}, [RemoteEngine(path, "cpu")])
        await runtime.start()
        started.append(runtime)
        assert runtime.ready
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
    runtime, model = await runtime(drain_timeout_s=30)
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
    refused = metrics.REJECTED.labels("doubler", "draining")
    before = refused._value.get()
    request = serve(runtime)
    await until(model.entered)
    await asyncio.wait_for(runtime.drain(), 5)
    model.gate.set()
    with pytest.raises(Draining):
        await asyncio.wait_for(request, 2)
    assert refused._value.get() == before + 1
