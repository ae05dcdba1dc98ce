"""Run `texel serve` in a subprocess on a free port, and a local OTLP endpoint for it to
export to. The tests own this harness; the benchmarks reuse it through `bench.server`."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`texel serve` in a subprocess on a free port, with the environment given."""

    def __init__(
        self,
        env: dict[str, str],
        wait_ready: bool = True,
        profile: Path | None = None,
        entry: tuple[str, ...] = ("app.cli", "serve"),
        ready_timeout: float = 180,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"texel-test-{self.port}.log"
        # Tracing on unless this environment (which benchmark records name) turns it off.
        full_env = {"OTEL_SDK_DISABLED": "false", **os.environ, **env}
        full_env.setdefault("TEXEL_LOG_FORMAT", "text")
        self._log = self.log_path.open("wb")
        # `profile`: run under cProfile, whose stats cover the main thread, where
        # uvicorn's event loop runs; written when the server exits.
        profiler = ["-m", "cProfile", "-o", str(profile)] if profile else []
        self.process = subprocess.Popen(
            [
                sys.executable,
                *profiler,
                "-m",
                *entry,  # a module taking --host and --port, `texel serve` by default
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            cwd=ROOT,
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            self.wait_live()
            if wait_ready:
                self.wait_ready(ready_timeout)
        except BaseException:  # a server that never came up is not left running
            self.stop(signal.SIGKILL)
            raise

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def wait_live(self, timeout: float = 120) -> None:
        self._wait("/livez", timeout)

    def wait_ready(self, timeout: float = 180) -> None:
        self._wait("/readyz", timeout)

    def _wait(self, path: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{path} not OK after {timeout} s:\n{self.log()}")

    def log(self, tail: int = 5000) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail:]

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


def otlp_sink(on_request=None) -> str:
    """A local OTLP/HTTP endpoint, so export costs are real; returns its URL.

    `on_request(request)`, if given, receives each `ExportTraceServiceRequest`
    (tests read the spans back); otherwise the spans are discarded.
    """

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if on_request is not None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                )

                on_request(ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


@contextlib.contextmanager
def serving_in_thread(
    app, ready_timeout: float = 120, ready_path: str = "/readyz"
) -> Iterator[str]:
    """An ASGI app (the one-process app: its engine inside) on a free port, served by
    uvicorn in a thread of this process, so a test can reach into it (its spans); its URL
    once `ready_path` answers 200 (/livez for an app with no model to be ready)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + ready_path).status_code == 200:
                break
        time.sleep(0.1)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)
