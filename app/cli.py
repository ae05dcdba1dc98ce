"""The `texel` command: `texel serve --host H --port P`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import uvicorn

from app.main import build_app
from app.settings import Settings
from telemetry import setup_logging

log = logging.getLogger("texel")


class TexelServer(uvicorn.Server):
    """uvicorn, with a graceful drain on SIGTERM/SIGINT.

    The first signal marks the server not ready (load balancers stop sending),
    waits `shutdown_grace_s`, lets queued and running requests finish, then
    stops. A second signal stops at once.
    """

    def __init__(self, config: uvicorn.Config, runtime) -> None:
        super().__init__(config)
        self.runtime = runtime
        self._draining: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._draining is not None or self.should_exit:
            return super().handle_exit(sig, frame)
        log.info("received %s: draining", signal.Signals(sig).name)
        self.runtime.draining = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return super().handle_exit(sig, frame)
        self._draining = loop.create_task(self._drain_then_exit(sig, frame))

    async def _drain_then_exit(self, sig: int, frame) -> None:
        try:
            await asyncio.sleep(self.runtime.settings.shutdown_grace_s)
            await self.runtime.drain()
        finally:
            super().handle_exit(sig, frame)


def serve(host: str, port: int) -> None:
    settings = Settings()
    setup_logging(settings.log_format, settings.log_level)
    app = build_app(settings)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
    )
    TexelServer(config, app.state.runtime).run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="texel", description="Texel inference service")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="serve the HTTP API")
    serve_cmd.add_argument("--host", default="0.0.0.0")
    serve_cmd.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.host, args.port)
    else:  # pragma: no cover - argparse enforces the choices
        parser.print_help()
        sys.exit(2)


if __name__ == "__main__":
    main()
