"""Several processes answering HTTP on one port, in front of one set of batchers.

One Python process parses, decodes and encodes a few hundred requests a second
before its interpreter lock is full (README: Benchmarks), far less than a GPU
decodes. With `TEXEL_HTTP_PROCESSES=N`, `texel serve` binds the port, then starts
N-1 more HTTP processes, each listening on a socket of its own bound to the same
port with SO_REUSEPORT: the kernel spreads new connections evenly over the listening
sockets (a shared socket would hand most of them to whichever process happens to be
woken first). Each runs the same routes with its own interpreter lock: it
checks, parses and preprocesses a request, hands the decoded input over a Unix
socket (`app.channel`) to the serving process, whose batchers and GPU workers run
every process's requests in the same batches, and encodes the answer itself.

The serving process stays in charge: its /readyz and draining speak for all,
/metrics anywhere shows the sum over the HTTP processes (`telemetry.metrics.snapshot`),
an HTTP process that dies is started again, and on SIGTERM the serving process stops
the others (each finishes its requests) before it drains its own batchers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from app.channel import Channel, ChannelClosed
from app.errors import ApiError
from app.serving import Runtime, ServedModel, build_models, freeze_heap
from app.settings import Settings
from batching import BatchResult, exit_with_parent
from telemetry import metrics

log = logging.getLogger(__name__)

FOLLOW_S = 0.5  # how often an HTTP process reads the serving process's model states
SNAPSHOT_TIMEOUT_S = 5.0


class HttpProcesses:
    """The serving process's side: starts, serves, restarts and stops the other HTTP
    processes."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self.address = address  # the port they all listen on
        self.count = count
        self.path = ""
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.channels: dict[int, Channel] = {}
        self.joined: set[int] = set()  # accepting connections
        self._started_once: set[int] = set()  # joined, or died trying, at least once
        # Each process's last metrics snapshot, and those of processes gone since, so
        # the summed counters never go down when one dies, restarts or answers late.
        self._last: dict[int, list] = {}
        self._retired: list[list] = []
        self._runtime: Runtime | None = None
        self._server: asyncio.AbstractServer | None = None
        self._supervisor: asyncio.Task | None = None
        self._dir: str | None = None
        self._stopping = False

    async def start(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._dir = tempfile.mkdtemp(prefix="texel-http-")  # mode 0700
        self.path = os.path.join(self._dir, "serving.sock")
        self._server = await asyncio.start_unix_server(self._connected, path=self.path)
        for index in range(1, self.count + 1):
            self._spawn(index)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        log.info("%d more HTTP processes share the port", self.count)

    def _spawn(self, index: int) -> None:
        assert self._runtime is not None
        # spawn: forking a process that may hold CUDA state is unsafe
        process = multiprocessing.get_context("spawn").Process(
            target=serve_http_process,
            args=(self._runtime.settings, self.address, self.path, os.getpid(), index),
            name=f"texel-http-{index}",
        )
        process.start()
        self.processes[index] = process

    async def _connected(self, reader, writer) -> None:
        assert self._runtime is not None
        side = _ServingSide(self, self._runtime)
        side.channel = Channel(reader, writer, side, "an HTTP process")

    @property
    def settled(self) -> bool:
        """Every HTTP process has accepted connections (or died trying) at least once:
        from then on a restart does not take the serving process's readiness away."""
        return len(self._started_once) == self.count

    def on_joined(self, index: int) -> None:
        """An HTTP process is ready and about to accept connections."""
        self.joined.add(index)
        self._started_once.add(index)

    def on_gone(self, index: int) -> None:
        """An HTTP process's channel closed: keep its last counts, drop its gauges."""
        self.joined.discard(index)
        last = self._last.pop(index, None)
        if last:
            self._retired.append([family for family in last if family.type != "gauge"])

    async def _supervise(self) -> None:
        """Start an HTTP process again when one dies; back off if one dies at once."""
        assert self._runtime is not None
        now = time.monotonic()
        started = dict.fromkeys(self.processes, now)
        failures = dict.fromkeys(self.processes, 0)
        due: dict[int, float] = {}  # restarts waiting out their backoff
        while not self._stopping and not self._runtime.draining:
            await asyncio.sleep(FOLLOW_S)
            now = time.monotonic()
            for index, process in list(self.processes.items()):
                if process.is_alive():
                    continue
                if index not in due:
                    if index not in self._started_once:
                        self._started_once.add(index)  # do not hold readiness back for it
                    quick = now - started[index] < 10
                    failures[index] = failures[index] + 1 if quick else 0
                    delay = min(30.0, 2.0 ** failures[index]) if quick else 0.0
                    due[index] = now + delay
                    log.error(
                        "HTTP process %d (pid %s) exited with code %s; starting another in %.0f s",
                        index,
                        process.pid,
                        process.exitcode,
                        delay,
                    )
                if now < due[index] or self._runtime.draining:
                    continue
                del due[index]
                try:
                    self._spawn(index)
                except Exception:
                    log.exception("could not start HTTP process %d; retrying", index)
                    due[index] = now + 5.0
                started[index] = now

    async def snapshots(self) -> list:
        """Every HTTP process's `metrics.snapshot()`: fresh where it answers in time, its
        last one where not, and the last ones of processes gone since."""
        channels = list(self.channels.items())
        calls = [
            asyncio.wait_for(channel.call("snapshot"), SNAPSHOT_TIMEOUT_S)
            for _, channel in channels
        ]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for (index, channel), result in zip(channels, results, strict=True):
            if not isinstance(result, BaseException) and self.channels.get(index) is channel:
                self._last[index] = result
        return [*self._last.values(), *self._retired]

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM every HTTP process and give them `timeout_s` to finish their requests
        (served by this process's batchers meanwhile). Past it, close their channels, so
        their requests still in flight get a 503 rather than a reset connection, then
        kill what is left. A second call (a second signal) cuts the wait short."""
        if not self._stopping:
            self._stopping = True
            if self._supervisor is not None:
                self._supervisor.cancel()
            for index, process in self.processes.items():
                if not process.is_alive():
                    continue
                if index in self.joined:
                    process.terminate()
                else:  # still starting: it holds no requests
                    process.kill()
        alive = [p for p in self.processes.values() if p.is_alive()]
        try:
            await asyncio.to_thread(_join_all, alive, timeout_s)
            if any(p.is_alive() for p in alive):
                self._close_channels()
                await asyncio.to_thread(_join_all, alive, 2.0)
        finally:
            self._close_channels()
            for process in alive:
                if process.is_alive():
                    log.warning("HTTP process %s did not stop in time; killing it", process.pid)
                    process.kill()
            if self._server is not None:
                self._server.close()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)

    def _close_channels(self) -> None:
        for channel in list(self.channels.values()):
            channel.close()


def _join_all(processes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


class _ServingSide:
    """What one HTTP process may ask of the serving process (`rpc_*`)."""

    def __init__(self, hub: HttpProcesses, runtime: Runtime) -> None:
        self.hub = hub
        self.runtime = runtime
        self.channel: Channel | None = None
        self.index = 0
        self.pid = 0
        self.joined = False

    def rpc_hello(self, index: int, pid: int) -> None:
        assert self.channel is not None
        self.index, self.pid = index, pid
        self.hub.channels[index] = channel = self.channel
        self._forwarded = metrics.FORWARDED.labels(str(index))
        channel.done.add_done_callback(lambda _: self._gone(channel))

    def rpc_joined(self) -> None:
        """The HTTP process is ready and about to accept connections."""
        self.joined = True
        self.hub.on_joined(self.index)
        metrics.HTTP_PROCESSES.inc()
        log.info("HTTP process %d (pid %s) accepts connections", self.index, self.pid)

    def _gone(self, channel: Channel) -> None:
        if self.hub.channels.get(self.index) is channel:
            del self.hub.channels[self.index]
            self.hub.on_gone(self.index)
        if self.joined:
            metrics.HTTP_PROCESSES.dec()

    async def rpc_submit(self, key: str, payload: Any, context: Any) -> BatchResult:
        served = self.runtime.models.get(key)
        if served is None:
            raise ApiError(404, "model_disabled", f"the {key} model is not enabled")
        self._forwarded.inc()
        return await served.enqueue(payload, context)

    def rpc_request_infos(self, key: str) -> list[tuple[Any, dict]]:
        return self.runtime.models[key].request_infos()

    def rpc_state(self) -> tuple[bool, bool, dict[str, tuple[str, str | None]]]:
        models = {key: (m.state, m.error) for key, m in self.runtime.models.items()}
        return self.runtime.ready, self.runtime.draining, models

    async def rpc_metrics(self, accept: str | None) -> tuple[bytes, str]:
        return await self.runtime.metrics_exposition(accept)

    async def rpc_diagnose(self, window_s: float) -> dict:
        return await self.runtime.diagnose(window_s)


# -- inside an extra HTTP process --------------------------------------------------


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` with SO_REUSEPORT, not yet listening: asyncio
    listens once the app has started, and from then on the kernel hands it its share
    of new connections (a hash of their addresses picks among the listening sockets)."""
    if not hasattr(socket, "SO_REUSEPORT") or not sys.platform.startswith("linux"):
        raise RuntimeError("TEXEL_HTTP_PROCESSES above 1 needs Linux (SO_REUSEPORT)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def serve_http_process(
    settings: Settings, address: tuple[str, int], path: str, parent_pid: int, index: int
) -> None:
    """The entry of an extra HTTP process (spawned by `HttpProcesses`)."""
    import uvicorn

    from app.cli import TexelServer
    from app.main import build_app
    from telemetry import setup_logging

    exit_with_parent(parent_pid)
    setup_logging(settings.log_format, settings.log_level)
    # The serving process already waited out the grace period before stopping this one.
    settings = settings.model_copy(update={"shutdown_grace_s": 0.0})
    runtime = HttpProcessRuntime(settings, serving_path=path, index=index)
    config = uvicorn.Config(
        build_app(settings, runtime),
        log_config=None,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
    )
    TexelServer(config, runtime).run(sockets=[reuseport_socket(*address)])


class RemoteModel(ServedModel):
    """A served model whose batcher is in the serving process."""

    channel: Channel | None = None

    async def enqueue(self, payload: Any, context: Any = None) -> BatchResult:
        return await _ask(self.channel, "submit", self.key, payload, context)


@dataclass
class HttpProcessRuntime(Runtime):
    """The runtime of an extra HTTP process: same routes and request flows, models
    loaded without weights (their preprocessing and tokenizers), batches elsewhere."""

    serving_path: str = ""
    index: int = 0
    channel: Channel | None = None

    @property
    def ready(self) -> bool:
        return self.channel is not None and not self.channel.closed and super().ready

    async def start(self) -> None:
        """Connect to the serving process and get ready before uvicorn accepts a
        connection: until then the other processes on the port take them all."""
        devices, _ = self._start_process(lambda cores: min(4, cores))
        self.models = build_models(self.settings, devices, False, served_class=RemoteModel)
        self.channel = await Channel.connect(self.serving_path, self, f"HTTP process {self.index}")
        await self.channel.call("hello", self.index, os.getpid())
        for model in self.models.values():
            model.channel = self.channel
        await self._prepare()
        if self.settings.gc_freeze:
            freeze_heap()
        await self.channel.call("joined")
        self.loader = asyncio.get_running_loop().create_task(self._follow())

    async def _prepare(self) -> None:
        """Load each model's processing parts (no weights), wait for the serving process
        to finish loading, and take what its workers say requests need."""
        assert self.channel is not None
        loop = asyncio.get_running_loop()
        for key, model in self.models.items():
            try:
                await loop.run_in_executor(
                    self.pool, functools.partial(model.adapter.load, weights=False)
                )
            except Exception as exc:
                model.state, model.error = "failed", f"{type(exc).__name__}: {exc}"
                log.exception("could not load the %s model's processing", key)
        while True:
            _, _, states = await self.channel.call("state")
            if all(states[key][0] != "loading" for key in self.models):
                break
            await asyncio.sleep(FOLLOW_S)
        for key, model in self.models.items():
            if model.state == "failed":
                continue
            if states[key][0] == "ready":
                for device, info in await self.channel.call("request_infos", key):
                    model.adapter.attach_worker(device, info)
            model.state, model.error = states[key]

    async def _follow(self) -> None:
        """Mirror the serving process's model states; stop this process if the serving
        process goes away."""
        assert self.channel is not None
        try:
            while True:
                await asyncio.sleep(FOLLOW_S)
                _, _, states = await self.channel.call("state")
                for key, model in self.models.items():
                    if model.state != "failed":
                        model.state, model.error = states[key]
        except ChannelClosed:
            if not self.draining:
                log.error("HTTP process %d lost the serving process; stopping", self.index)
                signal.raise_signal(signal.SIGTERM)

    def rpc_snapshot(self) -> list:
        return metrics.snapshot()

    async def readiness(self) -> tuple[bool, bool, dict[str, str]]:
        try:
            ready, draining, models = await _ask(self.channel, "state")
        except ApiError:
            return False, self.draining, dict.fromkeys(self.models, "unavailable")
        draining = draining or self.draining
        states = {key: state for key, (state, _) in models.items()}
        return ready and not draining and self.ready, draining, states

    async def metrics_exposition(self, accept: str | None) -> tuple[bytes, str]:
        return await _ask(self.channel, "metrics", accept)

    async def diagnose(self, window_s: float) -> dict:
        return await _ask(self.channel, "diagnose", window_s)

    async def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        await super().close()


async def _ask(channel: Channel | None, method: str, *args: Any) -> Any:
    """`channel.call`, with a serving process that is gone answered as 503."""
    if channel is None:
        raise ApiError(503, "unavailable", "not connected to the serving process")
    try:
        return await channel.call(method, *args)
    except ChannelClosed as exc:
        raise ApiError(
            503, "unavailable", "the serving process is not answering", {"Retry-After": "1"}
        ) from exc
