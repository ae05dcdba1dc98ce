"""Texel against its peers on one machine, same model, same client, same images.

    python -m bench.compare --concurrency 1,8,32,128,256 --duration 20

Servers, in one run: `texel` (as shipped, with `--max-batch-size`), `texel-nobatch`
(`MAX_BATCH_SIZE=1`), `litserve` (LitServe batching over Texel's own adapter),
`model-only` (preprocessed batches straight into the model, one after the other, no
server) and `engine-only` (Texel's own engine in this process, its continuous decoder
fed preprocessed inputs from memory by closed-loop callers at each concurrency, and by
Poisson arrivals at each of `--rates`, no HTTP: what the model can do on this device as
Texel batches it). Every HTTP server gets the
same JSON `image_base64` requests from the same closed-loop client. Records go to
`bench/results/<machine>.jsonl`, one per (server, concurrency), naming the GPU, the
command and the commit; a markdown table is printed last.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import append_records, commit, formula_images, machine, settings_env
from bench.connection_spread import by_role, cpu_seconds, held
from bench.load import LoadResult, Workload, closed_loop_processes, open_loop_processes
from bench.server import ROOT, ServerProcess, free_port


@functools.cache
def gpu_name() -> str:
    """The GPU Texel serves on: "NVIDIA H200", or "2x NVIDIA H200" when it sees two."""
    import torch

    if not torch.cuda.is_available():
        return f"no GPU ({machine()})"
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    return f"{count}x {name}" if count > 1 else name


def gpu_results_file() -> Path:
    """`bench/results/<gpu>.jsonl`: "NVIDIA H200" -> h200.jsonl; two of them -> h200-x2.jsonl."""
    count, name = re.fullmatch(r"(?:(\d+)x )?(.*)", gpu_name()).groups()
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    slug = slug.removeprefix("nvidia-")[:40]
    return ROOT / "bench" / "results" / (f"{slug}-x{count}.jsonl" if count else f"{slug}.jsonl")


def json_workload(path: str, images: list[bytes]) -> Workload:
    bodies = [{"image_base64": base64.b64encode(image).decode()} for image in images]
    return Workload("POST", path, lambda i: {"json": bodies[i % len(bodies)]})


def scrape(url: str) -> dict[str, float]:
    """Sums and counts of Texel's batch and stage histograms, and the stage and request
    latency buckets, to diff around a measurement."""
    wanted = (
        "texel_batch_size_sum",
        "texel_batch_size_count",
        "texel_padding_efficiency_sum",
        "texel_padding_efficiency_count",
        "texel_gpu_utilization_ratio",
        "texel_stage_duration_seconds_sum",
        "texel_stage_duration_seconds_count",
        "texel_request_duration_seconds_sum",
        "texel_request_duration_seconds_count",
        "texel_gc_pause_seconds_sum",
        "texel_gc_pause_seconds_count",
    )
    # Histograms whose quantiles are wanted, and the prefix of each one's buckets.
    buckets = {
        "texel_stage_duration_seconds_bucket": "stage",
        "texel_request_duration_seconds_bucket": "request",
        "texel_event_loop_lag_seconds_bucket": "event_loop_lag",
        "texel_gc_pause_seconds_bucket": "gc_pause",  # every generation together
    }
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in wanted and name not in buckets:
            continue
        if name in buckets:  # "stage:generate_le:0.1", "request_le:0.1"
            le = line.split('le="', 1)[1].split('"', 1)[0]
            prefix = buckets[name]
            if prefix == "stage":
                prefix = "stage:" + line.split('stage="', 1)[1].split('"', 1)[0]
            name = f"{prefix}_le:{le}"
        elif name.startswith("texel_stage_duration"):  # one series per stage
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            name = name.replace("texel_stage_duration_seconds", f"stage:{stage}")
        values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def texel_extras(before: dict[str, float], after: dict[str, float]) -> dict:
    def mean(metric: str) -> float | None:
        count = after.get(f"{metric}_count", 0) - before.get(f"{metric}_count", 0)
        total = after.get(f"{metric}_sum", 0) - before.get(f"{metric}_sum", 0)
        return total / count if count else None

    def rounded(value: float | None, scale: float = 1.0, digits: int = 3) -> float | None:
        return None if value is None else round(value * scale, digits)

    stages = sorted({k[6:-4] for k in after if k.startswith("stage:") and k.endswith("_sum")})
    stage_ms = {stage: rounded(mean(f"stage:{stage}"), 1000, 2) for stage in stages}
    request_ms = mean("texel_request_duration_seconds")
    if request_ms is not None:  # what the stages do not cover: HTTP, event-loop waits
        covered = sum(v for v in stage_ms.values() if v is not None)
        stage_ms["unaccounted"] = round(request_ms * 1000 - covered, 2)
    # Where the tail is: each stage's p99, and the server's own p99 of whole requests
    # (against the client's, what the network and the client add).
    p99_ms = {
        prefix.removeprefix("stage:"): rounded(quantile(0.99, prefix, before, after), 1000, 1)
        for prefix in [f"stage:{stage}" for stage in stages] + ["request"]
    }
    gc_count = after.get("texel_gc_pause_seconds_count", 0) - before.get(
        "texel_gc_pause_seconds_count", 0
    )
    return {
        "server_mean_batch_size": rounded(mean("texel_batch_size")),
        "padding_efficiency": rounded(mean("texel_padding_efficiency")),
        "gpu_utilization_end": after.get("texel_gpu_utilization_ratio"),
        "stage_mean_ms": stage_ms,
        "stage_p99_ms": p99_ms,
        # The HTTP processes' event loops and garbage collectors, summed over processes.
        "event_loop_lag_p99_ms": rounded(quantile(0.99, "event_loop_lag", before, after), 1000, 1),
        "gc_pauses": int(gc_count),
        "gc_pause_mean_ms": rounded(mean("texel_gc_pause_seconds"), 1000, 2),
        "gc_pause_p99_ms": rounded(quantile(0.99, "gc_pause", before, after), 1000, 2),
    }


def quantile(
    q: float, prefix: str, before: dict[str, float], after: dict[str, float]
) -> float | None:
    """The q-quantile of a scraped histogram's observations between two scrapes, as
    Prometheus' histogram_quantile estimates it: linear within the bucket it falls in
    (the largest finite bound when it falls past every bound)."""
    key = f"{prefix}_le:"
    bounds = sorted(
        (float(k[len(key) :]), after[k] - before.get(k, 0.0)) for k in after if k.startswith(key)
    )
    if not bounds or bounds[-1][1] <= 0:
        return None
    rank = q * bounds[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in bounds:
        if count >= rank:
            if math.isinf(bound):
                return lower
            share = (rank - below) / (count - below) if count > below else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, count
    return lower


class LitServeProcess:
    """bench.litserve_formula in a subprocess on a free port."""

    def __init__(
        self, model: str, max_batch_size: int, batch_timeout: float, api_servers: int = 1
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path("/tmp") / f"texel-litserve-{self.port}.log"
        args = [sys.executable, "-m", "bench.litserve_formula", "--model", model]
        args += ["--port", str(self.port), "--max-batch-size", str(max_batch_size)]
        args += ["--batch-timeout", str(batch_timeout), "--api-servers", str(api_servers)]
        with self.log.open("wb") as log:
            # its own process group: LitServe's inference workers are children to stop too
            self.process = subprocess.Popen(
                args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(self.log.read_text()[-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("LitServe did not become healthy")

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


def model_only_batches(items: list, size: int) -> list[list]:
    """One pass over `items` in batches of `size`: sorted by width, so a batch pads
    little and holds formulas of similar length, and every image is decoded exactly once
    (no image repeated to fill a batch, which would end it sooner than real traffic)."""
    ordered = sorted(items, key=lambda item: item.width)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


def model_only(
    model: str, images: list[bytes], batch_sizes: list[int], budget_s: float
) -> list[dict]:
    """The model alone: inputs preprocessed, batched by width (`model_only_batches`),
    decoded as the server decodes a batch; the best batch size wins.

    Each batch size runs over the images once, or for `budget_s` seconds if that is shorter.
    """
    import torch

    from models.devices import resolve_devices
    from models.formula.adapter import FormulaRecognizer

    device = resolve_devices("auto")[0]
    recognizer = FormulaRecognizer(model, [device])
    recognizer.open()
    recognizer.load(device)
    recognizer.warmup(device, max(batch_sizes))
    run = recognizer.runner(device)
    items = [recognizer.preprocess(image) for image in images]
    out = []
    for size in batch_sizes:
        batches = model_only_batches(items, size)
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        done = 0
        for batch in batches:
            run(batch, lambda: False)
            done += len(batch)
            if time.perf_counter() - started > budget_s:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        out.append({"batch_size": size, "throughput_rps": round(done / elapsed, 2)})
        print(json.dumps({"model-only": out[-1]}), flush=True)
    return out


def engine_only(args, images: list[bytes]) -> list[dict]:
    """Texel's engine for the formula model alone, built from the settings as a server
    builds it (with `--max-batch-size`), in this process as an engine process runs it (the
    same switch interval, its objects frozen for the collector): `concurrency` callers
    submit preprocessed inputs from memory, each the next as soon as its last returns, for
    `--duration` s after `--warmup` s, at each concurrency."""
    import gc

    from app.launcher import model_plans
    from app.settings import Settings
    from engine import Engine
    from engine.process import GPU_SWITCH_INTERVAL_S
    from models.devices import resolve_devices

    device = resolve_devices("auto")[0]
    settings = Settings(
        formula={
            "model": args.model,
            "max_batch_size": args.max_batch_size,
            "max_wait_ms": args.max_wait_ms,
            "max_queue": 4 * max(args.concurrency),
        },
        image={"enabled": False},
    )
    if device.type == "cuda":
        sys.setswitchinterval(GPU_SWITCH_INTERVAL_S)

    async def ask(engine: Engine, item, result: LoadResult) -> None:
        """One request, its latency and batch into `result`, or its error's name."""
        started = time.perf_counter()
        try:
            answer = await engine.submit("formula", item, settings.request_timeout_s)
        except Exception as exc:
            result.statuses[type(exc).__name__] += 1
            return
        result.latencies_s.append(time.perf_counter() - started)
        result.statuses[200] += 1
        result.batch_sizes.append(answer.batch_size)

    async def closed(engine: Engine, inputs: list, concurrency: int, seconds: float):
        result = LoadResult("closed", concurrency, seconds)
        counter = iter(range(10**9))

        async def caller(until: float) -> None:
            while time.perf_counter() < until:
                await ask(engine, inputs[next(counter) % len(inputs)], result)

        started = time.perf_counter()
        await asyncio.gather(*(caller(started + seconds) for _ in range(concurrency)))
        result.duration_s = time.perf_counter() - started
        return result

    async def poisson(engine: Engine, inputs: list, rate: float, seconds: float, seed: int = 0):
        """Arrivals at `rate` a second, exponential gaps, whatever the engine's pace."""
        result = LoadResult("open", rate, seconds)
        rng = random.Random(seed)
        tasks, started, due = [], time.perf_counter(), 0.0
        while due < seconds:
            await asyncio.sleep(max(0.0, started + due - time.perf_counter()))
            item = inputs[len(tasks) % len(inputs)]
            tasks.append(asyncio.create_task(ask(engine, item, result)))
            due += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        return result

    async def measure() -> list[dict]:
        engine = Engine(device, model_plans(settings, [device]), settings.advanced.gpu_sharing)
        await engine.start()
        try:
            if engine.states()["formula"].state != "ready":
                raise SystemExit(f"engine-only: {engine.states()['formula']}")
            model = engine.model("formula")
            inputs = [model.preprocess(image) for image in images]
            gc.collect()
            gc.freeze()
            # The first shapes the decoder meets cost more than their steps (bench/RESULTS.md,
            # "The engine issue's bars"): the largest level warms every level up first.
            await closed(engine, inputs, max(args.concurrency), args.warmup)
            out = []
            for concurrency in args.concurrency:
                await closed(engine, inputs, concurrency, args.warmup)
                result = await closed(engine, inputs, concurrency, args.duration)
                mean_batch = result.summary()["mean_batch_size"]
                out.append(
                    record(
                        args, "engine-only", concurrency, result, server_mean_batch_size=mean_batch
                    )
                )
            for rate in args.rates:
                result = await poisson(engine, inputs, rate, args.duration)
                mean_batch = result.summary()["mean_batch_size"]
                out.append(
                    record(
                        args, "engine-only", f"poisson@{rate}", result,
                        server_mean_batch_size=mean_batch,
                    )
                )  # fmt: skip
            return out
        finally:
            gc.unfreeze()
            await engine.close()

    return asyncio.run(measure())


def record(args, server: str, concurrency, result: LoadResult | None, **extra) -> dict:
    base = {
        "scenario": "formula",
        "server": server,
        "concurrency": concurrency,
        "gpu": gpu_name(),
        "machine": machine(),  # the host's CPU, which serves HTTP beside the GPU
        "commit": commit(),
        "command": "python -m bench.compare " + " ".join(args.argv),
        "env": settings_env(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if result is not None:
        summary = result.summary()
        base.update(
            client=summary["client"],
            throughput_rps=summary["throughput_rps"],
            p50_ms=summary["p50_ms"],
            p95_ms=summary["p95_ms"],
            p99_ms=summary["p99_ms"],
            errors=summary["errors"],
            requests=summary["requests"],
            mode=summary["mode"],
        )
        if "client_late_p99_ms" in summary:  # open loop: latencies count from arrival times
            base["client_late_p99_ms"] = summary["client_late_p99_ms"]
    base.update(extra)
    print(json.dumps(base), flush=True)
    append_records([base], args.out)  # as it comes: a run cut short keeps what it measured
    return base


def py_spy(args, pid: int, label: str) -> list[subprocess.Popen]:
    """Sample every thread of `pid` and of its child processes for one measurement: once
    only while holding the GIL (who has the interpreter), once including waits (where
    each thread is)."""
    seconds = str(int(args.warmup + args.duration))
    spies = []
    for mode, flags in (("gil", ["--gil"]), ("all", ["--idle"])):
        out = args.out.parent / f"py-spy-{label}-{mode}.txt"
        binary = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        command = [binary, "record", "-p", str(pid), "-d", seconds, "-r", "100", "--threads"]
        command += ["--subprocesses", "--nonblocking", "-f", "raw", "-o", str(out), *flags]
        spies.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    return spies


def spread_later(pid: int, url: str, delay_s: float) -> Future:
    """After `delay_s`, the connections to `url`'s port that each process of the server
    `pid` holds, largest first (`bench.connection_spread`): in a closed loop each client
    keeps one, so this is how the load divides over the HTTP processes."""
    port = int(url.rsplit(":", 1)[1])
    return _in_background(lambda: (time.sleep(delay_s), held(pid, port))[1])


def cores_later(pid: int, url: str, start_s: float, window_s: float) -> Future:
    """The cores each HTTP process of the server `pid` used (busiest first), and its
    engine processes together, over the `window_s` seconds from `start_s` on: whether
    an HTTP process, whose interpreter lock lets it use about one, is near its limit."""
    port = int(url.rsplit(":", 1)[1])

    def measure() -> dict:
        time.sleep(start_s)
        roles = by_role(pid, port)
        before = {p.pid: cpu_seconds(p) for role in roles.values() for p in role}
        time.sleep(window_s)

        def cores(process) -> float:
            return (cpu_seconds(process) - before[process.pid]) / window_s

        return {
            "cores_per_http_process": sorted(
                (round(cores(p), 2) for p in roles["http"]), reverse=True
            ),
            "engine_cores": round(sum(cores(p) for p in roles["engine"]), 2),
        }

    return _in_background(measure)


def _in_background(function) -> Future:
    """`function()` on a thread of its own, which ends with it."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(function)
    pool.shutdown(wait=False)
    return future


def sweep(
    args, server: str, url: str, workload: Workload, is_texel: bool, pid: int | None = None
) -> list[dict]:
    records = []
    for concurrency in args.concurrency:
        before = scrape(url) if is_texel else {}
        spies = []
        if pid is not None and concurrency == args.py_spy_at:
            spies = py_spy(args, pid, f"{server}-c{concurrency}")
        spread = spread_later(pid, url, args.warmup + args.duration / 2) if pid else None
        cores = cores_later(pid, url, args.warmup, args.duration) if pid else None
        result = closed_loop_processes(
            url, workload, concurrency, args.duration, args.warmup, args.client_processes
        )
        for spy in spies:
            spy.wait(60)
        extra = texel_extras(before, scrape(url)) if is_texel else {}
        if spread is not None:
            extra["connections_per_http_process"] = spread.result()
        if cores is not None:
            extra.update(cores.result())
        records.append(record(args, server, concurrency, result, **extra))
    for rate in args.rates if is_texel else []:
        before = scrape(url)
        result = open_loop_processes(
            url, workload, rate, args.duration, args.warmup, args.client_processes
        )
        extra = texel_extras(before, scrape(url))
        records.append(record(args, server, f"poisson@{rate}", result, **extra))
    return records


def run(args) -> list[dict]:
    images = formula_images(args.data, args.images)
    records: list[dict] = []
    env = {"TEXEL_IMAGE__ENABLED": "false", "TEXEL_FORMULA__MODEL": args.model}
    env["TEXEL_FORMULA__MAX_QUEUE"] = str(max(args.concurrency) * 4)
    env["TEXEL_FORMULA__MAX_WAIT_MS"] = str(args.max_wait_ms)
    for server in args.servers:
        if server in ("texel", "texel-nobatch"):
            batch = args.max_batch_size if server == "texel" else 1
            profile = args.profile_loop if server == "texel" else None
            proc = ServerProcess(
                {**env, "TEXEL_FORMULA__MAX_BATCH_SIZE": str(batch)}, profile=profile
            )
            try:
                workload = json_workload("/recognize", images)
                pid = proc.process.pid
                records += sweep(args, server, proc.url, workload, is_texel=True, pid=pid)
            finally:
                # uvicorn re-raises the stop signal once drained: SIGINT becomes a
                # KeyboardInterrupt, which lets cProfile write its stats; SIGTERM would not
                proc.stop(signal.SIGINT if profile else signal.SIGTERM)
        elif server.startswith("litserve"):  # litserve-N: N HTTP processes (num_api_servers)
            api_servers = int(server.partition("-")[2] or 1)
            lit = LitServeProcess(
                args.model, args.max_batch_size, args.max_wait_ms / 1000, api_servers
            )
            try:
                workload = json_workload("/predict", images)
                for r in sweep(args, server, lit.url, workload, False):
                    records.append({**r, "api_servers": api_servers})
            finally:
                lit.stop()
        elif server == "engine-only":
            records += engine_only(args, images)
        elif server == "model-only":
            sizes = sorted({1, *args.concurrency, args.max_batch_size})
            results = model_only(
                args.model,
                images,
                [s for s in sizes if s <= args.max_batch_size],
                args.duration,
            )
            best = max(results, key=lambda r: r["throughput_rps"])
            records.append(
                record(
                    args,
                    "model-only",
                    best["batch_size"],
                    None,
                    throughput_rps=best["throughput_rps"],
                    sweep=results,
                )
            )
    return records


def table(records: list[dict]) -> str:
    lines = [
        f"GPU: {records[0]['gpu']}; commit {records[0]['commit']}",
        "",
        "| server | concurrency | formulas/s | p50 ms | p95 ms | p99 ms | batch | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['throughput_rps']} "
            f"| {r.get('p50_ms', '-')} | {r.get('p95_ms', '-')} | {r.get('p99_ms', '-')} "
            f"| {r.get('server_mean_batch_size') or '-'} | {r.get('errors') or '-'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--model", default=str(ROOT / "models" / "formula" / "default"))
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument(
        "--servers",
        type=lambda s: s.split(","),
        default=["texel", "texel-nobatch", "litserve", "model-only"],
    )
    parser.add_argument(
        "--concurrency",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 8, 32, 128, 256],
    )
    parser.add_argument(
        "--rates", type=lambda s: [float(x) for x in s.split(",") if x], default=[],
        help="open-loop Poisson arrival rates (req/s) for Texel and engine-only",
    )  # fmt: skip
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--max-batch-size", type=int, default=128)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    parser.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="split each closed-loop client over this many processes (high loads)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--profile-loop",
        type=Path,
        default=None,
        help="run `texel` under cProfile and write the event loop's stats here "
        "(read with `python -m pstats`); its figures are slowed by the profiler",
    )
    parser.add_argument(
        "--py-spy-at",
        type=int,
        default=None,
        help="sample Texel's threads with py-spy at this concurrency, into py-spy-*.txt "
        "beside --out (raw folded stacks: one with only GIL holders, one with waits)",
    )
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    args.out = args.out or gpu_results_file()
    records = run(args)
    print()
    print(table(records))


if __name__ == "__main__":
    main()
