"""`texel serve`: the process plan, computed once, and the processes it starts.

On a CPU with one HTTP process everything runs in one process: uvicorn, the routes and
the engine (`LocalEngine`). Otherwise the launcher starts one engine process per device
(`engine.process`) and N identical HTTP processes, each listening on a socket of its
own bound to the same port with SO_REUSEPORT (the kernel spreads new connections over
them; a process holding more than its share of them closes one after its next answer,
`app.server.ConnectionShare`), each connected to every engine. A request crosses two
process boundaries: HTTP process to engine and back.

The launcher holds no model, answers no request and never imports torch: it learns the
devices from a process of their own (`app.devices.device_names`), and each child builds
what it serves itself. It restarts an engine or HTTP
process that dies (an engine's in-flight requests fail with it; HTTP processes
reconnect), and on SIGTERM stops the HTTP processes first (each finishes its requests,
the engines still serving) and the engines after. Metrics from every process meet in
prometheus_client's multiprocess directory.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from app.devices import device_names
from app.settings import Settings
from telemetry.resources import usable_cores

if TYPE_CHECKING:
    import torch

    from engine import ModelPlan

log = logging.getLogger("texel")

SUPERVISE_S = 0.5
LOCK_FILE = "lock"  # in a server's folder, locked (flock) while its launcher runs
# Said at start: the models load after the port opens (on a CPU, about a minute).
LOADING = "loading the models: GET /readyz answers 200 once they are ready"
# On SIGTERM an HTTP process takes the grace, the drain and then at most
# `app.server.AFTER_DRAIN_S` to write its last answers; it is killed HTTP_STOP_S past the
# grace and the drain. An engine is stopped after every HTTP process, when no request is
# left waiting for it: what it still runs is nobody's, and it is killed ENGINE_STOP_S on.
HTTP_STOP_S = 5.0
ENGINE_STOP_S = 5.0
# Children are forked from a fork server: a process started afresh, holding no CUDA
# state, that imports what every child needs once (`app.preload`).
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(["app.preload"])


@dataclass(frozen=True)
class ProcessPlan:
    """Which processes serve: one engine per device, `http_processes` HTTP processes."""

    devices: list[str]  # "cpu" or "cuda:N", as torch names them
    http_processes: int

    @property
    def single_process(self) -> bool:
        """One HTTP process on a CPU: the engine runs inside it."""
        return self.http_processes == 1 and self.devices == ["cpu"]

    @classmethod
    def of(cls, settings: Settings, cores: int | None = None) -> ProcessPlan:
        devices = list(device_names(settings.device))
        if "cpu" in devices:
            devices = ["cpu"]  # one engine owns the CPU
        http = settings.http_processes
        if http is None:
            on_gpu = devices != ["cpu"]
            http = max(1, min(12, (cores or usable_cores()) * 3 // 4)) if on_gpu else 1
        return cls(devices, http)


def model_plans(settings: Settings, devices: list[torch.device]) -> list[ModelPlan]:
    """What every engine serves: each enabled model, built from its settings entry."""
    from engine import ModelPlan

    return [
        ModelPlan(
            key=key,
            build=entry.factory(settings, devices),
            max_batch_size=entry.batch_size(devices),
            max_wait_s=entry.max_wait_ms / 1000,
            max_queue=entry.max_queue,
            # Past twice the longest a request may take, its work only serves nobody.
            stall_s=2 * settings.request_timeout_s,
        )
        for key, entry in settings.models().items()
    ]


def request_models(settings: Settings, devices: list[torch.device]) -> dict:
    """The request sides of the enabled models, for an HTTP process (not yet opened)."""
    return {plan.key: plan.build() for plan in model_plans(settings, devices)}


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` with SO_REUSEPORT, not yet listening: uvicorn
    listens once the app has started, and from then on the kernel hands it its share
    of new connections."""
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


def serve(host: str, port: int, settings: Settings | None = None) -> None:
    from telemetry import setup_logging

    settings = settings or Settings()
    setup_logging(settings.log_format, settings.log_level)
    plan = ProcessPlan.of(settings)
    if plan.single_process:
        _serve_single(settings, plan, host, port)
    else:
        Launcher(settings, plan, host, port).run()


def single_process_app(settings: Settings, plan: ProcessPlan | None = None):
    """The app with its engine inside it, on the plan's first device (a CPU by default)."""
    import torch

    from app.main import build_app
    from engine import Engine, LocalEngine

    devices = [torch.device(name) for name in (plan.devices if plan is not None else ["cpu"])]
    engine = LocalEngine(
        Engine(devices[0], model_plans(settings, devices[:1]), settings.advanced.gpu_sharing)
    )
    return build_app(settings, request_models(settings, devices[:1]), [engine])


def _serve_single(settings: Settings, plan: ProcessPlan, host: str, port: int) -> None:
    """Serve in this process until SIGTERM or SIGINT, each drained (`TexelServer`).
    uvicorn raises the SIGINT it caught again once it has stopped, a KeyboardInterrupt
    here: Ctrl-C then ends the process with exit status 130, as a shell expects of a
    command it interrupted, and no traceback."""
    from app.server import TexelServer, uvicorn_config

    try:
        app = single_process_app(settings, plan)
        log.info("serving in one process (uvicorn says where); %s", LOADING)
        TexelServer(uvicorn_config(app, settings, host=host, port=port), app.state.runtime).run()
    except KeyboardInterrupt:
        sys.exit(130)


def run_engine_process(
    settings: Settings,
    devices: list[str],
    device: str,
    path: str,
    parent_pid: int,
    index: int,
    beats,
) -> None:
    """The entry of an engine process: what every engine serves, built here from the
    settings (the launcher holds no model code), then `engine.process.run_engine`; it
    keeps in slot `index` of `beats` when its event loop last went round."""
    import torch

    from engine.process import run_engine

    run_engine(
        device,
        model_plans(settings, [torch.device(name) for name in devices]),
        path,
        parent_pid,
        settings.log_format,
        settings.log_level,
        settings.drain_timeout_s,
        settings.advanced.gpu_sharing,
        beat=lambda: beats.__setitem__(index, time.monotonic()),
    )


def run_http_process(
    settings: Settings,
    address: tuple[str, int],
    engines: list[tuple[str, str]],
    parent_pid: int,
    index: int,
    connections,
    beats,
) -> None:
    """The entry of an HTTP process: the app, its engines reached over their sockets;
    it keeps the count of its open connections in slot `index` of `connections`, and in
    slot `index` of `beats` when its event loop last went round (`time.monotonic()`)."""
    import torch

    from app.main import build_app
    from app.server import ConnectionShare, TexelServer, uvicorn_config
    from engine import RemoteEngine
    from engine.process import exit_with_parent, name_process
    from telemetry import setup_logging

    exit_with_parent(parent_pid)
    name_process(f"texel-http-{index}")
    setup_logging(settings.log_format, settings.log_level)
    devices = [torch.device(name) for name, _ in engines]
    clients = [RemoteEngine(path, name) for name, path in engines]
    app = build_app(settings, request_models(settings, devices), clients)
    app.state.runtime.heartbeat = lambda: beats.__setitem__(index, time.monotonic())
    share = ConnectionShare(connections, index)
    server = TexelServer(
        uvicorn_config(app, settings, share), app.state.runtime, ignore=(signal.SIGINT,)
    )
    server.run(sockets=[reuseport_socket(*address)])


class _Child:
    """One supervised child process, started again when it dies."""

    def __init__(self, name: str, target, args: tuple, beat=None, hang_s: float = 0.0) -> None:
        self.name = name
        self.target = target
        self.args = args
        # When it last showed life (`beat()`, time.monotonic(), 0 before its first sign),
        # and how long without one means it hangs: it is then killed and started again.
        self.beat = beat
        self.hang_s = hang_s
        self.process: multiprocessing.process.BaseProcess | None = None
        self.started = 0.0
        self.failures = 0
        self.due: float | None = None  # a restart waiting out its backoff

    def start(self) -> None:
        self.process = CONTEXT.Process(target=self.target, args=self.args, name=self.name)
        self.started = time.monotonic()
        self.due = None
        try:
            self.process.start()
        except (EOFError, OSError) as exc:
            # The fork server died as it forked (killed): this child counts as one that
            # died at once, and the next try starts a new fork server.
            log.error("could not start %s: %s", self.name, exc or type(exc).__name__)

    def check(self, now: float) -> None:
        """Restart the process if it died, backing off when it dies at once; kill it
        first if it hangs (alive, and no sign of life for `hang_s`)."""
        assert self.process is not None
        if self.process.is_alive() and self.beat is not None and self.due is None:
            last = self.beat()
            if last > self.started and now - last > self.hang_s:
                log.error(
                    "%s (pid %s) has shown no sign of life for %.0f s; killing it",
                    self.name,
                    self.process.pid,
                    now - last,
                )
                self.process.kill()
                self.process.join(5)
        if self.process.is_alive():
            return
        if self.due is None:
            quick = now - self.started < 10
            self.failures = self.failures + 1 if quick else 0
            delay = min(30.0, 2.0**self.failures) if quick else 0.0
            self.due = now + delay
            log.error(
                "%s (pid %s) exited with code %s; starting it again in %.0f s",
                self.name,
                self.process.pid,
                self.process.exitcode,
                delay,
            )
            _mark_dead(self.process.pid)
        if now >= self.due:
            self.start()


class Launcher:
    """Starts, supervises and stops the engine and HTTP processes of one server."""

    def __init__(self, settings: Settings, plan: ProcessPlan, host: str, port: int) -> None:
        self.settings = settings
        self.plan = plan
        self.host = host
        self.port = port
        self._stop = threading.Event()  # a signal came: drain and stop

    def run(self) -> None:
        holder, claim = self._claim_port()
        address = holder.getsockname()[:2]
        remove_orphans(tempfile.gettempdir())
        # Mode 0700: the sockets live here. Named after this process, so that a later
        # server can tell it is left over if this one is killed.
        directory = tempfile.mkdtemp(prefix=f"texel-{os.getpid()}-")
        held = hold_folder(directory)
        metrics_dir = os.path.join(directory, "metrics")
        os.mkdir(metrics_dir)
        # Inherited by every child; read by prometheus_client when it is imported there.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        os.environ["TEXEL_LAUNCHER_PID"] = str(os.getpid())  # where `texel diagnose` looks
        engines = [(d, os.path.join(directory, f"engine-{i}.sock"))
                   for i, d in enumerate(self.plan.devices)]  # fmt: skip
        s = self.settings
        # When each child's event loop last went round. A process whose loop stands still
        # for twice the longest a request may take (stopped, deadlocked) answers nobody:
        # it is killed and started again. (An engine whose loop goes round but whose
        # device work hangs ends itself: `engine.process.end_when_hung`.)
        engine_beats = CONTEXT.RawArray("d", len(engines))
        children = [
            _Child(
                f"texel-engine-{name}",
                run_engine_process,
                (s, self.plan.devices, name, path, os.getpid(), i, engine_beats),
                beat=functools.partial(engine_beats.__getitem__, i),
                hang_s=2 * s.request_timeout_s,
            )
            for i, (name, path) in enumerate(engines)
        ]
        # Each HTTP process's open connections, for `app.server.ConnectionShare`.
        connections = CONTEXT.RawArray("i", self.plan.http_processes)
        beats = CONTEXT.RawArray("d", self.plan.http_processes)
        http = [
            _Child(
                f"texel-http-{i}",
                run_http_process,
                (s, address, engines, os.getpid(), i, connections, beats),
                beat=functools.partial(beats.__getitem__, i),
                hang_s=2 * s.request_timeout_s,
            )
            for i in range(self.plan.http_processes)
        ]
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        log.info(
            "serving on http://%s:%d: %d HTTP processes, engines on %s; %s",
            self.host,
            address[1],
            len(http),
            ", ".join(name for name, _ in engines),
            LOADING,
        )
        try:
            for child in [*children, *http]:
                child.start()
            while not self._stop.wait(SUPERVISE_S):
                now = time.monotonic()
                for child in [*children, *http]:
                    if not self._stop.is_set():
                        child.check(now)
            self._shutdown(http, children)
        finally:
            for child in [*http, *children]:
                if child.process is not None and child.process.is_alive():
                    child.process.kill()
            holder.close()
            claim.close()
            shutil.rmtree(directory, ignore_errors=True)
            held.close()

    def _claim_port(self) -> tuple[socket.socket, socket.socket]:
        """The port, held (bound, never listening, so it takes no connections) while
        this server runs, and a claim on it that a second Texel cannot make: with
        SO_REUSEPORT it could bind the port beside this one and take half its
        connections. The claim is an abstract Unix socket named after the address,
        which the kernel drops with the process. A port taken exits with one line."""
        holder = claim = None
        try:
            holder = reuseport_socket(self.host, self.port)
            host, port = holder.getsockname()[:2]
            claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            claim.bind(f"\0texel-{host}:{port}")
            return holder, claim
        except OSError as exc:
            for sock in (holder, claim):
                if sock is not None:
                    sock.close()
            reason = "already served by another Texel" if holder is not None else exc.strerror
            log.error("cannot serve on %s:%d: %s", self.host, self.port, reason)
            raise SystemExit(1) from None

    def _on_signal(self, signum: int, frame) -> None:
        if self._stop.is_set():  # a second signal: stop at once
            raise SystemExit(1)
        log.info("received %s: draining", signal.Signals(signum).name)
        self._stop.set()

    def _shutdown(self, http: list[_Child], engines: list[_Child]) -> None:
        """HTTP processes first (their requests finish on the running engines), then the
        engines."""
        s = self.settings
        for group, limit in (
            (http, s.shutdown_grace_s + s.drain_timeout_s + HTTP_STOP_S),
            (engines, ENGINE_STOP_S),
        ):
            alive = [c.process for c in group if c.process is not None and c.process.is_alive()]
            for process in alive:
                process.terminate()
            deadline = time.monotonic() + limit
            for process in alive:
                process.join(max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    log.warning("%s did not stop in time; killing it", process.name)
                    process.kill()


def _mark_dead(pid: int | None) -> None:
    """Drop a dead process's live gauges from the multiprocess metrics."""
    from prometheus_client import multiprocess

    if pid is not None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.mark_process_dead(pid)


def shutdown_limit_s(settings: Settings) -> float:
    """The longest a server takes to stop after SIGTERM: what an orchestrator's grace
    period (Kubernetes' `terminationGracePeriodSeconds`) must exceed."""
    return settings.shutdown_grace_s + settings.drain_timeout_s + HTTP_STOP_S + ENGINE_STOP_S


def hold_folder(folder: str) -> TextIO:
    """Take the lock of a server's `folder` for as long as the returned file stays open
    (the kernel lets go of it when the process ends, however it ends)."""
    lock = open(os.path.join(folder, LOCK_FILE), "w")  # noqa: SIM115 - held until closed
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return lock


def remove_orphans(parent: str) -> None:
    """Remove the folders that killed servers left in `parent` (a launcher SIGKILLed
    cannot clean up; its children exit with it): `texel-PID-*` whose lock no process
    holds. A PID alone would not say: in another container sharing the folder, a live
    server's PID is not visible. A folder without a lock (just made, or an older
    Texel's) goes by its PID."""
    for folder in Path(parent).glob("texel-*-*"):
        pid = folder.name.split("-")[1]
        if not pid.isdigit() or not folder.is_dir():
            continue
        if _orphaned(folder, int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _orphaned(folder: Path, pid: int) -> bool:
    try:
        with open(folder / LOCK_FILE) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # let go as it closes
            return True
    except BlockingIOError:  # held: its server runs
        return False
    except FileNotFoundError:
        pass
    except OSError:  # not ours to read: another user's
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False
