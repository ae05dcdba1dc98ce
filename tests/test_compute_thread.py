"""Which thread computes: an engine's models share one compute thread on a CPU (loading
included); on a GPU they have one each (tests/test_gpu_sharing.py)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from engine import Draining, Engine, ModelPlan
from models.base import DeviceRunner, Model
from tests.test_stream import FakeStream

CPU = torch.device("cpu")


class Recorder(Model):
    """A model that notes which thread ran each step of its life and each batch; with
    `stream`, its batches run continuously through it (`batching.stream`)."""

    payload_type = object
    output_type = object

    def __init__(self, key: str, threads: list[tuple[str, int]], stream=None) -> None:
        super().__init__(key, key)
        self.key = key
        self.threads = threads
        self.stream = stream

    def _note(self, step: str) -> None:
        self.threads.append((f"{self.key}.{step}", threading.get_ident()))

    def open(self) -> None:
        self._note("open")

    def load(self, device) -> None:
        self._note("load")

    def warmup(self, device, max_batch_size: int) -> None:
        self._note("warmup")

    def bucket(self, payload) -> int:
        return 0

    def runner(self, device) -> DeviceRunner:
        def run(payloads, should_stop):
            self._note("run")
            return list(payloads)

        return DeviceRunner(run, self.stream)

    def request_stages(self):
        return []

    def response_stages(self):
        return []


def plan(model: Recorder, max_batch_size: int = 4) -> ModelPlan:
    return ModelPlan(model.key, lambda: model, max_batch_size, max_wait_s=0.001, max_queue=64)


async def test_a_cpu_engine_loads_warms_up_and_runs_every_model_on_one_thread():
    threads: list[tuple[str, int]] = []
    engine = Engine(CPU, [plan(Recorder("formula", threads)), plan(Recorder("image", threads))])
    await engine.start()
    try:
        for key in ("formula", "image"):
            assert (await engine.submit(key, "x", timeout_s=5)).value == "x"
    finally:
        await engine.close()
    steps = [step for step, _ in threads]
    loading = [
        f"{key}.{step}" for key in ("formula", "image") for step in ("open", "load", "warmup")
    ]
    assert steps == [*loading, "formula.run", "image.run"]
    idents = {ident for _, ident in threads}
    assert len(idents) == 1, "one compute thread for the CPU"
    assert threading.get_ident() not in idents, "none of it on the event loop's thread"


async def test_a_stream_on_a_cpu_gives_way_to_another_models_batch():
    """On a CPU a formula stream under endless load must let the image model's batch run
    on the shared compute thread, then carry on with the requests it left queued."""
    threads: list[tuple[str, int]] = []
    streamed = Recorder("formula", threads, stream=FakeStream(rows=4))
    engine = Engine(CPU, [plan(streamed), plan(Recorder("image", threads))])
    await engine.start()
    stop = asyncio.Event()
    answered = 0

    async def client(steps: int) -> None:
        nonlocal answered
        while not stop.is_set():
            result = await engine.submit("formula", (1, steps), timeout_s=30)
            assert result.value == 2
            answered += 1

    try:
        # Twice as many clients as rows, each row of its own length: rows end at
        # different checks, so the stream (almost) never runs dry and ends by itself.
        clients = [asyncio.create_task(client(20 + k)) for k in range(8)]
        await asyncio.sleep(0.1)
        other = await asyncio.wait_for(engine.submit("image", "other", timeout_s=30), 5)
        assert other.value == "other"
        before = answered
        await asyncio.sleep(0.5)  # rows take 20-27 checks of 5 ms
        assert answered > before, "the streamed model carries on afterwards"
        stop.set()
        await asyncio.gather(*clients)
        assert await engine.drain(5)
    finally:
        await engine.close()


class Held(Recorder):
    """A Recorder whose batches hold the compute thread until `gate` is set."""

    def __init__(self, key: str, threads: list[tuple[str, int]], gate: threading.Event) -> None:
        super().__init__(key, threads)
        self.gate = gate

    def runner(self, device) -> DeviceRunner:
        def run(payloads, should_stop):
            self.gate.wait(10)
            return list(payloads)

        return DeviceRunner(run)


@pytest.mark.parametrize("stream", [False, True], ids=["batch", "stream"])
async def test_a_batch_waiting_for_the_thread_when_the_engine_closes_is_answered_draining(stream):
    """Closing an engine shuts its compute thread down: a batch of one model still
    waiting behind another's gets `Draining` at once, not silence until its deadline."""
    threads: list[tuple[str, int]] = []
    gate = threading.Event()
    waiting = Recorder("formula", threads, stream=FakeStream(rows=4) if stream else None)
    engine = Engine(CPU, [plan(Held("image", threads, gate)), plan(waiting)])
    await engine.start()
    try:
        holding = asyncio.ensure_future(engine.submit("image", "first", timeout_s=30))
        await asyncio.sleep(0.1)  # its batch holds the thread
        behind = asyncio.ensure_future(engine.submit("formula", (1, 3) if stream else "x", 30))
        await asyncio.sleep(0.1)  # its batch (or stream) waits for the thread
        await engine.close()
        with pytest.raises(Draining):
            await asyncio.wait_for(behind, 2)
    finally:
        gate.set()
    assert (await holding).value == "first"  # the batch that held the thread ran out
