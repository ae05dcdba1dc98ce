"""A small HTTP load generator: closed-loop concurrency or open-loop Poisson arrivals.

Works against any endpoint: a `Workload` says how to build the i-th request. The clients
are aiohttp's: they share a machine with the server in most benchmarks, so what they cost
it matters (`python -m bench.client_cost` measures it; bench/RESULTS.md has the figures).
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=120)
# Named in every record: before it, httpx clients left less CPU to a server on the same
# machine (bench/RESULTS.md, thirteenth session).
CLIENT = f"aiohttp {aiohttp.__version__}"


@dataclass
class Workload:
    """Builds request i as keyword arguments: `json` (a body to send as JSON) or `files`
    (multipart fields, `{name: (filename, bytes, content type)}`)."""

    method: str
    path: str
    build: Callable[[int], dict]


def _request_kwargs(built: dict) -> dict:
    """aiohttp's keyword arguments for a `Workload`'s request."""
    if "files" not in built:
        return built
    form = aiohttp.FormData()
    for name, (filename, data, content_type) in built["files"].items():
        form.add_field(name, data, filename=filename, content_type=content_type)
    return {key: value for key, value in built.items() if key != "files"} | {"data": form}


def _client(url: str) -> aiohttp.ClientSession:
    """One client with one kept-alive connection of its own, as a browser tab has."""
    return aiohttp.ClientSession(
        base_url=url, timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=1)
    )


@dataclass
class LoadResult:
    mode: str
    level: float  # concurrency, or offered rate for open loop
    duration_s: float
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    batch_sizes: list[int] = field(default_factory=list)
    # Open loop: how late each request left the client after its arrival time (its
    # latency counts from the arrival, so a client falling behind shows here first).
    late_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)

    @property
    def errors(self) -> dict[str, int]:
        return {str(k): v for k, v in self.statuses.items() if k != 200}

    @property
    def throughput_rps(self) -> float:
        return self.ok / self.duration_s if self.duration_s else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_s:
            return float("nan")
        ordered = sorted(self.latencies_s)
        index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))
        return ordered[index] * 1000

    def summary(self) -> dict:
        return {
            "client": CLIENT,
            "mode": self.mode,
            "concurrency" if self.mode == "closed" else "rate_rps": self.level,
            "requests": sum(self.statuses.values()),
            "throughput_rps": round(self.throughput_rps, 2),
            "mean_ms": round(1000 * statistics.fmean(self.latencies_s), 1)
            if self.latencies_s
            else None,
            "p50_ms": round(self.percentile_ms(50), 1),
            "p95_ms": round(self.percentile_ms(95), 1),
            "p99_ms": round(self.percentile_ms(99), 1),
            "errors": self.errors,
            "mean_batch_size": round(statistics.fmean(self.batch_sizes), 2)
            if self.batch_sizes
            else None,
            **(
                {"client_late_p99_ms": round(1000 * _quantile(self.late_s, 0.99), 2)}
                if self.late_s
                else {}
            ),
        }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


async def _one(
    client: aiohttp.ClientSession,
    workload: Workload,
    i: int,
    result: LoadResult,
    since: float | None = None,
) -> None:
    """Request i; its latency counts from `since` (an open loop's arrival time) or now."""
    started = time.perf_counter() if since is None else since
    try:
        kwargs = _request_kwargs(workload.build(i))
        async with client.request(workload.method, workload.path, **kwargs) as response:
            status = response.status
            body = await response.read()
            json_body = response.content_type == "application/json"
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.statuses[type(exc).__name__] += 1
        return
    result.statuses[status] += 1
    if status == 200:
        result.latencies_s.append(time.perf_counter() - started)
        if json_body:
            size = json.loads(body).get("batch_size")
            if size:
                result.batch_sizes.append(int(size))


async def closed_loop(
    url: str, workload: Workload, concurrency: int, duration_s: float, warmup_s: float = 2.0
) -> LoadResult:
    """`concurrency` clients each send a request as soon as their previous one returns.

    Each client has an HTTP client and a kept-alive connection of its own, as each
    browser does (with httpx, one pool shared by all clients cost more CPU per request
    the more connections it held: bench/HISTORY.md).
    """
    clients = [_client(url) for _ in range(concurrency)]
    try:
        counter = iter(range(10**9))
        warm = LoadResult("closed", concurrency, warmup_s)

        async def client_loop(client: aiohttp.ClientSession, result: LoadResult, until: float):
            while time.perf_counter() < until:
                await _one(client, workload, next(counter), result)

        until = time.perf_counter() + warmup_s
        await asyncio.gather(*(client_loop(c, warm, until) for c in clients))
        result = LoadResult("closed", concurrency, duration_s)
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(c, result, started + duration_s) for c in clients))
        result.duration_s = time.perf_counter() - started
        return result
    finally:
        await asyncio.gather(*(client.close() for client in clients))


def closed_loop_processes(
    url: str,
    workload: Workload,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 2.0,
    processes: int = 1,
) -> LoadResult:
    """`closed_loop` split over several client processes, for loads one Python client
    cannot generate; latencies and statuses are pooled."""
    processes = max(1, min(processes, concurrency))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    parts = _in_processes(
        [
            lambda share=share: closed_loop(url, workload, share, duration_s, warmup_s)
            for share in shares
        ],
        timeout_s=duration_s + warmup_s + 300,
    )
    return _pooled(parts, "closed", concurrency)


def _in_processes(loads: list[Callable], timeout_s: float) -> list[LoadResult]:
    """Each of `loads` (a coroutine function) run to its end in a client process of its
    own, or here when there is one."""
    if len(loads) == 1:
        return [asyncio.run(loads[0]())]
    context = multiprocessing.get_context("fork")  # the workload's closures are not picklable
    results = context.Queue()
    children = [
        context.Process(target=lambda load=load: results.put(asyncio.run(load()))) for load in loads
    ]
    for child in children:
        child.start()
    parts = [results.get(timeout=timeout_s) for _ in children]
    for child in children:
        child.join()
    return parts


def _pooled(parts: list[LoadResult], mode: str, level: float) -> LoadResult:
    if len(parts) == 1:
        return parts[0]
    pooled = LoadResult(mode, level, max(part.duration_s for part in parts))
    for part in parts:
        pooled.latencies_s += part.latencies_s
        pooled.statuses.update(part.statuses)
        pooled.batch_sizes += part.batch_sizes
        pooled.late_s += part.late_s
    return pooled


async def open_loop(
    url: str,
    workload: Workload,
    rate_rps: float,
    duration_s: float,
    warmup_s: float = 0.0,
    seed: int = 0,
) -> LoadResult:
    """Requests arrive as a Poisson process at `rate_rps`, whatever the server's pace:
    `warmup_s` of arrivals first (not recorded: connections opened, the server at this
    pace), then `duration_s` recorded. A request's latency counts from its arrival
    time, so a client that falls behind its schedule cannot hide the wait
    (`late_s`).

    Each request borrows an idle HTTP client with one kept-alive connection, or opens
    one more, for the same reason as in `closed_loop`.
    """
    rng = random.Random(seed)
    idle: list[aiohttp.ClientSession] = []
    opened: list[aiohttp.ClientSession] = []

    async def one(i: int, due: float, result: LoadResult) -> None:
        if not idle:
            opened.append(_client(url))
            idle.append(opened[-1])
        client = idle.pop()
        result.late_s.append(time.perf_counter() - due)
        try:
            await _one(client, workload, i, result, since=due)
        finally:
            idle.append(client)

    async def arrivals(result: LoadResult, first: int) -> int:
        tasks = []
        started = time.perf_counter()
        due = started
        while due < started + result.duration_s:
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(first + len(tasks), due, result)))
            due += rng.expovariate(rate_rps)
        await asyncio.gather(*tasks)
        result.duration_s = time.perf_counter() - started
        return first + len(tasks)

    try:
        sent = await arrivals(LoadResult("open", rate_rps, warmup_s), 0) if warmup_s else 0
        result = LoadResult("open", rate_rps, duration_s)
        await arrivals(result, sent)
    finally:
        await asyncio.gather(*(client.close() for client in opened))
    return result


def open_loop_processes(
    url: str,
    workload: Workload,
    rate_rps: float,
    duration_s: float,
    warmup_s: float = 0.0,
    processes: int = 1,
) -> LoadResult:
    """`open_loop` split over several client processes, each with an equal share of the
    rate (Poisson processes added together are one at the summed rate) and its own
    seed; latencies and statuses are pooled."""
    processes = max(1, processes)
    share = rate_rps / processes
    parts = _in_processes(
        [
            lambda seed=seed: open_loop(url, workload, share, duration_s, warmup_s, seed)
            for seed in range(processes)
        ],
        timeout_s=duration_s + warmup_s + 300,
    )
    return _pooled(parts, "open", rate_rps)
