"""uvicorn as Texel runs it: its settings, and a graceful drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from app.settings import Settings

log = logging.getLogger("texel")


def uvicorn_config(app, settings: Settings, **kwargs) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_config=None,
        timeout_keep_alive=settings.advanced.keep_alive_s,
        timeout_graceful_shutdown=int(settings.drain_timeout_s) + 5,
        **kwargs,
    )


class TexelServer(uvicorn.Server):
    """uvicorn, with a graceful drain on SIGTERM/SIGINT.

    The first signal marks the process not ready (load balancers stop sending),
    waits `shutdown_grace_s`, lets its requests finish, then stops. A second signal
    stops at once.
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
