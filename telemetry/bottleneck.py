"""Bottleneck diagnosis: which of the four quadrants is this server in?

Over a window it samples the CPU of every process of the server, the launcher's engine
and HTTP processes (all cores, and the busiest thread, which catches a saturated
event loop or GIL), how long their threads waited for a core (Linux's run-queue wait:
CPU the server wanted and did not get, taken by other programs or by more threads than
cores), how late the event loop ran its timers
(which catches threads contending for the GIL, where no one thread is busy), GPU
utilization, and how the time spent in request stages splits between them; then
names the quadrant:

    cpu_bound   high CPU, low GPU: pre/post-processing or Python overhead
    gpu_bound   high GPU, low CPU: the model itself; batch bigger or faster kernels
    starved     both low: too little load, or waiting on the network or disk
    saturated   both high: the machine is full; add replicas
"""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import psutil
from prometheus_client import Metric

from telemetry import metrics
from telemetry.resources import Nvml, usable_cores

HIGH_CPU = 0.6  # share of all cores
HIGH_THREAD = 0.85  # share of one core: a single hot thread (event loop, GIL)
HIGH_GPU = 0.6
HIGH_LOOP_LAG_S = 0.02  # mean lateness of the event loop's timers
HIGH_CPU_WAIT = 0.1  # share of all cores' time the server's threads waited for a core
LOOP_LAG_INTERVAL_S = 0.1


async def watch_event_loop(interval_s: float = LOOP_LAG_INTERVAL_S) -> None:
    """Run for the server's life: observe how late each `interval_s` timer fires."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        metrics.EVENT_LOOP_LAG.observe(max(0.0, loop.time() - due))
        record_collections()


def watch_garbage_collector() -> None:
    """Time every collection of Python's cyclic garbage collector in this process (once)."""
    if _time_collection in gc.callbacks:
        return
    gc.callbacks.append(_time_collection)


_collection_started: list[float] = []
# (generation, seconds) of collections not yet in the histogram. The callback must not
# touch a metric itself: a collection can start inside a metric's update, and in
# multiprocess mode every metric shares one lock that is not reentrant.
_collections: collections.deque[tuple[str, float]] = collections.deque(maxlen=10_000)


def _time_collection(phase: str, info: dict) -> None:
    # Collections never nest: the collector holds the interpreter lock from start to stop.
    if phase == "start":
        _collection_started[:] = [time.perf_counter()]
    elif _collection_started:
        elapsed = time.perf_counter() - _collection_started.pop()
        _collections.append((str(info.get("generation", "")), elapsed))


def record_collections() -> None:
    """Move the collections timed since the last call into the pause histogram."""
    while _collections:
        generation, seconds = _collections.popleft()
        metrics.GC_PAUSE.labels(generation).observe(seconds)


def loop_lag_totals(families: Iterable[Metric] | None = None) -> tuple[float, float]:
    """(sum of lag seconds, number of samples) of the event-loop lag histogram so far,
    over every process of the server (or in `families`)."""
    total = count = 0.0
    for family in metrics.families(resources=False) if families is None else families:
        if family.name != "texel_event_loop_lag_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                total += sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
    return total, count


@dataclass(frozen=True)
class Sample:
    cpu_utilization: float
    busiest_thread_utilization: float
    gpu_utilization: float | None  # None: no GPU on this machine
    stage_seconds: dict[str, float]
    window_s: float
    event_loop_lag_s: float | None = None  # mean over the window; None: not measured
    # Time the server's threads were ready to run but waited for a core, as a share of
    # all cores' time (so it adds to cpu_utilization); None: not measured (not Linux).
    cpu_wait: float | None = None


@dataclass(frozen=True)
class Verdict:
    quadrant: str
    explanation: str
    dominant_stage: str | None
    cpu_utilization: float
    busiest_thread_utilization: float
    gpu_utilization: float | None
    stage_shares: dict[str, float] = field(default_factory=dict)
    window_s: float = 0.0
    event_loop_lag_s: float | None = None
    cpu_wait: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def classify(sample: Sample) -> Verdict:
    """The four-quadrant verdict for one window of measurements."""
    total = sum(sample.stage_seconds.values())
    shares = {k: round(v / total, 4) for k, v in sample.stage_seconds.items()} if total else {}
    dominant = max(shares, key=shares.get) if shares else None
    lag = sample.event_loop_lag_s
    loop_late = lag is not None and lag >= HIGH_LOOP_LAG_S
    wait = sample.cpu_wait or 0.0
    # What the server asked of the CPU is what it got plus what it waited for: a server
    # that a neighbour keeps off the cores is held back by the CPU all the same.
    cores_short = wait >= HIGH_CPU_WAIT
    cpu_high = (
        sample.cpu_utilization + wait >= HIGH_CPU
        or sample.busiest_thread_utilization >= HIGH_THREAD
        or loop_late
    )
    gpu = sample.gpu_utilization
    gpu_high = gpu is not None and gpu >= HIGH_GPU
    if cpu_high and gpu_high:
        quadrant, why = "saturated", "CPU and GPU are both busy: add GPUs or replicas"
    elif gpu_high:
        quadrant, why = "gpu_bound", "the GPU is busy and the CPU is not: the model limits speed"
    elif cpu_high:
        quadrant = "cpu_bound"
        why = (
            "the CPU is busy and the GPU idles: move decode/resize off the event loop or onto "
            "the GPU, or add CPU"
            if gpu is not None
            else "the CPU is busy; there is no GPU, so the model computes on the CPU too"
        )
    else:
        quadrant = "starved"
        why = "CPU and GPU both idle: too little load, or time goes to waiting (network, disk)"
    if cores_short:
        why += (
            f"; its threads waited for a core {wait:.0%} of all cores' time: other programs "
            "on this machine, or more busy threads than cores, take the CPU it wants"
        )
    if loop_late:
        why += (
            f"; the event loop runs {lag * 1000:.0f} ms late: it, or threads holding the GIL, "
            "keep requests waiting (more TEXEL_HTTP_PROCESSES, fewer "
            "TEXEL_ADVANCED__PREPROCESS_THREADS, lower trace sampling)"
        )
    if dominant:
        why += f"; most request time is in '{dominant}' ({shares[dominant]:.0%})"
    return Verdict(
        quadrant=quadrant,
        explanation=why,
        dominant_stage=dominant,
        cpu_utilization=round(sample.cpu_utilization, 4),
        busiest_thread_utilization=round(sample.busiest_thread_utilization, 4),
        gpu_utilization=None if gpu is None else round(gpu, 4),
        stage_shares=shares,
        window_s=sample.window_s,
        event_loop_lag_s=None if lag is None else round(lag, 4),
        cpu_wait=None if sample.cpu_wait is None else round(sample.cpu_wait, 4),
    )


def stage_totals(families: Iterable[Metric] | None = None) -> dict[str, float]:
    """Seconds spent so far in each stage, summed over models and over every process of
    the server (or in `families`)."""
    totals: dict[str, float] = {}
    for family in metrics.families(resources=False) if families is None else families:
        if family.name != "texel_stage_duration_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_sum"):
                stage = sample.labels["stage"]
                totals[stage] = totals.get(stage, 0.0) + sample.value
    return totals


def _family(process: psutil.Process) -> list[psutil.Process]:
    """A process and its live descendants: with a launcher, every process of the server."""
    return [process, *process.children(recursive=True)]


def _cpu_times(processes: list[psutil.Process]) -> dict[int, float]:
    """CPU seconds by process id, skipping any that exited meanwhile."""
    times = {}
    for process in processes:
        try:
            times[process.pid] = sum(process.cpu_times()[:2])
        except psutil.Error:
            continue
    return times


def _thread_times(processes: list[psutil.Process]) -> dict[tuple[int, int], float]:
    times = {}
    for process in processes:
        try:
            for t in process.threads():
                times[(process.pid, t.id)] = t.user_time + t.system_time
        except psutil.Error:
            continue
    return times


def _run_queue_wait(processes: list[psutil.Process]) -> dict[tuple[int, int], float] | None:
    """Seconds each thread has waited for a core while ready to run, from Linux's
    /proc/PID/task/TID/schedstat (run time, wait time, time slices; nanoseconds).
    None where the kernel does not keep it."""
    if not os.path.exists("/proc/self/schedstat"):
        return None
    times = {}
    for process in processes:
        try:
            tasks = os.listdir(f"/proc/{process.pid}/task")
        except OSError:  # exited meanwhile
            continue
        for task in tasks:
            try:
                with open(f"/proc/{process.pid}/task/{task}/schedstat") as stat:
                    times[(process.pid, int(task))] = int(stat.read().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):  # exited meanwhile
                continue
    return times


def _delta(after: dict, before: dict) -> dict:
    """Per key, what was spent between two readings (all of it for a key that is new)."""
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


class BottleneckSampler:
    """Samples a window of activity. `gpu_probe` returns mean GPU utilization or None."""

    def __init__(
        self,
        gpu_probe: Callable[[], float | None] | None = None,
        stages: Callable[[], dict[str, float]] = stage_totals,
        loop_lag: Callable[[], tuple[float, float]] = loop_lag_totals,
    ) -> None:
        self._nvml = Nvml() if gpu_probe is None else None
        self._gpu_probe = gpu_probe or self._nvml_probe
        self._stages = stages
        self._loop_lag = loop_lag
        # The server's root process: the launcher, when there is one.
        self._process = psutil.Process(int(os.environ.get("TEXEL_LAUNCHER_PID", os.getpid())))

    def _nvml_probe(self) -> float | None:
        readings = self._nvml.read() if self._nvml else []
        if not readings:
            return None
        return max(r.utilization for r in readings)

    async def sample(self, window_s: float = 10.0, interval_s: float = 0.25) -> Sample:
        cores = usable_cores()
        start = time.monotonic()
        family = _family(self._process)
        cpu0, threads0 = _cpu_times(family), _thread_times(family)
        wait0 = _run_queue_wait(family)
        stages0, lag0 = await self._totals()
        gpu_samples: list[float] = []
        while time.monotonic() - start < window_s:
            reading = self._gpu_probe()
            if reading is not None:
                gpu_samples.append(reading)
            await asyncio.sleep(min(interval_s, max(0.0, window_s - (time.monotonic() - start))))
        elapsed = max(time.monotonic() - start, 1e-6)
        family = _family(self._process)
        cpu1, threads1 = _cpu_times(family), _thread_times(family)
        wait1 = _run_queue_wait(family)
        stages1, lag1 = await self._totals()
        lag_count = lag1[1] - lag0[1]
        busiest = max(_delta(threads1, threads0).values(), default=0.0) / elapsed
        deltas = {k: v - stages0.get(k, 0.0) for k, v in stages1.items()}
        return Sample(
            cpu_utilization=min(1.0, sum(_delta(cpu1, cpu0).values()) / (elapsed * cores)),
            busiest_thread_utilization=min(1.0, busiest),
            gpu_utilization=sum(gpu_samples) / len(gpu_samples) if gpu_samples else None,
            stage_seconds={k: v for k, v in deltas.items() if v > 0},
            window_s=round(elapsed, 3),
            event_loop_lag_s=(lag1[0] - lag0[0]) / lag_count if lag_count else None,
            cpu_wait=(
                None
                if wait0 is None or wait1 is None
                else sum(_delta(wait1, wait0).values()) / (elapsed * cores)
            ),
        )

    async def _totals(self) -> tuple[dict[str, float], tuple[float, float]]:
        """Stage seconds and (lag seconds, lag samples) of every process so far."""
        return dict(self._stages()), self._loop_lag()

    async def diagnose(self, window_s: float = 10.0) -> Verdict:
        return classify(await self.sample(window_s))
