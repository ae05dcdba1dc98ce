"""The engine: one owner of a device, reached in-process or over its socket alike."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from engine import (
    DeadlineExceeded,
    Engine,
    EngineUnavailable,
    LocalEngine,
    ModelPlan,
    NotReady,
    QueueFull,
    RemoteEngine,
    UnknownModel,
    protocol,
)
from engine.process import HUNG_EXIT, EngineServer, end_when_hung
from models.base import DeviceRunner, Model
from models.formula.preprocess import FormulaInput
from models.image.adapter import GeneratedImages, ImageJob

CPU = torch.device("cpu")


class Doubler(Model):
    """A model family of the simplest kind: a number in, twice it out, after `delay_s`."""

    key = "double"
    payload_type = int
    output_type = int

    def __init__(self, delay_s: float = 0.0, fail_on: int | None = None) -> None:
        super().__init__("doubler", "doubler")
        self.delay_s = delay_s
        self.fail_on = fail_on
        self.batches: list[list[int]] = []
        self.release = threading.Event()
        self.release.set()

    def open(self) -> None:
        pass

    def load(self, device) -> None:
        pass

    def warmup(self, device, max_batch_size: int) -> None:
        pass

    def describe(self) -> dict:
        return {"factor": 2}

    def bucket(self, payload: int) -> int:
        return 0

    def runner(self, device) -> DeviceRunner:
        def run(payloads: list[int], should_stop) -> list[int]:
            self.batches.append(list(payloads))
            self.release.wait(10)
            if self.fail_on in payloads:
                raise ValueError("the model broke")
            return [2 * p for p in payloads]

        return DeviceRunner(run)

    def request_stages(self):
        return []

    def response_stages(self):
        return []


def plan(model: Doubler, **policy) -> ModelPlan:
    defaults = {"max_batch_size": 8, "max_wait_s": 0.05, "max_queue": 16}
    return ModelPlan("double", lambda: model, **{**defaults, **policy})


async def ready_engine(model: Doubler, **policy) -> Engine:
    engine = Engine(CPU, [plan(model, **policy)])
    await engine.start()
    assert engine.states()["double"].state == "ready"
    return engine


async def until(condition, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def connected(path: str) -> RemoteEngine:
    client = RemoteEngine(path, "cpu")
    await client.start()
    await until(lambda: client.connected)
    return client


@pytest.fixture
async def remote(tmp_path):
    """An engine served on a Unix socket in this process, and a client connected to it."""
    model = Doubler()
    engine = await ready_engine(model)
    path = str(tmp_path / "engine.sock")
    server = await asyncio.start_unix_server(EngineServer(engine).connection, path=path)
    client = await connected(path)
    yield model, engine, server, client
    await client.close()
    server.close()
    await engine.close()


# -- the protocol ------------------------------------------------------------------


def test_a_formula_payload_crosses_the_protocol_unchanged() -> None:
    strip = np.arange(32 * 70, dtype=np.uint8).reshape(32, 70)
    payload = FormulaInput(strip, 128)
    back = protocol.decoder(FormulaInput).decode(protocol.encode(payload))
    assert back.bucket == 128
    assert back.strip.dtype == np.uint8 and back.strip.shape == (32, 70)
    assert np.array_equal(back.strip, strip)


def test_images_and_jobs_cross_the_protocol_unchanged() -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    out = GeneratedImages([pixels], (7,), [0.5, 0.25])
    back = protocol.decoder(GeneratedImages).decode(protocol.encode(out))
    assert back.seeds == (7,) and back.step_s == [0.5, 0.25]
    assert np.array_equal(back.images[0], pixels)
    job = ImageJob("a cat", None, 64, 32, 4, 7.5, (1, 2), 5)
    assert protocol.decoder(ImageJob).decode(protocol.encode(job)) == job


def test_a_refusal_comes_back_as_the_error_it_stands_for() -> None:
    full = protocol.refusal_error(protocol.refusal(1, QueueFull(9, 3.0)))
    assert isinstance(full, QueueFull) and full.retry_after_s == 3.0
    late = protocol.refusal_error(protocol.refusal(2, DeadlineExceeded("too late")))
    assert isinstance(late, DeadlineExceeded) and late.message == "too late"
    odd = protocol.refusal_error(protocol.refusal(3, KeyError("x")))
    assert odd.code == "batch_failed" and "KeyError" in odd.message


# -- the engine --------------------------------------------------------------------


async def test_concurrent_requests_run_in_one_batch() -> None:
    model = Doubler()
    engine = await ready_engine(model)
    results = await asyncio.gather(*(engine.submit("double", n, 5.0) for n in range(4)))
    assert [r.value for r in results] == [0, 2, 4, 6]
    assert model.batches == [[0, 1, 2, 3]]
    assert {r.batch_size for r in results} == {4}
    await engine.close()


async def test_an_engine_refuses_what_it_cannot_serve() -> None:
    engine = Engine(CPU, [plan(Doubler())])
    with pytest.raises(NotReady):  # not started: still loading
        await engine.submit("double", 1, 5.0)
    await engine.start()
    with pytest.raises(UnknownModel):
        await engine.submit("triple", 1, 5.0)
    await engine.close()


async def test_a_model_whose_batch_shows_no_progress_is_reported_stalled_until_it_returns():
    model = Doubler()
    model.release.clear()  # its batch hangs until released
    engine = await ready_engine(model, stall_s=0.2, max_wait_s=0.0)
    try:
        answer = asyncio.ensure_future(engine.submit("double", 4, timeout_s=10))
        await until(lambda: engine.states()["double"].state == "stalled")
        assert "no progress" in engine.states()["double"].error
        model.release.set()
        assert (await answer).value == 8
        assert engine.states()["double"].state == "ready"
    finally:
        model.release.set()
        await engine.close()


async def test_an_engine_process_whose_device_work_hangs_ends_itself_for_a_restart():
    model = Doubler()
    model.release.clear()  # its batch hangs until released
    engine = await ready_engine(model, stall_s=0.5, max_wait_s=0.0)
    ended: list[int] = []
    watchdog = asyncio.ensure_future(end_when_hung(engine, every_s=0.02, end=ended.append))
    try:
        await asyncio.sleep(0.1)
        assert not ended, "an idle engine is not hung"
        answer = asyncio.ensure_future(engine.submit("double", 4, timeout_s=10))
        await until(lambda: engine.states()["double"].state == "stalled")
        assert not ended, "stalled is reported first; the process ends at twice the limit"
        await asyncio.wait_for(watchdog, 5)
        assert ended == [HUNG_EXIT]
        assert "no progress" in engine.hung()[0]
    finally:
        model.release.set()
        watchdog.cancel()
        await answer
        await engine.close()


async def test_a_model_that_fails_to_load_is_reported_failed() -> None:
    def broken() -> Model:
        raise OSError("no weights at /nowhere")

    engine = Engine(CPU, [ModelPlan("double", broken, 8, 0.01, 16)])
    await engine.start()
    state = engine.states()["double"]
    assert state.state == "failed" and "no weights at /nowhere" in state.error
    await engine.close()


class SlowToWarm(Doubler):
    """A Doubler whose warm-up waits for `warmed` (as an image model's takes tens of
    seconds on a CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.warming = threading.Event()
        self.warmed = threading.Event()

    def warmup(self, device, max_batch_size: int) -> None:
        self.warming.set()
        self.warmed.wait(10)


async def test_on_a_cpu_no_model_is_ready_while_another_warms_up_on_its_thread() -> None:
    """The models take turns on the CPU's one thread: a model ready while another warmed
    up would take requests and hold them until that warm-up ended."""
    slow = SlowToWarm()
    plans = [
        ModelPlan("first", Doubler, 8, 0.01, 16),
        ModelPlan("second", lambda: slow, 8, 0.01, 16),
    ]
    engine = Engine(CPU, plans)
    loading = engine.start()
    await until(slow.warming.is_set)
    assert {key: state.state for key, state in engine.states().items()} == {
        "first": "loading",
        "second": "loading",
    }
    slow.warmed.set()
    await loading
    assert {state.state for state in engine.states().values()} == {"ready"}
    await engine.close()


async def test_a_model_that_fails_to_load_leaves_the_others_ready_on_a_cpu() -> None:
    def broken() -> Model:
        raise OSError("no weights at /nowhere")

    engine = Engine(
        CPU, [ModelPlan("first", Doubler, 8, 0.01, 16), ModelPlan("second", broken, 8, 0.01, 16)]
    )
    await engine.start()
    assert {key: state.state for key, state in engine.states().items()} == {
        "first": "ready",
        "second": "failed",
    }
    await engine.close()


class NotCached(Doubler):
    """A hub model this machine has not cached, as `from_pretrained` fails offline."""

    def load(self, device) -> None:
        raise OSError(
            "We couldn't connect to 'https://huggingface.co' to load the files, and couldn't "
            "find them in the cached files. ... pass 'local_files_only=False' as input."
        )


async def test_a_hub_model_not_cached_offline_is_reported_in_texels_terms(monkeypatch) -> None:
    """Not the hub library's advice (an argument no Texel user passes, a stack trace
    nobody is shown): where to get the model."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    engine = Engine(CPU, [ModelPlan("double", NotCached, 8, 0.01, 16)])
    await engine.start()
    error = engine.states()["double"].error
    assert error.startswith("doubler is neither a local folder nor in this machine's Hugging")
    assert "HF_HUB_OFFLINE is set: download it where there is network (hf download" in error
    assert "local_files_only" not in error
    await engine.close()
    monkeypatch.delenv("HF_HUB_OFFLINE")  # online, the library's own words stand
    engine = Engine(CPU, [ModelPlan("double", NotCached, 8, 0.01, 16)])
    await engine.start()
    assert engine.states()["double"].error.startswith("OSError: We couldn't connect")
    await engine.close()


async def test_the_local_client_answers_like_the_engine() -> None:
    model = Doubler()
    client = LocalEngine(Engine(CPU, [plan(model)]))
    await client.start()
    await client.engine._loader
    result = await client.submit(model, 21, 5.0, None)
    assert result.value == 42 and result.worker == "cpu"
    draining, states = await client.states()
    assert not draining and states["double"].description == {"factor": 2}
    await client.close()


# -- over the socket -----------------------------------------------------------------


async def test_a_remote_engine_answers_like_a_local_one(remote) -> None:
    model, _, _, client = remote
    results = await asyncio.gather(*(client.submit(model, n, 5.0, None) for n in range(3)))
    assert [r.value for r in results] == [0, 2, 4]
    assert model.batches == [[0, 1, 2]]
    draining, states = await client.states()
    assert states["double"].state == "ready" and states["double"].description == {"factor": 2}


async def test_a_batch_failure_reaches_the_client_as_batch_failed(remote) -> None:
    model, _, _, client = remote
    model.fail_on = 3
    with pytest.raises(Exception) as failure:
        await client.submit(model, 3, 5.0, None)
    assert failure.value.code == "batch_failed" and "the model broke" in failure.value.message


async def test_a_full_queue_answers_429_material_over_the_socket(tmp_path) -> None:
    model = Doubler()
    model.release.clear()  # the first batch holds the worker
    engine = await ready_engine(model, max_batch_size=1, max_queue=1, max_wait_s=0)
    path = str(tmp_path / "e.sock")
    server = await asyncio.start_unix_server(EngineServer(engine).connection, path=path)
    client = await connected(path)
    running = asyncio.ensure_future(client.submit(model, 1, 5.0, None))
    await until(lambda: model.batches)
    queued = asyncio.ensure_future(client.submit(model, 2, 5.0, None))
    await until(lambda: engine.depth("double") == 1)
    with pytest.raises(QueueFull) as full:
        await client.submit(model, 3, 5.0, None)
    assert full.value.retry_after_s > 0
    model.release.set()
    assert (await running).value == 2 and (await queued).value == 4
    await client.close()
    server.close()
    await engine.close()


async def test_a_cancelled_request_leaves_the_engine_queue(remote) -> None:
    model, engine, _, client = remote
    model.release.clear()
    first = asyncio.ensure_future(client.submit(model, 1, 5.0, None))
    await until(lambda: model.batches)
    waiting = asyncio.ensure_future(client.submit(model, 2, 5.0, None))
    await until(lambda: engine.depth("double") == 1)
    waiting.cancel()
    await until(lambda: engine.depth("double") == 0)  # the cancel arrived
    model.release.set()
    assert (await first).value == 2


async def test_requests_in_an_engine_that_goes_away_fail_and_the_client_reconnects(
    tmp_path,
) -> None:
    model = Doubler()
    model.release.clear()
    engine = await ready_engine(model)
    path = str(tmp_path / "e.sock")
    connections: list[asyncio.StreamWriter] = []

    async def accept(reader, writer):
        connections.append(writer)
        await EngineServer(engine).connection(reader, writer)

    server = await asyncio.start_unix_server(accept, path=path)
    client = await connected(path)
    in_flight = asyncio.ensure_future(client.submit(model, 1, 5.0, None))
    await until(lambda: model.batches)
    server.close()  # the engine process dies: its socket and connections close
    for writer in connections:
        writer.transport.abort()
    with pytest.raises(EngineUnavailable):
        await asyncio.wait_for(in_flight, 5)
    model.release.set()
    engine2 = await ready_engine(Doubler())
    server2 = await asyncio.start_unix_server(EngineServer(engine2).connection, path=path)
    await until(lambda: client.connected)
    assert (await client.submit(model, 5, 5.0, None)).value == 10
    await client.close()
    server2.close()
    await engine.close()
    await engine2.close()


async def test_an_engine_silent_past_a_requests_deadline_gets_it_answered_unavailable(
    tmp_path, monkeypatch
) -> None:
    """An engine answers at a request's deadline itself; one whose event loop stands still
    (stopped, deadlocked) answers nothing, and the HTTP process stops waiting a grace
    after the deadline instead of holding the request until the engine is restarted."""
    from engine import client as engine_client

    monkeypatch.setattr(engine_client, "ANSWER_GRACE_S", 0.2)
    heard = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):  # reads every frame, answers none
            heard.append(chunk)

    path = str(tmp_path / "silent.sock")
    server = await asyncio.start_unix_server(silent, path=path)
    client = await connected(path)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(EngineUnavailable, match="did not answer by the request's deadline"):
            await asyncio.wait_for(client.submit(Doubler(), 1, timeout_s=0.3, context=None), 5)
        assert asyncio.get_running_loop().time() - started >= 0.5
        await until(lambda: b"cancel" in b"".join(heard))  # its place is given up too
    finally:
        await client.close()
        server.close()
