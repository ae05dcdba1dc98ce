"""The runtime behind the routes: each served model with its batcher, and the request flows.

A request flows through named stages: `http.parse` (in the route), `preprocess`
and `tokenize` on a thread pool, `queue.wait` and `generate` in the batcher,
`postprocess` on the pool again. Every stage is timed by `RequestTrace`.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import gc
import io
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from opentelemetry.trace import Link

from app.errors import not_ready
from app.settings import ModelSettings, Settings
from batching import (
    Batcher,
    BatchPolicy,
    BatchResult,
    ComputeThread,
    ProcessRunner,
    Worker,
    exit_with_parent,
)
from models.devices import make_current, resolve_devices
from telemetry import BatchTelemetry, RequestTrace, metrics
from telemetry.bottleneck import BottleneckSampler, watch_event_loop, watch_garbage_collector
from telemetry.resources import (
    add_allocator_source,
    allocator_bytes,
    remove_allocator_source,
    usable_cores,
)

if TYPE_CHECKING:
    from app.http_processes import HttpProcesses

log = logging.getLogger(__name__)


class ServedModel:
    """One adapter, its per-device workers and its batcher."""

    def __init__(
        self,
        key: str,
        adapter: Any,
        settings: ModelSettings,
        timeout_s: float,
        worker_processes: bool = False,
    ) -> None:
        self.key = key
        self.adapter = adapter
        self.settings = settings
        # Batches run in one child process per device (adapters with `worker_factory`).
        self.worker_processes = worker_processes and hasattr(adapter, "worker_factory")
        self.runners: list[ProcessRunner] = []
        self.worker_infos: dict[str, dict] = {}
        self.timeout_s = timeout_s
        self.state = "loading"
        self.error: str | None = None
        self.batcher: Batcher | None = None

    @property
    def name(self) -> str:
        return self.adapter.name

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def start(self, executor_for) -> None:
        """Load and warm up on the devices' worker threads, then start batching.

        `executor_for(key, device)` gives the single thread that runs this model's
        batches on `device`. Loading runs on the first device's thread too: on a CPU,
        torch's OpenMP team belongs to the first thread that computes, and loading
        computes (fp16 weights become fp32); serving from another thread then ran
        at half speed.
        """
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        workers = []
        try:
            first = executor_for(self.key, self.adapter.devices[0])
            load = self.adapter.load
            if self.worker_processes:  # the weights load in the worker processes instead
                load = functools.partial(self.adapter.load, weights=False)
            await loop.run_in_executor(first, load)
            for device in self.adapter.devices:
                executor = executor_for(self.key, device)
                runner = await self._runner(device, executor)
                # Continuous batching where the runner (or its worker process) streams.
                stream = getattr(runner, "stream", None)
                workers.append(Worker(str(device), runner, executor, stream=stream))
        except Exception as exc:
            self.state = "failed"
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("could not load the %s model from %s", self.key, self.settings.model)
            return
        policy = BatchPolicy(
            max_batch_size=self.settings.max_batch_size,
            max_wait_s=self.settings.max_wait_ms / 1000,
            max_queue=self.settings.max_queue,
            merge_buckets=self.adapter.merge_buckets,
        )
        observer = BatchTelemetry(
            self.name, self.adapter.operation, padding_efficiency=self.adapter.padding_efficiency
        )
        self.batcher = Batcher(self.key, workers, policy, observer=observer)
        self.batcher.start()
        self.state = "ready"
        metrics.MODEL_READY.labels(self.name).set(1)
        log.info(
            "%s model %s ready on %s in %.1f s",
            self.key,
            self.name,
            ", ".join(w.name for w in workers),
            time.perf_counter() - started,
        )

    async def _runner(self, device, executor):
        """Warm `device` up and return what runs its batches: the adapter's runner on
        the device's thread, or a worker process that loads and warms up on its own."""
        loop = asyncio.get_running_loop()
        max_batch = self.settings.max_batch_size
        if not self.worker_processes:
            await loop.run_in_executor(executor, self.adapter.warmup, device, max_batch)
            return self.adapter.runner(device)
        runner = ProcessRunner(
            self.adapter.worker_factory(device, max_batch),
            name=f"texel-{self.key}-{device}",
            report=functools.partial(allocator_bytes, device),
        )
        if not self.runners:
            add_allocator_source(self.worker_memory)
        self.runners.append(runner)
        info = await loop.run_in_executor(executor, runner.start)
        self.adapter.attach_worker(device, info)
        self.worker_infos[str(device)] = info
        log.info("%s worker for %s runs in process %s", self.key, device, runner.pid)
        return runner

    def request_infos(self) -> list[tuple[Any, dict]]:
        """[(device, info)] for `adapter.attach_worker` in another process that handles
        this model's requests (its tokenizer settings, defaults, decoder): what each
        worker process reported, or what the adapter here says."""
        return [
            (device, self.worker_infos.get(str(device)) or self.adapter.worker_info(device))
            for device in self.adapter.devices
        ]

    def worker_memory(self) -> dict[str, tuple[int, int]]:
        """GPU memory of the worker processes' torch allocators, {device: (allocated,
        reserved)}, as each reported it after its last batch."""
        readings: dict[str, tuple[int, int]] = {}
        for runner in self.runners:
            readings.update(runner.reported or {})
        return readings

    def close(self) -> None:
        remove_allocator_source(self.worker_memory)
        for runner in self.runners:
            runner.close()

    async def enqueue(self, payload: Any, context: Any = None) -> BatchResult:
        """Hand a preprocessed payload to the batcher and wait for its result."""
        if self.batcher is None:
            raise not_ready(f"the {self.key} model is not serving yet")
        return await self.batcher.submit(
            payload,
            bucket=self.adapter.bucket(payload),
            cost=self.adapter.cost(payload),
            timeout_s=self.timeout_s,
            context=context,
        )

    async def submit(self, trace: RequestTrace, payload: Any) -> BatchResult:
        """Queue a preprocessed payload; record `queue.wait` and `generate` spans."""
        submitted_ns = time.time_ns()
        result = await self.enqueue(payload, trace.span_context)
        bucket = str(self.adapter.bucket(payload))
        trace.record("queue.wait", submitted_ns, result.queue_wait_s, **{"texel.bucket": bucket})
        links = [Link(result.batch_ref)] if result.batch_ref is not None else None
        trace.record(
            "generate",
            submitted_ns + int(result.queue_wait_s * 1e9),
            result.run_s,
            links=links,
            **{
                "texel.batch.size": result.batch_size,
                "texel.bucket": bucket,
                "texel.device": result.worker,
            },
        )
        return result


@dataclass
class Runtime:
    """Everything the app holds between requests; built and torn down by the lifespan."""

    settings: Settings
    models: dict[str, ServedModel] = field(default_factory=dict)
    pool: ThreadPoolExecutor | None = None
    processes: ProcessPoolExecutor | None = None
    draining: bool = False
    loader: asyncio.Task | None = None
    loop_watch: asyncio.Task | None = None
    bottleneck: BottleneckSampler = field(default_factory=BottleneckSampler)
    compute_threads: dict[str, ThreadPoolExecutor] = field(default_factory=dict)
    # The other HTTP processes on the port, when there are any.
    http_processes: HttpProcesses | None = None

    @property
    def ready(self) -> bool:
        # With several HTTP processes, not before every one has started once: clients
        # that connect earlier keep their connections on the processes already up.
        return (
            bool(self.models)
            and not self.draining
            and all(m.ready for m in self.models.values())
            and (self.http_processes is None or self.http_processes.settled)
        )

    def model_label(self, key: str) -> str:
        """The `model` label of a task's metrics: the served model's name."""
        served = self.models.get(key)
        return served.name if served is not None else key

    async def readiness(self) -> tuple[bool, bool, dict[str, str]]:
        """(ready, draining, {model: state}) for /readyz."""
        states = {key: model.state for key, model in self.models.items()}
        return self.ready, self.draining, states

    async def metrics_exposition(self, accept: str | None) -> tuple[bytes, str]:
        """/metrics: this process's registry plus the other HTTP processes' samples."""
        others = await self.http_processes.snapshots() if self.http_processes is not None else []
        return metrics.exposition(accept, others)

    async def diagnose(self, window_s: float) -> dict:
        return (await self.bottleneck.diagnose(window_s)).as_dict()

    async def run_in_pool(self, fn, *args):
        assert self.pool is not None
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def preprocess(self, adapter, data: bytes):
        """`adapter.preprocess(data)` on the thread pool; or, with preprocessing processes,
        the adapter's picklable `preprocessor` in one of them, where decoding images does
        not hold the interpreter lock that the event loop and the GPU workers need."""
        if self.processes is not None and hasattr(adapter, "preprocessor"):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.processes, adapter.preprocessor, data)
        return await self.run_in_pool(adapter.preprocess, data)

    def _start_process(self, default_threads) -> tuple[list, ProcessPlan]:
        """What every HTTP process does first: watch its event loop, set its switch
        interval and start its preprocessing threads (`default_threads(cores)` of them
        unless set). Returns the devices and the plan."""
        self.loop_watch = asyncio.get_running_loop().create_task(watch_event_loop())
        watch_garbage_collector()
        devices = resolve_devices(self.settings.device)
        cores = usable_cores()
        plan = process_plan(self.settings, devices, cores)
        if plan.switch_interval_ms is not None:
            sys.setswitchinterval(plan.switch_interval_ms / 1000)
        threads = self.settings.preprocess_threads or default_threads(cores)
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="texel-preprocess")
        return devices, plan

    async def start(self) -> None:
        devices, plan = self._start_process(lambda cores: cores)
        if count := plan.preprocess_processes:
            # spawn: forking a process that may already hold CUDA state is unsafe
            context = multiprocessing.get_context("spawn")
            self.processes = ProcessPoolExecutor(
                max_workers=count,
                mp_context=context,
                initializer=exit_with_parent,
                initargs=(os.getpid(),),
            )
            for _ in range(count):  # start them now, not on the first requests
                self.processes.submit(os.getpid)
        self.models = build_models(self.settings, devices, plan.worker_processes)
        # Load in the background: /livez answers at once and /readyz reports progress.
        self.loader = asyncio.get_running_loop().create_task(self._load_all())
        metrics.HTTP_PROCESSES.set(1)  # each of the others adds itself once it accepts
        if self.http_processes is not None:
            await self.http_processes.start(self)
            self.bottleneck.others = self.http_processes.snapshots

    def compute_thread(self, model: str, device) -> ThreadPoolExecutor:
        """The thread that runs batches of `model` on `device`.

        A CPU gets one thread for every model: torch's OpenMP teams, one per
        computing thread, would otherwise spin against each other on the same
        cores. A GPU gets one per model, so a long image batch does not hold up
        formulas queued for the same card.
        """
        key = str(device) if device.type == "cpu" else f"{model}-{device}"
        if key not in self.compute_threads:
            self.compute_threads[key] = ComputeThread(
                thread_name_prefix=f"texel-compute-{key}",
                initializer=make_current,
                initargs=(device,),
            )
        return self.compute_threads[key]

    async def _load_all(self) -> None:
        for model in self.models.values():
            await model.start(self.compute_thread)
        if self.settings.gc_freeze:
            freeze_heap()

    async def drain(self) -> None:
        """Stop taking requests and finish every queued and running one."""
        self.draining = True
        timeout = self.settings.drain_timeout_s
        deadline = time.monotonic() + timeout
        if self.http_processes is not None:  # they finish their requests through the batchers
            await self.http_processes.stop(timeout)
        remaining = max(0.0, deadline - time.monotonic())
        batchers = [m.batcher for m in self.models.values() if m.batcher is not None]
        await asyncio.gather(*(b.drain(remaining) for b in batchers))

    async def close(self) -> None:
        self.draining = True
        if self.loader is not None and not self.loader.done():
            self.loader.cancel()
        if self.loop_watch is not None:
            self.loop_watch.cancel()
        if self.http_processes is not None:
            await self.http_processes.stop(0)
        for model in self.models.values():
            if model.batcher is not None:
                await model.batcher.close()
            await asyncio.to_thread(model.close)
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.processes is not None:
            self.processes.shutdown(wait=False, cancel_futures=True)
        for executor in self.compute_threads.values():
            executor.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class ProcessPlan:
    """How the serving process spreads its work over processes and threads."""

    preprocess_processes: int
    switch_interval_ms: float | None  # None: Python's default
    worker_processes: bool
    http_processes: int = 1


def freeze_heap() -> None:
    """Put every object alive now (modules, models, tokenizers) out of the cyclic garbage
    collector's reach: its full collections then scan only what requests allocate since,
    not the hundreds of thousands of objects torch and transformers bring, and pause every
    thread of the process for that much less."""
    gc.collect()
    gc.freeze()
    metrics.GC_FROZEN.set(gc.get_freeze_count())


def process_plan(settings: Settings, devices, cores: int) -> ProcessPlan:
    """Unset settings follow the devices.

    On a GPU the serving process's interpreter lock is the bottleneck (measured on an
    H200, README: Benchmarks): batches run in a worker process per device, HTTP is
    answered by several processes on the same port (each decoding its own images), and
    the switch interval drops to 0.5 ms, so a thread that waited on the GPU or a pipe
    gets the lock back within 0.5 ms instead of 5. With a single HTTP process, image
    decoding moves to preprocessing processes instead (4 beside worker processes served
    more than 8: they leave cores to the workers). On a CPU the model computes in torch
    without the lock, and everything stays in one process, as Python has it.
    """
    on_gpu = any(device.type == "cuda" for device in devices)
    workers = settings.worker_processes
    if workers is None:
        workers = on_gpu
    http = settings.http_processes
    if http is None:
        http = max(1, min(4, cores // 4)) if on_gpu else 1
    count = settings.preprocess_processes
    if count is None:
        share = min(4, cores // 4) if workers else min(8, cores // 2)
        count = share if on_gpu and settings.formula.enabled and http == 1 else 0
    interval_ms = settings.switch_interval_ms or (0.5 if on_gpu else None)
    return ProcessPlan(count, interval_ms, workers, http)


def build_models(
    settings: Settings, devices, worker_processes: bool, served_class=None
) -> dict[str, ServedModel]:
    """One `served_class` (default `ServedModel`) per enabled model, not yet loaded."""
    # Each model family imports its libraries only when enabled: a formula-only
    # replica never imports diffusers.
    served_class = served_class or ServedModel
    served: dict[str, ServedModel] = {}
    if settings.formula.enabled:
        from models.formula.adapter import FormulaRecognizer

        f = settings.formula
        adapter = FormulaRecognizer(
            f.model,
            devices,
            name=f.name,
            dtype=settings.dtype,
            bucket_step=f.bucket_width,
            num_beams=f.num_beams,
            max_new_tokens=f.max_new_tokens,
            max_pixels=settings.max_image_pixels,
            decoder=f.decoder,
            continuous=f.continuous,
        )
        served["formula"] = served_class(
            "formula",
            adapter,
            f,
            settings.request_timeout_s,
            worker_processes=worker_processes,
        )
    if settings.image.enabled:
        from models.image.adapter import ImageGenerator

        i = settings.image
        adapter = ImageGenerator(
            i.model,
            devices,
            name=i.name,
            dtype=settings.dtype,
            max_steps=i.max_steps,
            max_side=i.max_side,
            compile=i.compile,
        )
        served["image"] = served_class(
            "image",
            adapter,
            i,
            settings.request_timeout_s,
            worker_processes=worker_processes,
        )
    return served


# -- request flows ---------------------------------------------------------------


async def recognize(runtime: Runtime, served: ServedModel, trace: RequestTrace, data: bytes):
    adapter = served.adapter
    with trace.stage("preprocess", **{"texel.input.bytes": len(data)}) as span:
        item = await runtime.preprocess(adapter, data)
        span.set_attribute("texel.input.width", item.width)
        span.set_attribute("texel.bucket", item.bucket)
    result = await served.submit(trace, item)
    with trace.stage("tokenize") as span:
        latex = adapter.detokenize(result.value)
        tokens = len(result.value.token_ids)
        span.set_attribute("gen_ai.usage.output_tokens", tokens)
    with trace.stage("postprocess"):
        from models.formula.adapter import compact_latex

        compact = compact_latex(latex)
    metrics.OUTPUT_TOKENS.labels(served.name).observe(tokens)
    metrics.TIME_PER_OUTPUT_TOKEN.labels(served.name).observe(result.value.decode_s)
    return latex, compact, result


async def generate(runtime: Runtime, served: ServedModel, trace: RequestTrace, request):
    adapter = served.adapter
    with trace.stage("preprocess") as span:
        job = adapter.preprocess(request)
        span.set_attribute("texel.image.width", job.width)
        span.set_attribute("texel.image.height", job.height)
        span.set_attribute("texel.steps", job.steps)
    with trace.stage("tokenize") as span:
        job = await runtime.run_in_pool(adapter.tokenize, job)
        span.set_attribute("gen_ai.usage.input_tokens", job.prompt_tokens)
    result = await served.submit(trace, job)
    with trace.stage("postprocess", **{"texel.images": len(job.seeds)}):
        level = served.settings.png_compress_level
        pngs = await runtime.run_in_pool(_encode_pngs, result.value.images, level)
    for step_s in result.value.step_s:
        metrics.DENOISING_STEP.labels(served.name).observe(step_s)
    metrics.IMAGES_GENERATED.labels(served.name).inc(len(pngs))
    return pngs, result.value.seeds, result


def _encode_pngs(images, compress_level: int) -> list[bytes]:
    out = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=compress_level)
        out.append(buffer.getvalue())
    return out


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
