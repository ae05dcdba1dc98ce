"""How the models of one device share it (`engine.sharing`): which stream each model's
work queues on under each policy (a fake CUDA here, where no GPU is), and each model's
device time in /metrics and on its batch spans, from real tiny models on a CPU."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.launcher import single_process_app
from app.settings import Settings
from engine import Engine, ModelPlan, sharing
from engine.sharing import DeviceMeter
from telemetry import add_span_processor, metrics
from tests.conftest import formula_png
from tests.server import serving_in_thread
from tests.test_compute_thread import Recorder

CPU = torch.device("cpu")
GPU = torch.device("cuda", 1)
LOWEST, HIGHEST = 0, -5  # CUDA counts priorities down
SMS = 132  # an H200's


class FakeEvent:
    """A timing event at a given time (seconds), passed by the device once `passed`."""

    def __init__(self, at: float, passed: bool = True) -> None:
        self.at = at
        self.passed = passed

    def query(self) -> bool:
        return self.passed

    def synchronize(self) -> None:
        self.passed = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000


class FakeCuda:
    """The engine's CUDA calls, recorded: the device and stream priority each compute
    thread entered; events at the times of `clock`, passed when `passed` says so."""

    def __init__(self) -> None:
        self.entered: list[tuple[torch.device, int | None, int]] = []
        self.clock = 0.0
        self.passed = True
        self.events: list[FakeEvent] = []
        self.sms: list[int | None] = []

    def priority_range(self) -> tuple[int, int]:
        return LOWEST, HIGHEST

    def enter(self, device: torch.device, priority: int | None, sms: int | None) -> None:
        self.entered.append((device, priority, threading.get_ident()))
        self.sms.append(sms)

    def sm_count(self, device: torch.device) -> int:
        return SMS

    def event(self) -> FakeEvent:
        self.events.append(FakeEvent(self.clock, self.passed))
        return self.events[-1]


def plan(model: Recorder) -> ModelPlan:
    return ModelPlan(model.key, lambda: model, 4, max_wait_s=0.001, max_queue=64)


async def entered_by_model(device: torch.device, policy: str) -> dict[str, set]:
    """The (device, priority) each model's compute thread entered on an engine of
    `device` under `policy`, after one request each."""
    cuda = FakeCuda()
    threads: list[tuple[str, int]] = []
    formula = Recorder("formula", threads)
    formula.latency_sensitive = True
    engine = Engine(device, [plan(formula), plan(Recorder("image", threads))], policy, cuda)
    await engine.start()
    try:
        for key in ("formula", "image"):
            assert (await engine.submit(key, "x", timeout_s=5)).value == "x"
    finally:
        await engine.close()
    by_thread = {ident: (device, priority) for device, priority, ident in cuda.entered}
    return {
        key: {by_thread.get(ident) for step, ident in threads if step.startswith(key)}
        for key in ("formula", "image")
    }


@pytest.mark.parametrize(
    ("policy", "formula", "image"),
    [
        ("priority", HIGHEST, LOWEST),  # the latency-sensitive model's work goes first
        ("off", None, None),  # both on the device's default stream
    ],
)
async def test_each_policy_puts_each_models_gpu_work_on_its_own_lane(policy, formula, image):
    entered = await entered_by_model(GPU, policy)
    assert entered == {"formula": {(GPU, formula)}, "image": {(GPU, image)}}


def test_on_a_shared_gpu_a_model_that_is_not_latency_sensitive_leaves_sms_to_the_others():
    cuda = FakeCuda()
    assert sharing.lane("priority", GPU, False, cuda, shared=True).sms == 96  # 100, in 8s
    assert sharing.lane("priority", GPU, True, cuda, shared=True).sms is None
    assert sharing.lane("priority", GPU, False, cuda, shared=False).sms is None
    assert sharing.lane("off", GPU, False, cuda, shared=True).sms is None


async def test_an_engine_of_two_models_confines_the_one_that_is_not_latency_sensitive():
    cuda = FakeCuda()
    threads: list[tuple[str, int]] = []
    formula = Recorder("formula", threads)
    formula.latency_sensitive = True
    engine = Engine(GPU, [plan(formula), plan(Recorder("image", threads))], "priority", cuda)
    await engine.start()
    await engine.close()
    assert cuda.sms == [None, 96]  # loaded in the order of the plans
    alone = FakeCuda()
    engine = Engine(GPU, [plan(Recorder("image", threads))], "priority", alone)
    await engine.start()
    await engine.close()
    assert alone.sms == [None]


async def test_a_model_whose_only_company_failed_to_load_has_the_whole_gpu():
    cuda = FakeCuda()
    threads: list[tuple[str, int]] = []

    def broken():
        raise RuntimeError("no weights here")

    formula = ModelPlan("formula", broken, 4, max_wait_s=0.001, max_queue=64)
    engine = Engine(GPU, [formula, plan(Recorder("image", threads))], "priority", cuda)
    await engine.start()
    await engine.close()
    assert engine.states()["formula"].state == "failed"
    assert cuda.sms == [None]


async def test_a_gpu_engine_gives_each_model_a_thread_that_makes_its_gpu_current():
    """A model on cuda:1 must not capture graphs or open streams on cuda:0, every
    thread's starting device."""
    cuda = FakeCuda()
    threads: list[tuple[str, int]] = []
    models = [plan(Recorder("formula", threads)), plan(Recorder("image", threads))]
    engine = Engine(GPU, models, cuda=cuda)
    await engine.start()
    try:
        for key in ("formula", "image"):
            assert (await engine.submit(key, "x", timeout_s=5)).value == "x"
    finally:
        await engine.close()
    formula = {ident for step, ident in threads if step.startswith("formula.")}
    image = {ident for step, ident in threads if step.startswith("image.")}
    assert len(formula) == len(image) == 1 and formula != image, "a thread per model"
    entered = sorted((str(device), ident) for device, _, ident in cuda.entered)
    assert entered == sorted([(str(GPU), *formula), (str(GPU), *image)])


def seeing_company(seen: list[bool]):
    """A stream runner that answers each request at once and notes, at every look, whether
    its feed said another model shares the device."""

    def stream(feed) -> None:
        while True:
            seen.append(feed.shares_device())
            if new := feed.take(4):
                feed.done(new)
            elif feed.finish():
                return

    return stream


async def company_seen(device: torch.device, others: list[ModelPlan]) -> set[bool]:
    """What the formula stream's feed says of its device's company, one request served."""
    threads: list[tuple[str, int]] = []
    seen: list[bool] = []
    formula = Recorder("formula", threads, stream=seeing_company(seen))
    engine = Engine(device, [plan(formula), *others], "priority", FakeCuda())
    await engine.start()
    try:
        assert (await engine.submit("formula", "x", timeout_s=5)).value == "x"
    finally:
        await engine.close()
    return set(seen)


async def test_a_stream_is_told_whether_another_model_shares_its_gpu() -> None:
    """The formula stream's feed says so on a GPU with the image model (its decoder then
    looks half as often), not on a GPU of its own, one whose other model failed to load,
    or a CPU, where the models take turns on one thread."""

    def broken():
        raise RuntimeError("no weights here")

    image = plan(Recorder("image", []))
    failed = ModelPlan("image", broken, 4, max_wait_s=0.001, max_queue=64)
    assert await company_seen(GPU, [image]) == {True}
    assert await company_seen(GPU, []) == {False}
    assert await company_seen(GPU, [failed]) == {False}
    assert await company_seen(CPU, [image]) == {False}


async def test_on_a_cpu_no_policy_touches_cuda():
    for policy in ("priority", "off"):
        assert await entered_by_model(CPU, policy) == {"formula": {None}, "image": {None}}


def counted(model: str, device: torch.device) -> float:
    return metrics.DEVICE_SECONDS.labels(model, str(device))._value.get()


def test_a_gpu_streams_steps_are_credited_once_the_device_has_passed_them_never_waited_for():
    cuda = FakeCuda()
    meter = DeviceMeter("sharing-test-stream", GPU, cuda)
    before = counted("sharing-test-stream", GPU)
    cuda.passed = False  # the device runs behind the host
    for at in (0.0, 0.5, 1.25):  # three step boundaries: two steps queued
        cuda.clock = at
        meter.lap()
    assert meter.total_s == 0.0, "nothing credited before the device gets there"
    for event in cuda.events:
        event.passed = True
    cuda.clock = 2.0
    meter.lap()  # the next boundary collects what the device has passed
    assert meter.total_s == pytest.approx(1.25)
    meter.stop(wait=True)  # the stream ended: its last step counts too
    assert meter.total_s == pytest.approx(2.0)
    assert counted("sharing-test-stream", GPU) - before == pytest.approx(2.0)


def test_a_gpu_batch_is_credited_when_it_returns():
    cuda = FakeCuda()
    meter = DeviceMeter("sharing-test-batch", GPU, cuda)
    cuda.passed = False
    with meter.timed():
        cuda.clock = 0.75
    assert meter.total_s == pytest.approx(0.75)


@pytest.fixture(scope="module")
def both_models_on_a_cpu(tiny_models):
    exporter = InMemorySpanExporter()
    settings = Settings(
        device="cpu",
        formula={"model": str(tiny_models["formula"]), "name": "sharing-formula", "cache_mb": 0},
        image={"model": str(tiny_models["image"]), "name": "sharing-image"},
    )
    app = single_process_app(settings)
    add_span_processor(SimpleSpanProcessor(exporter))
    with serving_in_thread(app) as url:
        yield url, exporter


def device_seconds(url: str) -> dict[str, float]:
    """texel_device_seconds_total on the CPU, by model, from a /metrics scrape."""
    found = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("texel_device_seconds_total{") and 'device="cpu"' in line:
            model = line.split('model="', 1)[1].split('"', 1)[0]
            found[model] = float(line.rsplit(" ", 1)[1])
    return found


def test_metrics_show_each_models_device_time(both_models_on_a_cpu):
    url, _ = both_models_on_a_cpu
    before = device_seconds(url)
    files = {"image": ("f.png", formula_png(), "image/png")}
    assert httpx.post(url + "/recognize", files=files, timeout=60).status_code == 200
    body = {"prompt": "a red circle", "num_inference_steps": 2, "seed": 1}
    assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
    after = device_seconds(url)
    for model in ("sharing-formula", "sharing-image"):
        assert after[model] > before.get(model, 0.0), model


def test_batch_spans_carry_the_device_time_they_took(both_models_on_a_cpu):
    url, exporter = both_models_on_a_cpu
    exporter.clear()
    files = {"image": ("f.png", formula_png("y"), "image/png")}
    assert httpx.post(url + "/recognize", files=files, timeout=60).status_code == 200
    body = {"prompt": "a blue square", "num_inference_steps": 2, "seed": 2}
    assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
    batches = [s for s in exporter.get_finished_spans() if s.name == "batch"]
    models = {s.attributes["texel.model"] for s in batches}
    assert models == {"sharing-formula", "sharing-image"}
    for span in batches:
        assert span.attributes["texel.device.seconds"] > 0
        assert "texel.device.stream" not in span.attributes, "a CPU has no streams"
