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
        }


async def _one(
    client: aiohttp.ClientSession, workload: Workload, i: int, result: LoadResult
) -> None:
    started = time.perf_counter()
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
    if processes == 1:
        return asyncio.run(closed_loop(url, workload, concurrency, duration_s, warmup_s))
    context = multiprocessing.get_context("fork")  # the workload's closures are not picklable
    results = context.Queue()
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    children = [
        context.Process(
            target=lambda share=share: results.put(
                asyncio.run(closed_loop(url, workload, share, duration_s, warmup_s))
            )
        )
        for share in shares
    ]
    for child in children:
        child.start()
    parts = [results.get(timeout=duration_s + warmup_s + 300) for _ in children]
    for child in children:
        child.join()
    pooled = LoadResult("closed", concurrency, max(part.duration_s for part in parts))
    for part in parts:
        pooled.latencies_s += part.latencies_s
        pooled.statuses.update(part.statuses)
        pooled.batch_sizes += part.batch_sizes
    return pooled


async def open_loop(
    url: str, workload: Workload, rate_rps: float, duration_s: float, seed: int = 0
) -> LoadResult:
    """Requests arrive as a Poisson process at `rate_rps`, whatever the server's pace.

    Each request borrows an idle HTTP client with one kept-alive connection, or opens
    one more, for the same reason as in `closed_loop`.
    """
    rng = random.Random(seed)
    result = LoadResult("open", rate_rps, duration_s)
    idle: list[aiohttp.ClientSession] = []
    opened: list[aiohttp.ClientSession] = []

    async def one(i: int) -> None:
        if not idle:
            opened.append(_client(url))
            idle.append(opened[-1])
        client = idle.pop()
        try:
            await _one(client, workload, i, result)
        finally:
            idle.append(client)

    try:
        tasks = []
        started = time.perf_counter()
        next_at = started
        i = 0
        while next_at < started + duration_s:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            next_at += rng.expovariate(rate_rps)
        await asyncio.gather(*tasks)
        result.duration_s = time.perf_counter() - started
    finally:
        await asyncio.gather(*(client.close() for client in opened))
    return result
