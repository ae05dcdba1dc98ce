"""An engine process: one `Engine` on one device, served on a Unix socket.

The launcher starts one per GPU (forked from its fork server, which holds no CUDA
state). Every
HTTP process connects to it; each connection carries that process's requests
(`engine.protocol`). On SIGTERM the engine refuses new requests, finishes the queued
ones and exits; when its launcher dies it exits too.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import psutil
import torch

from batching import CUT_OFF
from engine import protocol
from engine.engine import Engine, ModelPlan
from engine.sharing import DEFAULT_SHARING, Sharing

log = logging.getLogger(__name__)


PR_SET_PDEATHSIG = 1  # prctl(2)
PR_SET_NAME = 15


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """In a child process: end it once the launcher that started it is gone (killed
    outright, its children would otherwise live on, orphaned), or the fork server that
    forked it (the launcher, seeing its children end, starts them again from a new one;
    an orphan would serve beside its replacement)."""
    parent = os.getppid()  # the fork server
    with contextlib.suppress(OSError, AttributeError):  # Linux: killed when it dies
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        launcher = psutil.Process(parent_pid)  # is_running() also sees a reused pid
    except psutil.NoSuchProcess:
        os._exit(0)

    def alive() -> bool:
        try:
            return launcher.is_running() and launcher.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def watch() -> None:
        while os.getppid() == parent and alive():
            time.sleep(poll_s)
        os._exit(0)

    threading.Thread(target=watch, name="texel-parent-watch", daemon=True).start()


def name_process(name: str) -> None:
    """The name `ps -o comm`, `top` and `htop` show for this process (Linux; at most 15
    bytes), where its command line is the same for every child (multiprocessing's)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class EngineServer:
    """Serves one engine's connections."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._messages = protocol.decoder(protocol.ToEngine)
        self._payloads: dict[str, msgspec.msgpack.Decoder] = {}

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        tasks: dict[int, asyncio.Task] = {}
        pending: list[bytes] = []

        def send(message: Any) -> None:
            pending.append(message if isinstance(message, bytes) else protocol.frame(message))
            if len(pending) == 1:
                asyncio.get_running_loop().call_soon(flush)

        def flush() -> None:
            if pending and not writer.is_closing():
                writer.writelines(pending)
            pending.clear()

        try:
            while True:
                message = self._messages.decode(await protocol.read_frame(reader))
                if isinstance(message, protocol.Submit):
                    task = asyncio.get_running_loop().create_task(self._submit(message, send))
                    tasks[message.id] = task
                    task.add_done_callback(lambda _, i=message.id: tasks.pop(i, None))
                elif isinstance(message, protocol.Cancel):
                    if (task := tasks.pop(message.id, None)) is not None:
                        task.cancel(CUT_OFF if message.cut_off else None)
                else:
                    send(self._states(message.id))
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except Exception:
            log.exception("an HTTP process sent a bad frame; closing its connection")
        finally:
            # The HTTP process is gone: nobody waits for these any more.
            for task in tasks.values():
                task.cancel()
            writer.close()

    async def _submit(self, message: protocol.Submit, send) -> None:
        try:
            model = self.engine.model(message.model)
            payload = self._decoder(message.model, model.payload_type).decode(message.payload)
            context = message.trace.context() if message.trace is not None else None
            follow = None
            if message.progress:

                def follow(steps: int, ahead: int | None, request_id=message.id) -> None:
                    send(protocol.Progress(request_id, steps, ahead))

            result = await self.engine.submit(
                message.model, payload, message.timeout_s, context, follow
            )
            answer = protocol.Answer(
                message.id,
                msgspec.Raw(protocol.encode(result.value)),
                result.batch_size,
                result.queue_wait_s,
                result.run_s,
                result.worker,
                protocol.TraceRef.of(result.batch_ref),
            )
            frame = protocol.frame(answer)
        except asyncio.CancelledError:
            return  # the caller went away; nobody reads a reply
        except Exception as exc:
            if not hasattr(exc, "code"):  # not a refusal the batcher or engine made
                log.exception("request %d of %s failed", message.id, message.model)
            send(protocol.refusal(message.id, exc))
            return
        send(frame)

    def _decoder(self, key: str, kind: type) -> msgspec.msgpack.Decoder:
        if key not in self._payloads:
            self._payloads[key] = protocol.decoder(kind)
        return self._payloads[key]

    def _states(self, request_id: int) -> protocol.States:
        models = {
            key: protocol.ModelStatus(state.state, state.error, state.description)
            for key, state in self.engine.states().items()
        }
        return protocol.States(request_id, self.engine.draining, models)


def run_engine(
    device: str,
    plans: list[ModelPlan],
    path: str,
    parent_pid: int,
    log_format: str,
    log_level: str,
    drain_timeout_s: float,
    sharing: Sharing = DEFAULT_SHARING,
    beat: Callable[[], None] | None = None,
) -> None:
    """The entry of an engine process; `beat` is called as its event loop goes round,
    the launcher's sign of its life."""
    from telemetry import setup_logging, setup_tracing, shutdown_tracing

    exit_with_parent(parent_pid)
    name_process(f"texel-{device}")
    # Ctrl-C in a terminal reaches every process of the group at once; the engine stops
    # only when the launcher says so, after the HTTP processes have finished.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(log_format, log_level)
    setup_tracing(max_batch_size=max((plan.max_batch_size for plan in plans), default=1))
    try:
        asyncio.run(_serve(torch.device(device), plans, path, drain_timeout_s, sharing, beat))
    finally:
        shutdown_tracing()


# The compute thread gives the interpreter lock up at every GPU synchronization and must
# get it back from the event loop at once, not after Python's default 5 ms
# (bench/RESULTS.md, "switch interval").
GPU_SWITCH_INTERVAL_S = 0.0005


async def _serve(
    device: torch.device,
    plans: list[ModelPlan],
    path: str,
    drain_s: float,
    sharing: Sharing,
    beat: Callable[[], None] | None,
):
    if device.type == "cuda":
        sys.setswitchinterval(GPU_SWITCH_INTERVAL_S)
    engine = Engine(device, plans, sharing)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    server = await asyncio.start_unix_server(EngineServer(engine).connection, path=path)
    log.info("engine on %s listens on %s", device, path)
    loading = engine.start()
    memory = loop.create_task(_record_memory(device))
    watchdog = loop.create_task(end_when_hung(engine))
    beating = loop.create_task(_beat(beat)) if beat is not None else None
    stopping = loop.create_task(stop.wait())
    await asyncio.wait([loading, stopping], return_when=asyncio.FIRST_COMPLETED)
    if loading.done():
        # The models and their libraries live as long as the process: keep the garbage
        # collector's full collections from scanning them between batches.
        gc.collect()
        gc.freeze()
    await stopping
    log.info("engine on %s draining", device)
    await engine.drain(drain_s)
    memory.cancel()
    watchdog.cancel()
    if beating is not None:
        beating.cancel()
    server.close()
    await engine.close()


# The exit status of an engine process that ended itself because its device work hung.
HUNG_EXIT = 70


async def end_when_hung(engine: Engine, every_s: float = 1.0, end=os._exit) -> None:
    """End this process once a model's device work has hung (`Engine.hung`): the call
    never returns, and only a fresh process gets the device back. The launcher starts
    one, as for an engine that died, and the requests in flight fail at once; the log
    gets why and every thread's stack."""
    while not (hung := engine.hung()):
        await asyncio.sleep(every_s)
    log.error("engine on %s ends for a restart: %s", engine.name, "; ".join(hung))
    faulthandler.dump_traceback(all_threads=True)
    end(HUNG_EXIT)


async def _beat(beat: Callable[[], None], every_s: float = 0.25) -> None:
    while True:
        beat()
        await asyncio.sleep(every_s)


async def _record_memory(device: torch.device, every_s: float = 1.0) -> None:
    """The device's torch-allocator gauges, which only this process can read."""
    from telemetry import metrics

    while device.type == "cuda":
        metrics.record_allocator(device)
        await asyncio.sleep(every_s)
