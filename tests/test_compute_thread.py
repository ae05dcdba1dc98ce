"""Every torch computation of CPU models happens on one thread: loading included."""

from __future__ import annotations

import threading

import torch

from app.serving import Runtime, ServedModel
from app.settings import FormulaSettings, ImageSettings, Settings


class RecordingAdapter:
    """A stand-in model adapter that notes which thread ran each lifecycle step."""

    operation = "generate_content"
    merge_buckets = False

    def __init__(self, name: str, threads: list[tuple[str, int]]) -> None:
        self.name = name
        self.devices = [torch.device("cpu")]
        self.threads = threads

    def _note(self, step: str) -> None:
        self.threads.append((f"{self.name}.{step}", threading.get_ident()))

    def load(self) -> None:
        self._note("load")

    def warmup(self, device, max_batch_size: int) -> None:
        self._note("warmup")

    def runner(self, device):
        def run(batch, should_stop):
            self._note("run")
            return list(batch)

        return run

    def padding_efficiency(self, batch) -> None:
        return None


async def test_cpu_models_load_warm_up_and_run_on_one_shared_thread():
    threads: list[tuple[str, int]] = []
    runtime = Runtime(Settings())
    models = {
        "formula": ServedModel(
            "formula", RecordingAdapter("formula", threads), FormulaSettings(), 10
        ),
        "image": ServedModel("image", RecordingAdapter("image", threads), ImageSettings(), 10),
    }
    try:
        for served in models.values():
            await served.start(runtime.compute_thread)
            assert served.ready, served.error
        for served in models.values():
            await served.batcher.submit("x", bucket=0, timeout_s=10)
    finally:
        for served in models.values():
            if served.batcher is not None:
                await served.batcher.drain(5)
        for executor in runtime.compute_threads.values():
            executor.shutdown()
    steps = [step for step, _ in threads]
    assert steps[:2] == ["formula.load", "formula.warmup"] and "image.run" in steps
    assert {ident for _, ident in threads} == {next(iter(threads))[1]}
    assert threading.get_ident() not in {ident for _, ident in threads}


def test_a_gpu_compute_thread_makes_its_gpu_current(monkeypatch):
    """A worker for cuda:1 must not capture graphs or open streams on cuda:0, every
    thread's starting device (no GPU on CI: set_device is recorded, not called)."""
    current: list[tuple[torch.device, int]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: current.append((d, threading.get_ident()))
    )
    runtime = Runtime(Settings())
    gpu1 = torch.device("cuda", 1)
    thread = runtime.compute_thread("formula", gpu1)
    ident = thread.submit(threading.get_ident).result()
    cpu_ident = (
        runtime.compute_thread("formula", torch.device("cpu")).submit(threading.get_ident).result()
    )
    assert current == [(gpu1, ident)]
    assert cpu_ident != ident
    for pool in runtime.compute_threads.values():
        pool.shutdown()
